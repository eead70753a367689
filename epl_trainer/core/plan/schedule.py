"""Pipeline schedules as data: which forward / backward each stage runs, in which order.

A schedule is a tuple with one entry per stage; `schedule[stage]` is the ordered tuple
of `Task`s that stage runs in one training step. The program builder turns that order
into control dependencies; everything here is plain Python so schedules can be built,
checked, simulated and plotted without TensorFlow.

Dependencies between stages (the only ones a pipeline has):

* `F(s, m)` needs `F(s-1, m)`: a stage's input is the previous stage's output.
* `B(s, m)` needs `B(s+1, m)`: a stage's output gradient is the next stage's input
  gradient; and `F(s, m)` on the same stage, whose activations it differentiates.
* `W(s, m)`, in a schedule that splits the backward (zero bubble), needs only `B(s, m)`
  on the same stage: B then computes the gradient of the stage's inputs (what the
  previous stage waits for), W the gradient of its weights (what nobody waits for).

An interleaved schedule (Megatron's "virtual pipeline stages") runs several stages on one
device: it is a `PlacedSchedule`, still one task tuple per stage, plus each device's order
across its stages (`device_orders`), which the executor chains instead of each stage's.
Every other schedule runs stage d on device d.

Time is simulated in unit steps (by default every task takes one step), which is enough
to order ops deterministically and draw the schedule. Bubbles are counted with
`work_costs`: a forward, an input gradient and a weight gradient each one unit, so an
unsplit backward (both gradients) two.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

__all__ = [
    "BACKWARD",
    "FORWARD",
    "STRATEGIES",
    "WEIGHT",
    "PlacedSchedule",
    "Schedule",
    "ScheduleError",
    "Task",
    "bubble_fraction",
    "device_orders",
    "device_peak_in_flight",
    "execution_order",
    "gpipe_schedule",
    "interleaved_schedule",
    "make_schedule",
    "one_f_one_b_schedule",
    "peak_in_flight",
    "simulated_bubble",
    "splits_backward",
    "stage_chains",
    "timeline",
    "validate",
    "work_costs",
    "zero_bubble_h1_schedule",
]

FORWARD = "F"
BACKWARD = "B"
WEIGHT = "W"  # the weight-gradient half of a split backward
KINDS = (FORWARD, BACKWARD, WEIGHT)
# config key pipeline.strategy
STRATEGIES = ("PreferForward", "PreferBackward", "ZeroBubbleH1", "Interleaved1F1B")
INTERLEAVED = "Interleaved1F1B"  # the one strategy whose devices run several stages


class ScheduleError(ValueError):
    """A pipeline schedule is malformed or cannot execute."""


@dataclass(frozen=True, order=True)
class Task:
    """One forward, backward or weight gradient of one micro-batch on one stage."""

    kind: str  # FORWARD, BACKWARD or WEIGHT
    micro_batch: int

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ScheduleError(
                f"Task kind must be one of {list(KINDS)}. Received: kind={self.kind!r}"
            )
        if not _is_int(self.micro_batch) or self.micro_batch < 0:
            raise ScheduleError(
                "Task micro_batch must be an integer >= 0. "
                f"Received: micro_batch={self.micro_batch!r}"
            )

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


Schedule = tuple[tuple[Task, ...], ...]


class PlacedSchedule(tuple):
    """A schedule whose devices each run several stages (interleaved 1F1B).

    Still a tuple of per-stage task tuples (`schedule[stage]`, in the order the stage's
    device runs them), so whatever reads a stage's tasks reads them unchanged. Adds:

    Attributes:
      device_orders: `device_orders[d]`, the (stage, Task) pairs device d runs, in order.
      stage_device: `stage_device[s]`, the device running stage s.
    """

    device_orders: tuple[tuple[tuple[int, Task], ...], ...]
    stage_device: tuple[int, ...]

    def __new__(cls, device_orders, num_stages: int):
        stages: list[list[Task]] = [[] for _ in range(num_stages)]
        stage_device: list[int | None] = [None] * num_stages
        for device, pairs in enumerate(device_orders):
            for stage, task in pairs:
                if not _is_int(stage) or not 0 <= stage < num_stages:
                    raise ScheduleError(
                        f"Device {device} runs a task of stage {stage!r}, outside the "
                        f"{num_stages} stages."
                    )
                if stage_device[stage] not in (None, device):
                    raise ScheduleError(
                        f"Stage {stage} has tasks on devices {stage_device[stage]} and {device}."
                    )
                stage_device[stage] = device
                stages[stage].append(task)
        missing = [stage for stage, device in enumerate(stage_device) if device is None]
        if missing:
            raise ScheduleError(f"No device runs stage(s) {missing}.")
        self = super().__new__(cls, tuple(tuple(tasks) for tasks in stages))
        self.device_orders = tuple(tuple(pairs) for pairs in device_orders)
        self.stage_device = tuple(stage_device)
        return self

    def __reduce__(self):
        return (PlacedSchedule, (self.device_orders, len(self)))


def stage_chains(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the device whose order runs its tasks (stage d on d, unless placed):
    the tasks of one device follow each other in the compiled step."""
    if isinstance(schedule, PlacedSchedule):
        return schedule.stage_device
    return tuple(range(len(schedule)))


