"""The parallel plan as plain data: TaskGraphs, devices and their placement.

No TensorFlow or Keras here, so plans can be built, printed, compared and tested in
any process. The planner (`core/plan/planner.py`) is the only producer of `Plan`s; everything
downstream (partition, state, program) reads them.

Vocabulary (EPL's): a *TaskGraph* is one annotated piece of the model (a `replicate`
or `split` scope); a *model replica* is one copy of all TaskGraphs; the data-parallel
degree (`num_replicas`) is how many model replicas the job runs.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

KINDS = ("replicate", "split")
# pipeline.strategy; the last runs several stages per device (pipeline.virtual_stages)
PIPELINE_STRATEGIES = ("PreferBackward", "PreferForward", "ZeroBubbleH1", "Interleaved1F1B")
INTERLEAVED = "Interleaved1F1B"

_DEVICE_SUFFIX = re.compile(r"(?:^|/)device:([A-Za-z_]+):(\d+)$")
_SUMMARY_MAX_REPLICAS = 8  # wider tables stop being readable; the rest is elided


class PlanError(ValueError):
    """The annotations, config and cluster do not make a valid parallel plan."""


class SplitError(ValueError):
    """A split annotation the engine cannot execute."""


@dataclass(frozen=True)
class StrategySpec:
    """An unresolved TaskGraph request, as annotations produce it.

    `device_count=None` means "let the planner decide": 1 for `replicate`, every
    device of the job for a colocated `split`. `name=None` gets `taskgraph_<index>`.
    """

    kind: str
    device_count: int | None = None
    name: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}. Received: kind={self.kind!r}")


@dataclass(frozen=True)
class TaskGraph:
    """One resolved TaskGraph."""

    index: int  # 0..T-1, order of creation
    name: str  # user's name or f"taskgraph_{index}"
    kind: str  # "replicate" or "split"
    device_count: int  # devices this TaskGraph uses in ONE model replica (>= 1)

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "name": self.name,
            "kind": self.kind,
            "device_count": self.device_count,
        }


@dataclass(frozen=True)
class Device:
    """One compute device of the job."""

    worker: int  # worker index
    local_index: int  # index among that worker's local devices
    name: str  # TensorFlow device name, e.g. "/job:worker/replica:0/task:1/device:CPU:2"

    @property
    def short_name(self) -> str:
        """Compact label for tables, e.g. "w1:CPU:2"."""
        match = _DEVICE_SUFFIX.search(self.name)
        if match:
            return f"w{self.worker}:{match.group(1).upper()}:{match.group(2)}"
        return f"w{self.worker}:dev{self.local_index}"

    def to_dict(self) -> dict:
        return {"worker": self.worker, "local_index": self.local_index, "name": self.name}


@dataclass(frozen=True)
class Plan:
    """Which devices run which TaskGraph of which model replica.

    `placement[replica][taskgraph]` holds the `taskgraph.device_count` devices that
    TaskGraph uses in that replica. Without `colocate_split_and_replicate` the
    TaskGraphs of a replica use disjoint devices; with it they share the first devices
    of the replica's block. With `virtual_stages` v > 1 (interleaved 1F1B) a replica's
    T TaskGraphs share T / v device slots round-robin: TaskGraph k uses slot k mod (T / v).
    """

    taskgraphs: tuple[TaskGraph, ...]
    num_replicas: int  # data-parallel degree over the whole job
    devices_per_replica: int
    placement: tuple[tuple[tuple[Device, ...], ...], ...]
    num_micro_batch: int
    worker_num: int
    worker_index: int  # the worker this process is
    colocate_split_and_replicate: bool
    pipeline_strategy: str = "PreferBackward"  # schedule of a multi-TaskGraph pipeline
    # Optional cost of each TaskGraph (e.g. forward FLOPs per sample from an automatic
    # partition) and a text saying where the model was cut; shown by summary().
    stage_costs: tuple[float, ...] | None = None
    cut_description: str | None = None
    virtual_stages: int = 1  # pipeline.virtual_stages: stages per device of a lane
    # What a Keras distribution's layouts run as (which variables compute sharded, which
    # are gathered on use: training/keras_distribution.py); shown by summary().
    layouts_description: str | None = None

    def __post_init__(self):
        # Internal invariant: the planner builds consistent plans; a hand-made Plan
        # (tests, from_dict) is checked here so a mistake surfaces at construction.
        if len(self.placement) != self.num_replicas:
            raise PlanError(
                f"placement has {len(self.placement)} replicas but num_replicas={self.num_replicas}"
            )
        for replica, row in enumerate(self.placement):
            if len(row) != len(self.taskgraphs):
                raise PlanError(
                    f"placement[{replica}] has {len(row)} entries for "
                    f"{len(self.taskgraphs)} TaskGraphs"
                )
            for taskgraph, devices in zip(self.taskgraphs, row, strict=True):
                if len(devices) != taskgraph.device_count:
                    raise PlanError(
                        f"placement[{replica}][{taskgraph.index}] has {len(devices)} devices "
                        f"but TaskGraph {taskgraph.name!r} has device_count="
                        f"{taskgraph.device_count}"
                    )
        if self.pipeline_strategy not in PIPELINE_STRATEGIES:
            raise PlanError(
                f"pipeline_strategy must be one of {PIPELINE_STRATEGIES}. "
                f"Received: pipeline_strategy={self.pipeline_strategy!r}"
            )
        check_virtual_stages(self.pipeline_strategy, self.virtual_stages, len(self.taskgraphs))
        if self.stage_costs is not None:
            object.__setattr__(self, "stage_costs", tuple(float(c) for c in self.stage_costs))
            if len(self.stage_costs) != len(self.taskgraphs):
                raise PlanError(
                    f"stage_costs has {len(self.stage_costs)} entries for "
                    f"{len(self.taskgraphs)} TaskGraphs. Received: stage_costs={self.stage_costs}"
                )

    # ----------------------------------------------------------------- queries
    @property
    def num_taskgraphs(self) -> int:
        return len(self.taskgraphs)

    @property
    def pipeline_devices(self) -> int:
        """Device slots of a replica's pipeline: the TaskGraphs divided by `virtual_stages`."""
        return len(self.taskgraphs) // self.virtual_stages

    @property
    def total_devices(self) -> int:
        return self.num_replicas * self.devices_per_replica

    @property
    def devices_per_worker(self) -> int:
        return self.total_devices // self.worker_num

    @property
    def global_batch_factor(self) -> int:
        """Global batch = data-parallel degree x micro-batch x num_micro_batch.

        This is that product without the micro-batch: multiply the per-replica
        micro-batch size by it to get the global batch size.
        """
        return self.num_replicas * self.num_micro_batch

    def replica_devices(self, replica: int) -> tuple[Device, ...]:
        """Every device replica `replica` uses, each once, in TaskGraph order."""
        seen: dict[Device, None] = {}
        for devices in self.placement[replica]:
            seen.update(dict.fromkeys(devices))
        return tuple(seen)

    def replica_workers(self, replica: int) -> tuple[int, ...]:
        """The workers hosting replica `replica`, ascending."""
        return tuple(sorted({device.worker for device in self.replica_devices(replica)}))

    def replicas_on_worker(self, worker: int) -> tuple[int, ...]:
        """Replicas whose devices are all on `worker`."""
        return tuple(r for r in range(self.num_replicas) if self.replica_workers(r) == (worker,))

    @property
    def local_replicas(self) -> tuple[int, ...]:
        """Replicas that live entirely on this process's worker."""
        return self.replicas_on_worker(self.worker_index)

    @property
    def replicas_here(self) -> tuple[int, ...]:
        """Replicas with at least one device on this process's worker (a replica whose
        stages span workers is computed in part by each of them)."""
        return tuple(
            r for r in range(self.num_replicas) if self.worker_index in self.replica_workers(r)
        )

    def taskgraph_devices(self, taskgraph_index: int) -> tuple[Device, ...]:
        """All devices hosting a TaskGraph, replica-major."""
        return tuple(device for row in self.placement for device in row[taskgraph_index])

    @property
    def stage_cost_spread(self) -> float | None:
        """max / min of `stage_costs` (inf if a stage costs 0), None without costs."""
        if not self.stage_costs:
            return None
        low, high = min(self.stage_costs), max(self.stage_costs)
        return high / low if low > 0 else (1.0 if high == 0 else math.inf)

    # ------------------------------------------------------------ rendering
    def summary(self) -> str:
        """A readable table: one row per TaskGraph, one column per replica."""
        shown = min(self.num_replicas, _SUMMARY_MAX_REPLICAS)
        costs = self.stage_costs
        header = ["TaskGraph", "kind", "devices"] + (["cost"] if costs else [])
        header += [f"replica {r}" for r in range(shown)]
        if shown < self.num_replicas:
            header.append(f"... ({self.num_replicas - shown} more)")
        rows = []
        for tg in self.taskgraphs:
            cells = [f"{tg.index} {tg.name}", tg.kind, str(tg.device_count)]
            cells += [format_count(costs[tg.index])] if costs else []
            cells += [_device_list(self.placement[r][tg.index]) for r in range(shown)]
            if shown < self.num_replicas:
                cells.append("...")
            rows.append(cells)
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        lines = [
            f"Plan: data-parallel degree {self.num_replicas}, "
            f"{self.devices_per_replica} device(s) per replica, "
            f"{self.num_micro_batch} micro-batch(es) per step "
            f"(global batch = {self.global_batch_factor} x micro-batch)",
            f"Cluster: {self.worker_num} worker(s) x {self.devices_per_worker} device(s), "
            f"this is worker {self.worker_index} (replicas here: "
            f"{list(self.replicas_here)}), colocate_split_and_replicate="
            f"{self.colocate_split_and_replicate}",
            _format_row(header, widths),
            _format_row(["-" * w for w in widths], widths),
        ]
        lines += [_format_row(row, widths) for row in rows]
        split = any(tg.kind == "split" for tg in self.taskgraphs)
        if split and (self.colocate_split_and_replicate or self.num_taskgraphs == 1):
            shared = "the TaskGraphs share each lane's device; " if self.num_taskgraphs > 1 else ""
            lines.append(f"Split: {shared}split layers are sharded across the devices of a replica")
        elif self.virtual_stages > 1:
            lines.append(
                f"Pipeline: {self.num_taskgraphs} TaskGraphs on {self.pipeline_devices} device "
                f"slot(s) ({self.virtual_stages} stages each, round-robin), strategy "
                f"{self.pipeline_strategy}"
            )
        elif self.num_taskgraphs > 1:
            lines.append(
                f"Pipeline: {self.num_taskgraphs} TaskGraphs, strategy {self.pipeline_strategy}"
            )
        if costs:
            spread = self.stage_cost_spread
            lines.append(
                f"Stage costs: {', '.join(format_count(c) for c in costs)}; "
                f"spread max/min = {spread:.3f}"
            )
        if self.cut_description:
            lines.append(f"Cut: {self.cut_description}")
        if self.layouts_description:
            lines.append(f"Keras layouts: {self.layouts_description}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def to_dict(self) -> dict:
        """JSON-serialisable form (e.g. to log the plan or send it to another process)."""
        return {
            "taskgraphs": [tg.to_dict() for tg in self.taskgraphs],
            "num_replicas": self.num_replicas,
            "devices_per_replica": self.devices_per_replica,
            "placement": [
                [[d.to_dict() for d in devices] for devices in row] for row in self.placement
            ],
            "num_micro_batch": self.num_micro_batch,
            "worker_num": self.worker_num,
            "worker_index": self.worker_index,
            "colocate_split_and_replicate": self.colocate_split_and_replicate,
            "pipeline_strategy": self.pipeline_strategy,
            "stage_costs": None if self.stage_costs is None else list(self.stage_costs),
            "cut_description": self.cut_description,
            "layouts_description": self.layouts_description,
            "virtual_stages": self.virtual_stages,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        """Inverse of `to_dict`."""
        return cls(
            taskgraphs=tuple(TaskGraph(**tg) for tg in data["taskgraphs"]),
            num_replicas=data["num_replicas"],
            devices_per_replica=data["devices_per_replica"],
            placement=tuple(
                tuple(tuple(Device(**d) for d in devices) for devices in row)
                for row in data["placement"]
            ),
            num_micro_batch=data["num_micro_batch"],
            worker_num=data["worker_num"],
            worker_index=data["worker_index"],
            colocate_split_and_replicate=data["colocate_split_and_replicate"],
            # Absent from plans serialised before these fields existed.
            pipeline_strategy=data.get("pipeline_strategy", "PreferBackward"),
            stage_costs=data.get("stage_costs"),
            cut_description=data.get("cut_description"),
            layouts_description=data.get("layouts_description"),
            virtual_stages=data.get("virtual_stages", 1),
        )


def check_virtual_stages(strategy: str, virtual_stages, num_taskgraphs: int) -> None:
    """`pipeline.virtual_stages` must fit the strategy and divide the stages.

    Raises:
      PlanError: naming the values.
    """
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int):
        raise PlanError(
            f"pipeline.virtual_stages must be an int >= 1. Received: {virtual_stages!r}"
        )
    if strategy == INTERLEAVED and virtual_stages < 2:
        raise PlanError(
            "pipeline.strategy='Interleaved1F1B' runs several stages per device: set "
            "pipeline.virtual_stages >= 2 (stages per device), or use 'PreferBackward'. "
            f"Received: pipeline.virtual_stages={virtual_stages}"
        )
    if strategy != INTERLEAVED and virtual_stages != 1:
        raise PlanError(
            "pipeline.virtual_stages > 1 (several stages per device) needs "
            f"pipeline.strategy='{INTERLEAVED}'. Received: pipeline.strategy={strategy!r}, "
            f"pipeline.virtual_stages={virtual_stages}"
        )
    if num_taskgraphs % virtual_stages:
        raise PlanError(
            f"pipeline.virtual_stages={virtual_stages} stages per device must divide the "
            f"stages. Received: {num_taskgraphs} TaskGraphs (stages), "
            f"pipeline.virtual_stages={virtual_stages}"
        )


def format_count(value: float) -> str:
    """A count with 3 significant digits and an SI suffix: 950, 12.3k, 4.5M, 1.2G."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}" if value != int(value) else str(int(value))


def _device_list(devices: tuple[Device, ...]) -> str:
    """Short names joined by commas; runs of 3+ consecutive devices shown as a range."""
    parts: list[str] = []
    run: list[Device] = []

    def flush():
        if len(run) >= 3:
            last = run[-1].short_name.rsplit(":", 1)[-1]
            parts.append(f"{run[0].short_name}-{last}")
        else:
            parts.extend(d.short_name for d in run)
        run.clear()

    for device in devices:
        if run and not _follows(run[-1], device):
            flush()
        run.append(device)
    flush()
    return ",".join(parts)


def _follows(prev: Device, device: Device) -> bool:
    head, _, index = prev.short_name.rpartition(":")
    other_head, _, other_index = device.short_name.rpartition(":")
    return (
        head == other_head
        and index.isdigit()
        and other_index.isdigit()
        and int(other_index) == int(index) + 1
    )


def _format_row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()
