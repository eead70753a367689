"""(TaskGraph requests, cluster, config) -> `Plan`.

EPL's rules, kept as they are:

* A model replica needs the sum of its TaskGraphs' `device_count` devices, or their
  maximum with `cluster.colocate_split_and_replicate` (all TaskGraphs then share the
  replica's devices).
* Data parallelism is nested outside automatically: the data-parallel degree is the
  job's device count divided by the devices per replica, which must divide evenly.
* Devices are ordered, then cut into consecutive per-replica blocks; inside a block the
  TaskGraphs take consecutive devices in TaskGraph order. With `prefer_intra_node` the
  order is worker-major (a replica stays on one worker when it fits), otherwise
  local-index-major (replicas spread across workers) - EPL's
  `cluster.device_place_prefer_intra_node`.

No TensorFlow here: device names come in as strings from `cluster.py`.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from epl_trainer.core.plan.ir import (
    KINDS,
    Device,
    Plan,
    PlanError,
    TaskGraph,
    check_virtual_stages,
)

__all__ = ["build_plan", "ordered_devices", "resolve_taskgraphs"]


def build_plan(
    taskgraphs: Sequence,
    cluster_devices: Sequence[Sequence[str]],
    worker_index: int,
    *,
    num_micro_batch: int,
    colocate_split_and_replicate: bool = False,
    prefer_intra_node: bool = True,
    pipeline_strategy: str = "PreferBackward",
    stage_costs: Sequence[float] | None = None,
    cut_description: str | None = None,
    virtual_stages: int = 1,
) -> Plan:
    """Places every TaskGraph of every model replica on the job's devices.

    Args:
      taskgraphs: TaskGraph requests in TaskGraph order; anything with `kind`,
        `device_count` (int or None) and `name` (str or None) attributes:
        `StrategySpec`, `replicate(...)`/`split(...)` objects, or resolved `TaskGraph`s.
      cluster_devices: `cluster_devices[w]` lists the device names of worker `w`.
      worker_index: the worker this process is.
      num_micro_batch: micro-batches per replica and step (pipeline or gradient
        accumulation), >= 1.
      colocate_split_and_replicate: all TaskGraphs of a replica share its devices.
      prefer_intra_node: keep a replica on one worker when it fits (see module doc).
      pipeline_strategy: EPL's `pipeline.strategy` ("PreferBackward" or
        "PreferForward"), recorded in the plan and shown by `summary()`.
      stage_costs: optional cost of each TaskGraph (one per TaskGraph, e.g. the
        forward FLOPs per sample `auto_partition` balanced), shown by `summary()`.
      cut_description: optional text saying where the model was cut.
      virtual_stages: `pipeline.virtual_stages` (interleaved 1F1B): a replica's T
        TaskGraphs run on T / v device slots, TaskGraph k on slot k mod (T / v), so each
        device hosts v stages that are not adjacent.

    Returns:
      The `Plan`.

    Raises:
      PlanError: with every term of the failed equation in the message.
    """
    _check_positive_int("num_micro_batch", num_micro_batch)
    per_worker = _check_cluster(cluster_devices, worker_index)
    worker_num = len(cluster_devices)
    total = worker_num * per_worker
    job = f"{total} = {_plural(worker_num, 'worker')} x {_plural(per_worker, 'device')}"
    resolved = resolve_taskgraphs(taskgraphs, total, colocate_split_and_replicate)
    check_virtual_stages(pipeline_strategy, virtual_stages, len(resolved))
    slots = _device_slots(resolved, virtual_stages)
    devices_per_replica = _devices_per_replica(slots, job, total, colocate_split_and_replicate)
    num_replicas = total // devices_per_replica
    order = ordered_devices(cluster_devices, prefer_intra_node)
    placement = []
    for replica in range(num_replicas):
        block = order[replica * devices_per_replica : (replica + 1) * devices_per_replica]
        placed = _place_replica(block, slots, colocate_split_and_replicate)
        placement.append(tuple(placed[k % len(slots)] for k in range(len(resolved))))
    return Plan(
        taskgraphs=resolved,
        num_replicas=num_replicas,
        devices_per_replica=devices_per_replica,
        placement=tuple(placement),
        num_micro_batch=num_micro_batch,
        worker_num=worker_num,
        worker_index=worker_index,
        colocate_split_and_replicate=bool(colocate_split_and_replicate),
        pipeline_strategy=pipeline_strategy,
        stage_costs=None if stage_costs is None else tuple(stage_costs),
        cut_description=cut_description,
        virtual_stages=virtual_stages,
    )


def _device_slots(taskgraphs: tuple[TaskGraph, ...], virtual_stages: int) -> tuple[TaskGraph, ...]:
    """The TaskGraphs that take devices of their own: all of them, or with
    `virtual_stages` v > 1 the first T / v, whose devices the others share round-robin."""
    slots = len(taskgraphs) // virtual_stages
    for tg in taskgraphs[slots:]:
        host = taskgraphs[tg.index % slots]
        if tg.device_count != host.device_count:
            raise PlanError(
                f"With pipeline.virtual_stages={virtual_stages}, TaskGraph {tg.name!r} runs on "
                f"the devices of {host.name!r}, so both need one device_count. Received: "
                f"{host.name}={host.device_count}, {tg.name}={tg.device_count}"
            )
    return taskgraphs[:slots]


def resolve_taskgraphs(
    taskgraphs: Sequence, total_devices: int, colocate_split_and_replicate: bool
) -> tuple[TaskGraph, ...]:
    """Turns TaskGraph requests into `TaskGraph`s with names and device counts.

    `replicate(None)` uses 1 device. `split(None)` spans the whole job when TaskGraphs
    are colocated; otherwise its size cannot be inferred and is an error.
    """
    if isinstance(taskgraphs, str | bytes) or not hasattr(taskgraphs, "__iter__"):
        raise PlanError(
            f"taskgraphs must be a sequence of TaskGraph specs. Received: {taskgraphs!r}"
        )
    taskgraphs = list(taskgraphs)
    if not taskgraphs:
        raise PlanError("A plan needs at least one TaskGraph. Received: taskgraphs=[]")
    fields = [_spec_fields(spec, index) for index, spec in enumerate(taskgraphs)]
    # Colocated with a split TaskGraph, replicate(None) spans the same devices (EPL's
    # recipe: replicate(n) features and split(n) classifier on the same n devices).
    # Likewise split(None) spans the replicated TaskGraphs' devices when they give a
    # count, and the whole job otherwise.
    split_counts = [count for kind, count, _ in fields if kind == "split"]
    replicate_counts = [c for kind, c, _ in fields if kind == "replicate" and c is not None]
    colocated_width = None
    if colocate_split_and_replicate and split_counts:
        given = [c for c in split_counts if c is not None] or [c for c in replicate_counts if c > 1]
        colocated_width = max(given, default=total_devices)
    resolved = []
    for index, (kind, device_count, name) in enumerate(fields):
        name = name if name is not None else f"taskgraph_{index}"
        if device_count is None and kind == "replicate":
            device_count = colocated_width or 1
        elif device_count is None:
            if colocated_width is None:
                raise PlanError(
                    f"split TaskGraph {name!r} has no device_count. Give it one "
                    f"(split(device_count=N)), or set "
                    f"cluster.colocate_split_and_replicate=True so it spans all "
                    f"{total_devices} devices of the job."
                )
            device_count = colocated_width
        resolved.append(TaskGraph(index=index, name=name, kind=kind, device_count=device_count))
    names = [tg.name for tg in resolved]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise PlanError(
            f"TaskGraph names must be unique. Received duplicates {duplicates} in {names}"
        )
    return tuple(resolved)


def ordered_devices(
    cluster_devices: Sequence[Sequence[str]], prefer_intra_node: bool = True
) -> list[Device]:
    """The job's devices in the order replica blocks are cut from.

    Worker-major (w0 d0, w0 d1, ..., w1 d0, ...) with `prefer_intra_node`, else
    local-index-major (w0 d0, w1 d0, w0 d1, w1 d1, ...).
    """
    devices = [
        [Device(worker=w, local_index=d, name=name) for d, name in enumerate(names)]
        for w, names in enumerate(cluster_devices)
    ]
    if prefer_intra_node:
        return [device for worker in devices for device in worker]
    per_worker = len(devices[0]) if devices else 0
    return [worker[d] for d in range(per_worker) for worker in devices]


def _spec_fields(spec, index: int) -> tuple[str, int | None, str | None]:
    try:
        kind, device_count, name = spec.kind, spec.device_count, spec.name
    except AttributeError:
        raise PlanError(
            f"TaskGraph {index} must have kind, device_count and name attributes "
            f"(a StrategySpec, replicate(...) or split(...)). Received: {spec!r}"
        ) from None
    if kind not in KINDS:
        raise PlanError(f"TaskGraph {index} has kind {kind!r}; expected one of {KINDS}.")
    if device_count is not None:
        _check_positive_int(f"device_count of TaskGraph {index} ({name or kind})", device_count)
        device_count = int(device_count)
    if name is not None and not isinstance(name, str):
        raise PlanError(f"TaskGraph {index} name must be a str or None. Received: {name!r}")
    return kind, device_count, name


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _check_positive_int(what: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise PlanError(f"{what} must be an int >= 1. Received: {value!r}")


def _check_cluster(cluster_devices: Sequence[Sequence[str]], worker_index: int) -> int:
    """Validates the cluster; returns the devices per worker."""
    if isinstance(cluster_devices, str) or not cluster_devices:
        raise PlanError(
            f"cluster_devices must list each worker's device names. Received: {cluster_devices!r}"
        )
    for w, names in enumerate(cluster_devices):
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise PlanError(
                f"cluster_devices[{w}] must be a list of device names. Received: {names!r}"
            )
    counts = [len(names) for names in cluster_devices]
    if len(set(counts)) != 1 or counts[0] == 0:
        raise PlanError(
            "Every worker must have the same, non-zero number of devices. "
            f"Received: devices per worker = {counts}"
        )
    names = [n for worker in cluster_devices for n in worker]
    if len(set(names)) != len(names):
        raise PlanError(f"Device names must be unique across the job. Received: {names}")
    if (
        isinstance(worker_index, bool)
        or not isinstance(worker_index, numbers.Integral)
        or not 0 <= worker_index < len(cluster_devices)
    ):
        raise PlanError(
            f"worker_index must be in [0, {len(cluster_devices)}). "
            f"Received: worker_index={worker_index!r}"
        )
    return counts[0]


def _devices_per_replica(
    taskgraphs: tuple[TaskGraph, ...], job: str, total: int, colocate: bool
) -> int:
    terms = [f"{tg.name}:{tg.device_count}" for tg in taskgraphs]
    counts = [tg.device_count for tg in taskgraphs]
    if colocate:
        per_replica = max(counts)
        equation = f"{per_replica} = max({', '.join(terms)})"
    else:
        per_replica = sum(counts)
        equation = f"{per_replica} = {' + '.join(terms)}"
    if per_replica > total:
        hint = ""
        if not colocate and len(taskgraphs) > 1 and max(counts) <= total:
            hint = (
                " With cluster.colocate_split_and_replicate=True the TaskGraphs share "
                f"devices and a replica needs only max(...) = {max(counts)}."
            )
        raise PlanError(
            f"Devices per model replica ({equation}) exceed the devices in the job ({job}).{hint}"
        )
    if total % per_replica:
        raise PlanError(
            f"Devices per model replica ({equation}) must divide the devices in the job ({job})."
        )
    return per_replica


def _place_replica(
    block: Sequence[Device], taskgraphs: tuple[TaskGraph, ...], colocate: bool
) -> tuple[tuple[Device, ...], ...]:
    if colocate:
        return tuple(tuple(block[: tg.device_count]) for tg in taskgraphs)
    placed, offset = [], 0
    for tg in taskgraphs:
        placed.append(tuple(block[offset : offset + tg.device_count]))
        offset += tg.device_count
    return tuple(placed)