def device_orders(schedule: Schedule) -> tuple[tuple[tuple[int, Task], ...], ...]:
    """Per device, the (stage, Task) pairs it runs in order: a `PlacedSchedule`'s own,
    otherwise stage d on device d."""
    if isinstance(schedule, PlacedSchedule):
        return schedule.device_orders
    return tuple(tuple((stage, task) for task in tasks) for stage, tasks in enumerate(schedule))


# ------------------------------------------------------------------- builders
def gpipe_schedule(num_stages: int, num_micro_batch: int) -> Schedule:
    """EPL's "PreferForward" (GPipe): every forward, then every backward.

    Backwards run in ascending micro-batch order, as in 1F1B, so gradient accumulation
    sums in the same order under both strategies and gives bit-identical results.
    """
    _check_sizes(num_stages, num_micro_batch)
    forwards = tuple(Task(FORWARD, m) for m in range(num_micro_batch))
    backwards = tuple(Task(BACKWARD, m) for m in range(num_micro_batch))
    return tuple(forwards + backwards for _ in range(num_stages))


def one_f_one_b_schedule(num_stages: int, num_micro_batch: int) -> Schedule:
    """EPL's "PreferBackward" (PipeDream-flush, "1F1B").

    Stage `s` runs `min(S-1-s, M)` warm-up forwards, then alternates the next forward
    and the oldest pending backward until every forward is issued, then drains the
    remaining backwards. A stage therefore keeps at most `S - s` activation sets alive
    instead of GPipe's `M`.
    """
    _check_sizes(num_stages, num_micro_batch)
    schedule = []
    for stage in range(num_stages):
        warmup = min(num_stages - 1 - stage, num_micro_batch)
        tasks = [Task(FORWARD, m) for m in range(warmup)]
        next_backward = 0
        for m in range(warmup, num_micro_batch):
            tasks.append(Task(FORWARD, m))
            tasks.append(Task(BACKWARD, next_backward))
            next_backward += 1
        tasks += [Task(BACKWARD, m) for m in range(next_backward, num_micro_batch)]
        schedule.append(tuple(tasks))
    return tuple(schedule)


def zero_bubble_h1_schedule(num_stages: int, num_micro_batch: int) -> Schedule:
    """ "ZeroBubbleH1": ZB-H1 of Qi et al., "Zero Bubble Pipeline Parallelism" (2023).

    Each backward is split into B (the gradient of the stage's inputs, on the critical
    path) and W (the gradient of its weights, which no other stage waits for). Forwards
    and Bs follow 1F1B; stage `s` lets `s` micro-batches wait for their W (W runs once
    `s + 1` Bs are pending), so the later stages, which wait least in warm-up, do their
    Ws in the cool-down, where 1F1B leaves them idle. Every stage then keeps at most
    `min(S, M)` micro-batches between F and W, stage 0 as many as in 1F1B. With equal
    costs of F, B and W and `M >= S` the idle time is `S - 1` units per stage instead of
    1F1B's `3 (S - 1)`: a bubble of `(S-1)/(3M)` of the work (`bubble_fraction`).
    Ws run in ascending micro-batch order, so gradients accumulate in 1F1B's order.
    """
    _check_sizes(num_stages, num_micro_batch)
    return tuple(_zero_bubble_h1_stage(s, num_stages, num_micro_batch) for s in range(num_stages))


