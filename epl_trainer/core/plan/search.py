"""The fastest layouts of a job that fit: a search over `step_time.Layout`s.

`search` enumerates data x tensor x pipeline degrees that multiply to the job's devices,
micro-batch sizes and counts that make the global batch, schedules (with
Interleaved1F1B's virtual stages), ZeRO levels, gradient checkpointing and offload;
predicts each with `step_time.predict`; keeps those whose largest device peak fits the
device's memory; and returns the fastest first.

Gradient checkpointing and offload only add time in the model (a recomputed forward; the
host link and host memory), so a layout is tried with them only when it does not fit
without: the same best layouts as trying every combination, with far fewer predictions
(`tests/test_plan_search.py` compares with the exhaustive enumeration).
"""

from __future__ import annotations

import dataclasses
import itertools

from epl_trainer.core.plan.devices import DeviceSpec
from epl_trainer.core.plan.estimate import ZERO_LEVELS, ModelCost
from epl_trainer.core.plan.ir import INTERLEAVED, PIPELINE_STRATEGIES, PlanError
from epl_trainer.core.plan.schedule import ScheduleError
from epl_trainer.core.plan.step_time import TENSOR_SPLIT_KINDS, Layout, Prediction, predict

__all__ = ["SearchResult", "SearchSpace", "candidate_layouts", "search"]

# (gc, offload) in the order tried: each later pair only when no earlier one fits.
_MEMORY_OPTIONS = ((False, False), (True, False), (False, True), (True, True))


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """What the search may choose; None: every value that divides the job.

    Attributes:
      tensor_parallel: degrees to try (None: divisors of the devices up to a node's
        devices, 1 for a model with no layer tensor parallelism splits).
      pipeline_parallel: devices per pipeline (None: divisors up to the model's stages).
      micro_batch_sizes: None: powers of 2 up to `max_micro_batch_size` that divide a
        replica's batch.
      schedules: `pipeline.strategy` values (with more than one device per pipeline).
      virtual_stages: stages per device for Interleaved1F1B.
      zero: `zero.level` values (with more than one data-parallel replica).
      gc, offload: whether to try gradient checkpointing / offload.
    """

    tensor_parallel: tuple[int, ...] | None = None
    pipeline_parallel: tuple[int, ...] | None = None
    micro_batch_sizes: tuple[int, ...] | None = None
    max_micro_batch_size: int = 8
    schedules: tuple[str, ...] = PIPELINE_STRATEGIES
    virtual_stages: tuple[int, ...] = (2,)
    zero: tuple[str, ...] = ZERO_LEVELS
    gc: bool = True
    offload: bool = True


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """The fitting layouts, fastest first, and how many predictions the search made."""

    layouts: tuple[Prediction, ...]
    evaluated: int
    candidates: int

    @property
    def best(self) -> Prediction | None:
        return self.layouts[0] if self.layouts else None


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidate_layouts(
    model: ModelCost,
    device: DeviceSpec,
    num_devices: int,
    global_batch: int,
    space: SearchSpace = SearchSpace(),
    **fixed,
):
    """Every layout of the space without its memory options (gc, offload): tuples of
    Layout keyword arguments. `fixed` are Layout fields every layout shares (amp,
    optimizer, overlap_grad_reduce, rank_order)."""
    splittable = any(node.kind in TENSOR_SPLIT_KINDS for node in model.nodes)
    tensor = space.tensor_parallel or [
        t for t in _divisors(num_devices) if t <= device.devices_per_node and (splittable or t == 1)
    ]
    for t in tensor:
        if num_devices % t:
            continue
        pipes = space.pipeline_parallel or [
            p for p in _divisors(num_devices // t) if p <= model.max_stages
        ]
        for p in pipes:
            if (num_devices // t) % p:
                continue
            d = num_devices // (t * p)
            if global_batch % d:
                continue
            replica_batch = global_batch // d
            sizes = space.micro_batch_sizes or [
                2**k for k in range(space.max_micro_batch_size.bit_length())
                if 2**k <= space.max_micro_batch_size
            ]  # fmt: skip
            for mb in sizes:
                if replica_batch % mb:
                    continue
                schedules = [("PreferBackward", 1)] if p == 1 else [
                    (s, v) for s in space.schedules
                    for v in (space.virtual_stages if s == INTERLEAVED else (1,))
                    if p * v <= model.max_stages
                ]  # fmt: skip
                levels = space.zero if d > 1 else ("",)
                for (schedule, v), zero in itertools.product(schedules, levels):
                    yield dict(
                        data_parallel=d, tensor_parallel=t, pipeline_parallel=p,
                        virtual_stages=v, num_micro_batch=replica_batch // mb,
                        micro_batch_size=mb, schedule=schedule, zero=zero, **fixed,
                    )  # fmt: skip


def search(
    model: ModelCost,
    device: DeviceSpec,
    num_devices: int,
    global_batch: int,
    space: SearchSpace = SearchSpace(),
    *,
    top: int = 5,
    exhaustive: bool = False,
    **fixed,
) -> SearchResult:
    """The `top` fastest fitting layouts of `model` on `num_devices` `device`s with
    `global_batch` samples per step.

    Args:
      exhaustive: predict every memory option of every layout (for checking the search).
      fixed: Layout fields every layout shares (amp, optimizer, overlap_grad_reduce,
        rank_order).
    """
    if num_devices < 1 or global_batch < 1:
        raise ValueError(
            "num_devices and global_batch must be >= 1. "
            f"Received: num_devices={num_devices}, global_batch={global_batch}"
        )
    options = [(gc, off) for gc, off in _MEMORY_OPTIONS
               if (space.gc or not gc) and (space.offload or not off)]  # fmt: skip
    fitting, evaluated, candidates = [], 0, 0
    for base in candidate_layouts(model, device, num_devices, global_batch, space, **fixed):
        candidates += 1
        found_at = None
        for rank, (gc, offload) in enumerate(options):
            # gc and offload only add time: once a lighter option set fits, a heavier one
            # that is not a superset of it can still fit with less time, a superset not.
            if (
                not exhaustive
                and found_at is not None
                and _superset(options[found_at], (gc, offload))
            ):
                continue
            try:
                prediction = predict(model, Layout(**base, gc=gc, offload=offload), device)
            except (ValueError, PlanError, ScheduleError):
                break  # the layout itself cannot be built (e.g. more stages than blocks)
            evaluated += 1
            if prediction.fits:
                fitting.append(prediction)
                if found_at is None:
                    found_at = rank
    fitting.sort(key=lambda p: (p.step_time_s, p.peak_memory_bytes, p.layout.describe()))
    return SearchResult(tuple(fitting[:top]), evaluated, candidates)


def _superset(lighter: tuple[bool, bool], heavier: tuple[bool, bool]) -> bool:
    return all(h >= light for light, h in zip(lighter, heavier))
