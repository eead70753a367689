"""Pipeline schedules as data: which forward / backward each stage runs, in which order.

A schedule is a tuple with one entry per stage; `schedule[stage]` is the ordered tuple
of `Task`s that stage runs in one training step. The program builder turns that order
into control dependencies; everything here is plain Python so schedules can be built,
checked, simulated and plotted without TensorFlow.

Dependencies between stages (the only ones a pipeline has):

* `F(s, m)` needs `F(s-1, m)`: a stage's input is the previous stage's output.
* `B(s, m)` needs `B(s+1, m)`: a stage's output gradient is the next stage's input
  gradient; and `F(s, m)` on the same stage, whose activations it differentiates.

Time is simulated in unit steps (a forward and a backward each take one step), which is
enough to order ops deterministically, count bubbles and draw the schedule.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

__all__ = [
    "BACKWARD",
    "FORWARD",
    "STRATEGIES",
    "Schedule",
    "ScheduleError",
    "Task",
    "bubble_fraction",
    "execution_order",
    "gpipe_schedule",
    "make_schedule",
    "one_f_one_b_schedule",
    "peak_in_flight",
    "timeline",
    "validate",
]

FORWARD = "F"
BACKWARD = "B"
STRATEGIES = ("PreferForward", "PreferBackward")  # config key pipeline.strategy


class ScheduleError(ValueError):
    """A pipeline schedule is malformed or cannot execute."""


@dataclass(frozen=True, order=True)
class Task:
    """One forward or backward of one micro-batch on one stage."""

    kind: str  # FORWARD or BACKWARD
    micro_batch: int

    def __post_init__(self):
        if self.kind not in (FORWARD, BACKWARD):
            raise ScheduleError(
                f"Task kind must be {FORWARD!r} or {BACKWARD!r}. Received: kind={self.kind!r}"
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


_BUILDERS = {"PreferForward": gpipe_schedule, "PreferBackward": one_f_one_b_schedule}


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
    the forward first; the cross-stage dependencies (module doc) must admit an order.

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
    for stage, tasks in enumerate(schedule):
        seen: set[Task] = set()
        for position, task in enumerate(tasks):
            if task in seen:
                raise ScheduleError(
                    f"Stage {stage} runs {task} twice (again at position {position})."
                )
            if task.kind == BACKWARD and Task(FORWARD, task.micro_batch) not in seen:
                raise ScheduleError(
                    f"Stage {stage} runs {task} at position {position} before F{task.micro_batch}."
                )
            seen.add(task)
        for m in range(num_micro_batch):
            for kind in (FORWARD, BACKWARD):
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
    return (stage + 1, task) if stage < num_stages - 1 else None


def _simulate(schedule: Schedule) -> dict[tuple[int, Task], int]:
    """Unit-time run: `{(stage, task): time step}`.

    Each step, every stage runs its next task if that task's dependency finished in an
    earlier step; a step where no stage can move while tasks remain is a deadlock.
    """
    _check_structure(schedule)
    num_stages = len(schedule)
    finished: dict[tuple[int, Task], int] = {}
    position = [0] * num_stages
    remaining = sum(len(tasks) for tasks in schedule)
    step = 0
    while remaining:
        ran = []
        for stage, tasks in enumerate(schedule):
            if position[stage] == len(tasks):
                continue
            dependency = _dependency(num_stages, stage, tasks[position[stage]])
            if dependency is None or dependency in finished:
                ran.append((stage, tasks[position[stage]]))
        if not ran:
            raise ScheduleError(_deadlock_message(schedule, position, step))
        for stage, task in ran:
            finished[(stage, task)] = step
            position[stage] += 1
        remaining -= len(ran)
        step += 1
    return finished


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


def timeline(schedule: Schedule) -> list[tuple[int, int, Task]]:
    """`(stage, time step, task)` for every task, sorted by stage then time.

    Unit costs: a forward and a backward each take one step. Used for plotting and
    bubble counting; the makespan is `1 + max(time step)`.
    """
    times = _simulate(schedule)
    return sorted((stage, step, task) for (stage, task), step in times.items())


def bubble_fraction(num_stages: int, num_micro_batch: int) -> float:
    """GPipe's idle fraction `(S-1) / (M+S-1)` of a pipeline with equal stage costs."""
    _check_sizes(num_stages, num_micro_batch)
    return (num_stages - 1) / (num_micro_batch + num_stages - 1)


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per stage, the most micro-batches whose forward ran but backward has not.

    That is the number of activation sets the stage keeps alive: `M` for GPipe,
    `min(S - s, M)` for 1F1B.
    """
    _check_structure(schedule)
    peaks = []
    for tasks in schedule:
        alive = peak = 0
        for task in tasks:
            alive += 1 if task.kind == FORWARD else -1
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