def _zero_bubble_h1_stage(stage: int, num_stages: int, num_micro_batch: int) -> tuple:
    warmup = min(num_stages - 1 - stage, num_micro_batch)
    tasks = [Task(FORWARD, m) for m in range(warmup)]
    weights = 0
    forwards = iter(range(warmup, num_micro_batch))
    for backward in range(num_micro_batch):
        forward = next(forwards, None)
        if forward is not None:
            tasks.append(Task(FORWARD, forward))
        tasks.append(Task(BACKWARD, backward))
        if backward + 1 - weights > stage:  # more than `stage` Ws pending: run the oldest
            tasks.append(Task(WEIGHT, weights))
            weights += 1
    tasks += [Task(WEIGHT, m) for m in range(weights, num_micro_batch)]
    return tuple(tasks)


def interleaved_schedule(
    num_stages: int, num_micro_batch: int, virtual_stages: int
) -> PlacedSchedule:
    """ "Interleaved1F1B": Megatron-LM's interleaved 1F1B (Narayanan et al. 2021, "Efficient
    Large-Scale Language Model Training on GPU Clusters", section 2.2.2).

    The `S` stages run on `p = S / v` devices (`v = virtual_stages`), device d hosting
    stages d, d+p, d+2p, ... (its `v` chunks). Each device runs its chunks' forwards in
    Megatron's order: groups of p micro-batches, each group through chunk 0, then chunk 1,
    ..., (the last group takes the remaining `M mod p` micro-batches too, as Megatron-core's
    schedule table does); its backwards in the same order with the chunks reversed.
    Device d runs `min(2 (p-1-d) + (v-1) g, v M)` warm-up forwards (g = p, or the last
    group's size when it is larger), then alternates one forward and one backward, then
    drains the backwards. A chunk is 1/v of the device's
    layers, so with equal stage costs and `M` a multiple of `p` the idle time is
    `(p-1)/v` of a micro-batch's forward and backward per device: a bubble of
    `(p-1)/(vM)` of the work (`bubble_fraction`), v times less than 1F1B on p devices;
    for `M > p` device 0 keeps `p v + p - 1` chunk activations alive at most,
    `p (1 + (p-1)/(p v))` micro-batches' worth of its layers against 1F1B's `p`
    (`device_peak_in_flight`).
    Each stage runs its backwards in ascending micro-batch order, so gradients
    accumulate in 1F1B's order. Megatron needs `M` to be a multiple of `p`; any `M >= 1`
    gives a valid, deadlock-free schedule here (checked by simulation for p <= 8, v <= 4,
    M <= 24: tests/test_interleaved.py), with a smaller bubble than 1F1B's but, for `M`
    not a multiple of `p`, `(v-1)(M mod p)` more chunk activations on every device.
    """
    _check_sizes(num_stages, num_micro_batch)
    if not _is_int(virtual_stages) or virtual_stages < 1 or num_stages % virtual_stages:
        raise ScheduleError(
            "virtual_stages must be an integer >= 1 that divides the stages. "
            f"Received: num_stages={num_stages}, virtual_stages={virtual_stages!r}"
        )
    devices = num_stages // virtual_stages
    table, group = _megatron_table(num_micro_batch, devices, virtual_stages)
    total = len(table)
    orders = []
    for device in range(devices):
        # Megatron's 2 (p-1-d) + (v-1) p, with the largest group for p: the backward of a
        # group's first micro-batch on the last chunk follows its forward there.
        warmup = min(2 * (devices - 1 - device) + (virtual_stages - 1) * group, total)

        def forward(k, device=device):
            micro_batch, chunk = table[k]
            return (chunk * devices + device, Task(FORWARD, micro_batch))

        def backward(k, device=device):
            micro_batch, chunk = table[k]
            return ((virtual_stages - 1 - chunk) * devices + device, Task(BACKWARD, micro_batch))

        order = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [forward(warmup + k), backward(k)]
        order += [backward(k) for k in range(total - warmup, total)]
        orders.append(order)
    return PlacedSchedule(orders, num_stages)


