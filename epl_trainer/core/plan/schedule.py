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
    "Schedule",
    "ScheduleError",
    "Task",
    "bubble_fraction",
    "execution_order",
    "gpipe_schedule",
    "make_schedule",
    "one_f_one_b_schedule",
    "peak_in_flight",
    "simulated_bubble",
    "splits_backward",
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
STRATEGIES = ("PreferForward", "PreferBackward", "ZeroBubbleH1")


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


_BUILDERS = {
    "PreferForward": gpipe_schedule,
    "PreferBackward": one_f_one_b_schedule,
    "ZeroBubbleH1": zero_bubble_h1_schedule,
}


def make_schedule(strategy: str, num_stages: int, num_micro_batch: int) -> Schedule:
    """The schedule for config key `pipeline.strategy`."""
    builder = _BUILDERS.get(strategy)
    if builder is None:
        raise ScheduleError(
            f"Unknown pipeline strategy. Expected one of {list(STRATEGIES)}. "
            f"Received: strategy={strategy!r}"
        )
    return builder(num_stages, num_micro_batch)


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

    Every stage starts its next task as soon as the stage is free and the task's
    dependency has finished; with `costs` None every task takes one step. A point where
    no stage can start its next task while tasks remain is a deadlock.
    """
    _check_structure(schedule)
    num_stages = len(schedule)
    started: dict[tuple[int, Task], int] = {}
    finished: dict[tuple[int, Task], int] = {}
    position = [0] * num_stages
    free_at = [0] * num_stages
    remaining = sum(len(tasks) for tasks in schedule)
    while remaining:
        moved = False
        for stage, tasks in enumerate(schedule):
            while position[stage] < len(tasks):
                task = tasks[position[stage]]
                dependency = _dependency(num_stages, stage, task)
                if dependency is not None and dependency not in finished:
                    break
                start = max(free_at[stage], 0 if dependency is None else finished[dependency])
                started[(stage, task)] = start
                free_at[stage] = finished[(stage, task)] = start + (costs or {}).get(task.kind, 1)
                position[stage] += 1
                remaining -= 1
                moved = True
        if not moved:
            raise ScheduleError(_deadlock_message(schedule, position, max(free_at)))
    return started


def _deadlock_message(schedule: Schedule, position: list[int], step: int) -> str:
    num_stages = len(schedule)
    waits = []
    for stage, tasks in enumerate(schedule):
        if position[stage] < len(tasks):
            task = tasks[position[stage]]
            dep_stage, dep_task = _dependency(num_stages, stage, task)
            waits.append(f"stage {stage} waits at {task} for {dep_task} on stage {dep_stage}")
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
    """The idle share of the stages' time when `schedule` runs with `work_costs`:
    1 - work / (stages x makespan)."""
    costs = work_costs(schedule)
    starts = _simulate(schedule, costs)
    makespan = max(step + costs[task.kind] for (_, task), step in starts.items())
    work = sum(costs[task.kind] for (_, task) in starts)
    return 1 - work / (len(schedule) * makespan)


def bubble_fraction(
    num_stages: int, num_micro_batch: int, strategy: str = "PreferBackward"
) -> float:
    """The idle share of a pipeline's time with equal stage costs, by formula.

    GPipe and 1F1B: `(S-1) / (M+S-1)`. ZB-H1: `(S-1) / (3M+S-1)` (idle `S - 1` units of
    `3M` units of work per stage: the paper's bubble `(S-1)/(3M)` of the work), exact with
    equal F, B and W costs for `M >= S`; with fewer micro-batches than stages the
    warm-up cannot fill and `simulated_bubble` of the schedule is the one to trust.
    """
    _check_sizes(num_stages, num_micro_batch)
    if strategy not in _BUILDERS:
        raise ScheduleError(
            f"Unknown pipeline strategy. Expected one of {list(STRATEGIES)}. "
            f"Received: strategy={strategy!r}"
        )
    work = 3 * num_micro_batch if strategy == "ZeroBubbleH1" else num_micro_batch
    return (num_stages - 1) / (work + num_stages - 1)


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
