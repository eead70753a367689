"""`trainer.memory_report()`: bytes per device, read from the engine's own state.

Rows are devices; columns are what the engine keeps there: parameters (trainable and
non-trainable variable copies), optimizer state (slots and counters of the optimizer
copies placed there), and gradients after the reduction (the full stage gradients for
plain data parallelism, only the owned shard under ZeRO v1). Shared copies (offload)
count once. A device can appear with the role "host" and as a compute device when, as
with simulated CPU devices, the host CPU also computes.
"""

from __future__ import annotations

import dataclasses
import os

import psutil

from epl_trainer.core.engine.state import variable_bytes
from epl_trainer.core.engine.zero import is_gathered
from epl_trainer.core.graph.cost import format_bytes


@dataclasses.dataclass
class DeviceMemory:
    device: str
    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


@dataclasses.dataclass
class MemoryReport:
    devices: dict[str, DeviceMemory]

    def __getitem__(self, device: str) -> DeviceMemory:
        return self.devices[device]

    def totals(self) -> DeviceMemory:
        total = DeviceMemory("total")
        for row in self.devices.values():
            total.parameters += row.parameters
            total.gradients += row.gradients
            total.optimizer += row.optimizer
        return total

    def __str__(self) -> str:
        header = ("device", "parameters", "gradients", "optimizer", "total")
        rows = [*self.devices.values(), self.totals()]
        cells = [header] + [
            (
                r.device.rsplit("/", 1)[-1] if r.device != "total" else "total",
                format_bytes(r.parameters),
                format_bytes(r.gradients),
                format_bytes(r.optimizer),
                format_bytes(r.total),
            )
            for r in rows
        ]
        widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def build_report(state, update, lanes) -> MemoryReport:
    devices: dict[str, DeviceMemory] = {}

    def row(device: str) -> DeviceMemory:
        return devices.setdefault(device, DeviceMemory(device))

    for lane in lanes:  # compute devices appear even when they hold nothing (offload)
        for device in lane.devices:
            row(device)
    seen: set[int] = set()
    # ZeRO v2's lanes hold gathered stand-ins (no storage); its pieces are the parameters.
    held = [v for vs in state.trainable + state.non_trainable for v in vs if not is_gathered(v)]
    for variable in held + update.parameter_pieces():
        if variable is not None and id(variable) not in seen:
            seen.add(id(variable))
            row(variable.value.device).parameters += variable_bytes(variable)
    for variable in update.all_optimizer_variables():
        if id(variable) not in seen:
            seen.add(id(variable))
            row(variable.value.device).optimizer += variable_bytes(variable)
    for device, count in update.gradient_bytes().items():
        row(device).gradients += count
    return MemoryReport(devices)


class AllocatorStatsUnavailable(RuntimeError):
    """The device's allocator keeps no statistics (peak / current bytes)."""


def allocator_memory(device: str = "CPU:0") -> dict[str, int]:
    """`{"current", "peak"}` bytes of a device's allocator (process-wide on CPU: logical
    CPU devices share one allocator).

    Raises:
      AllocatorStatsUnavailable: the allocator keeps no statistics. TensorFlow's default
        CPU allocator keeps none; its BFC allocator does, and TensorFlow uses it only
        where oneDNN is on (by default only on some CPUs), or with
        `TF_CPU_ALLOCATOR_USE_BFC=true` set before TensorFlow starts, which
        `epl_trainer.runtime.cluster.configure_tensorflow` (and so `epl.init`) does.
    """
    import tensorflow as tf

    try:
        return tf.config.experimental.get_memory_info(device)
    except ValueError as e:
        raise _unavailable(device, e) from e


def reset_peak_memory(device: str = "CPU:0") -> None:
    """Starts a new peak for `allocator_memory(device)["peak"]` (same error when the
    allocator keeps no statistics)."""
    import tensorflow as tf

    try:
        tf.config.experimental.reset_memory_stats(device)
    except ValueError as e:
        raise _unavailable(device, e) from e


def _unavailable(device: str, error: Exception) -> AllocatorStatsUnavailable:
    return AllocatorStatsUnavailable(
        f"The allocator of {device!r} keeps no memory statistics ({error}). On CPU, "
        "TensorFlow keeps them only with its BFC allocator: call "
        "epl_trainer.runtime.cluster.configure_tensorflow() (or epl.init()) before TensorFlow "
        "starts, or set TF_CPU_ALLOCATOR_USE_BFC=true in the environment. Received: "
        f"TF_CPU_ALLOCATOR_USE_BFC={os.environ.get('TF_CPU_ALLOCATOR_USE_BFC')!r}, "
        f"TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS')!r}"
    )


def process_threads() -> int:
    """Threads of this process, TensorFlow's native ones included (psutil: any OS)."""
    return psutil.Process().num_threads()


def process_rss_mib() -> float:
    """Resident memory of this process in MiB (psutil: any OS)."""
    return psutil.Process().memory_info().rss / 2**20