def _megatron_table(
    num_micro_batch: int, devices: int, chunks: int
) -> tuple[list[tuple[int, int]], int]:
    """(The k-th forward of every device as (micro-batch, chunk), the largest group): the
    micro-batches in groups of `devices`, the last group also taking the remainder, each
    group through every chunk in turn."""
    table, first, largest = [], 0, 0
    while first < num_micro_batch:
        last = first + devices if first + 2 * devices <= num_micro_batch else num_micro_batch
        table += [(m, c) for c in range(chunks) for m in range(first, last)]
        largest, first = max(largest, last - first), last
    return table, max(largest, devices)


_BUILDERS = {
    "PreferForward": gpipe_schedule,
    "PreferBackward": one_f_one_b_schedule,
    "ZeroBubbleH1": zero_bubble_h1_schedule,
}


def make_schedule(
    strategy: str, num_stages: int, num_micro_batch: int, virtual_stages: int = 1
) -> Schedule:
    """The schedule for config keys `pipeline.strategy` and `pipeline.virtual_stages`."""
    _check_strategy(strategy, virtual_stages)
    if strategy == INTERLEAVED:
        return interleaved_schedule(num_stages, num_micro_batch, virtual_stages)
    return _BUILDERS[strategy](num_stages, num_micro_batch)


def _check_strategy(strategy: str, virtual_stages: int) -> None:
    if strategy not in STRATEGIES:
        raise ScheduleError(
            f"Unknown pipeline strategy. Expected one of {list(STRATEGIES)}. "
            f"Received: strategy={strategy!r}"
        )
    if strategy == INTERLEAVED and (not _is_int(virtual_stages) or virtual_stages < 2):
        raise ScheduleError(
            "Interleaved1F1B runs several stages per device: pipeline.virtual_stages must be "
            "an integer >= 2 (with 1 it is PreferBackward). "
            f"Received: virtual_stages={virtual_stages!r}"
        )
    if strategy != INTERLEAVED and virtual_stages != 1:
        raise ScheduleError(
            f"pipeline.virtual_stages > 1 (several stages per device) needs "
            f"pipeline.strategy='{INTERLEAVED}'. Received: strategy={strategy!r}, "
            f"virtual_stages={virtual_stages!r}"
        )


# ----------------------------------------------------------------- checking
def validate(schedule: Schedule) -> None:
    """Checks that `schedule` is complete and can execute.

    Every stage must run the forward and the backward of every micro-batch exactly once,
    the forward first; a schedule that splits the backward runs W after B, on every
    stage and for every micro-batch; the cross-stage dependencies (module doc) must admit
    an order.

    Raises:
      ScheduleError: naming the stage and task at fault, or every blocked stage on a
        deadlock.
    """
    _simulate(schedule)


def _check_structure(schedule: Schedule) -> int:
    """Per-stage checks; returns the number of micro-batches."""
    if not isinstance(schedule, tuple | list) or not schedule:
        raise ScheduleError(f"A schedule needs at least one stage. Received: schedule={schedule!r}")
    for stage, tasks in enumerate(schedule):
        for task in tasks:
            if not isinstance(task, Task):
                raise ScheduleError(f"Stage {stage} holds a non-Task entry. Received: {task!r}")
    num_micro_batch = 1 + max((t.micro_batch for tasks in schedule for t in tasks), default=-1)
    if num_micro_batch == 0:
        raise ScheduleError("The schedule has no tasks.")
    kinds = (FORWARD, BACKWARD, WEIGHT) if splits_backward(schedule) else (FORWARD, BACKWARD)
    for stage, tasks in enumerate(schedule):
        seen: set[Task] = set()
        for position, task in enumerate(tasks):
            if task in seen:
                raise ScheduleError(
                    f"Stage {stage} runs {task} twice (again at position {position})."
                )
            before = {BACKWARD: FORWARD, WEIGHT: BACKWARD}.get(task.kind)
            if before is not None and Task(before, task.micro_batch) not in seen:
                raise ScheduleError(
                    f"Stage {stage} runs {task} at position {position} "
                    f"before {before}{task.micro_batch}."
                )
            seen.add(task)
        for m in range(num_micro_batch):
            for kind in kinds:
                if Task(kind, m) not in seen:
                    raise ScheduleError(
                        f"Stage {stage} never runs {kind}{m} "
                        f"(the schedule has {num_micro_batch} micro-batches)."
                    )
    return num_micro_batch


def _dependency(num_stages: int, stage: int, task: Task) -> tuple[int, Task] | None:
    """The cross-stage task `task` on `stage` waits for (same-stage order is implicit)."""
    if task.kind == FORWARD:
        return (stage - 1, task) if stage > 0 else None
    if task.kind == WEIGHT:
        return None
    return (stage + 1, task) if stage < num_stages - 1 else None


def _simulate(schedule: Schedule, costs: dict | None = None) -> dict[tuple[int, Task], int]:
    """A run in whole time steps: `{(stage, task): the step it starts}`.

    Every device (stage d on device d unless the schedule is a `PlacedSchedule`) starts
    its next task as soon as it is free and the task's dependency has finished; with
    `costs` None every task takes one step. A point where no device can start its next
    task while tasks remain is a deadlock.
    """
    _check_structure(schedule)
    num_stages = len(schedule)
    orders = device_orders(schedule)
    started: dict[tuple[int, Task], int] = {}
    finished: dict[tuple[int, Task], int] = {}
    position = [0] * len(orders)
    free_at = [0] * len(orders)
    remaining = sum(len(pairs) for pairs in orders)
    while remaining:
        moved = False
        for device, pairs in enumerate(orders):
            while position[device] < len(pairs):
                stage, task = pairs[position[device]]
                dependency = _dependency(num_stages, stage, task)
                if dependency is not None and dependency not in finished:
                    break
                start = max(free_at[device], 0 if dependency is None else finished[dependency])
                started[(stage, task)] = start
                cost = (costs or {}).get(task.kind, 1)
                free_at[device] = finished[(stage, task)] = start + cost
                position[device] += 1
                remaining -= 1
                moved = True
        if not moved:
            raise ScheduleError(_deadlock_message(schedule, position, max(free_at)))
    return started


def _deadlock_message(schedule: Schedule, position: list[int], step: int) -> str:
    num_stages = len(schedule)
    placed = isinstance(schedule, PlacedSchedule)
    waits = []
    for device, pairs in enumerate(device_orders(schedule)):
        if position[device] < len(pairs):
            stage, task = pairs[position[device]]
            dep_stage, dep_task = _dependency(num_stages, stage, task)
            where = f"device {device} (stage {stage})" if placed else f"stage {stage}"
            waits.append(f"{where} waits at {task} for {dep_task} on stage {dep_stage}")
    return f"The schedule deadlocks at time step {step}: " + "; ".join(waits) + "."


# ---------------------------------------------------------------- simulation
def execution_order(schedule: Schedule) -> list[tuple[int, Task]]:
    """A global `(stage, task)` order that respects every dependency.

    This is the order in which the program builder emits ops: tasks sorted by
    (unit time step, stage) from the simulation, hence deterministic.

    Raises:
      ScheduleError: the schedule is malformed or deadlocks.
    """
    times = _simulate(schedule)
    return sorted(times, key=lambda key: (times[key], key[0]))


def timeline(schedule: Schedule, costs: dict | None = None) -> list[tuple[int, int, Task]]:
    """`(stage, start time step, task)` for every task, sorted by stage then time.

    `costs`: time steps per task kind (`work_costs`); None: every task takes one step
    (what the plot draws; the makespan is then `1 + max(time step)`).
    """
    times = _simulate(schedule, costs)
    return sorted((stage, step, task) for (stage, task), step in times.items())


def splits_backward(schedule: Schedule) -> bool:
    """Whether the schedule runs each backward as B (input gradient) and W (weights)."""
    return any(task.kind == WEIGHT for tasks in schedule for task in tasks)


def work_costs(schedule: Schedule) -> dict:
    """Time steps per task kind with equal costs of a forward, an input gradient and a
    weight gradient (the zero-bubble paper's unit): an unsplit backward is both."""
    if splits_backward(schedule):
        return {FORWARD: 1, BACKWARD: 1, WEIGHT: 1}
    return {FORWARD: 1, BACKWARD: 2}


def simulated_bubble(schedule: Schedule) -> float:
    """The idle share of the devices' time when `schedule` runs with `work_costs`:
    1 - work / (devices x makespan)."""
    costs = work_costs(schedule)
    starts = _simulate(schedule, costs)
    makespan = max(step + costs[task.kind] for (_, task), step in starts.items())
    work = sum(costs[task.kind] for (_, task) in starts)
    return 1 - work / (len(device_orders(schedule)) * makespan)


def bubble_fraction(
    num_stages: int,
    num_micro_batch: int,
    strategy: str = "PreferBackward",
    virtual_stages: int = 1,
) -> float:
    """The idle share of a pipeline's time with equal stage costs, by formula.

    GPipe and 1F1B: `(S-1) / (M+S-1)`. ZB-H1: `(S-1) / (3M+S-1)` (idle `S - 1` units of
    `3M` units of work per stage: the paper's bubble `(S-1)/(3M)` of the work), exact with
    equal F, B and W costs for `M >= S`; with fewer micro-batches than stages the
    warm-up cannot fill and `simulated_bubble` of the schedule is the one to trust.
    Interleaved 1F1B on `p = S/v` devices: `(p-1) / (vM+p-1)` (Megatron's `(p-1)/(vM)` of
    the work), exact for `M` a multiple of `p`.
    """
    _check_sizes(num_stages, num_micro_batch)
    _check_strategy(strategy, virtual_stages)
    if num_stages % virtual_stages:
        raise ScheduleError(
            "virtual_stages must divide the stages. "
            f"Received: num_stages={num_stages}, virtual_stages={virtual_stages}"
        )
    devices = num_stages // virtual_stages
    work = num_micro_batch * (3 if strategy == "ZeroBubbleH1" else virtual_stages)
    return (devices - 1) / (work + devices - 1)


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per stage, the most micro-batches whose forward ran but whose backward has not
    finished (the W of a split backward; B otherwise).

    That is the number of activation sets the stage keeps alive: `M` for GPipe,
    `min(S - s, M)` for 1F1B, `min(S, M)` on every stage for ZB-H1 (whose micro-batches
    waiting for W keep only what the weight gradients read: the inputs of the stage's
    layers and the gradients of their outputs).
    """
    _check_structure(schedule)
    last = WEIGHT if splits_backward(schedule) else BACKWARD
    peaks = []
    for tasks in schedule:
        alive = peak = 0
        for task in tasks:
            alive += {FORWARD: 1, last: -1}.get(task.kind, 0)
            peak = max(peak, alive)
        peaks.append(peak)
    return peaks


def device_peak_in_flight(schedule: Schedule, weights=None) -> list[float]:
    """Per device, the most activation sets alive at once over its stages, each stage's
    weighted by `weights[stage]` (e.g. its activation bytes per micro-batch; default 1).

    For a schedule with one stage per device, `peak_in_flight` times the weights. For
    interleaved 1F1B with weights 1/v (a chunk holds 1/v of the device's layers), device
    0's is `p + (p-1)/v` micro-batches' worth for `M > p` a multiple of `p`: `1 + (p-1)/(p v)` times
    1F1B's `p` (Korthikanti et al. 2022, "Reducing Activation Recomputation", section 4.2.3).
    """
    _check_structure(schedule)
    weights = [1] * len(schedule) if weights is None else list(weights)
    last = WEIGHT if splits_backward(schedule) else BACKWARD
    peaks = []
    for pairs in device_orders(schedule):
        alive = peak = 0
        for stage, task in pairs:
            alive += {FORWARD: 1, last: -1}.get(task.kind, 0) * weights[stage]
            peak = max(peak, alive)
        peaks.append(peak)
    return peaks


# ------------------------------------------------------------------ helpers
def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_sizes(num_stages, num_micro_batch) -> None:
    if not _is_int(num_stages) or num_stages < 1:
        raise ScheduleError(f"num_stages must be an integer >= 1. Received: {num_stages!r}")
    if not _is_int(num_micro_batch) or num_micro_batch < 1:
        raise ScheduleError(
            f"num_micro_batch must be an integer >= 1. Received: {num_micro_batch!r}"
        )
