"""Pipeline schedules as data: exact orders, validation, simulation. Pure Python."""

import itertools
import os
import subprocess
import sys

import pytest

from epl_trainer.core.plan.schedule import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    ScheduleError,
    Task,
    bubble_fraction,
    execution_order,
    gpipe_schedule,
    make_schedule,
    one_f_one_b_schedule,
    peak_in_flight,
    simulated_bubble,
    timeline,
    validate,
    work_costs,
    zero_bubble_h1_schedule,
)

SIZES = list(itertools.product(range(1, 6), range(1, 10)))  # (S, M)
BUILDERS = [gpipe_schedule, one_f_one_b_schedule]


def parse(*stages: str):
    """`parse("F0 F1 B0 B1", ...)` -> Schedule."""
    return tuple(tuple(Task(word[0], int(word[1:])) for word in stage.split()) for stage in stages)


def render(schedule) -> list[str]:
    return [" ".join(str(task) for task in tasks) for tasks in schedule]


def makespan(schedule) -> int:
    return 1 + max(step for _, step, _ in timeline(schedule))


# ------------------------------------------------------------------- Task
def test_task_str_and_order():
    assert str(Task(FORWARD, 3)) == "F3"
    assert str(Task(BACKWARD, 0)) == "B0"
    assert Task("F", 1) == Task("F", 1)
    assert sorted([Task("F", 2), Task("F", 0)]) == [Task("F", 0), Task("F", 2)]


@pytest.mark.parametrize(
    ("kind", "micro_batch", "match"),
    [("X", 0, "kind='X'"), ("F", -1, "micro_batch=-1"), ("B", 1.5, "micro_batch=1.5")],
)
def test_task_rejects_bad_fields(kind, micro_batch, match):
    with pytest.raises(ScheduleError, match=match):
        Task(kind, micro_batch)


# -------------------------------------------------------- exact orders by hand
@pytest.mark.parametrize(
    ("num_stages", "num_micro_batch", "expected"),
    [
        (2, 1, ["F0 B0", "F0 B0"]),
        (2, 4, ["F0 F1 F2 F3 B0 B1 B2 B3"] * 2),
        (3, 2, ["F0 F1 B0 B1"] * 3),
        (4, 2, ["F0 F1 B0 B1"] * 4),
        (4, 8, ["F0 F1 F2 F3 F4 F5 F6 F7 B0 B1 B2 B3 B4 B5 B6 B7"] * 4),
    ],
)
def test_gpipe_orders(num_stages, num_micro_batch, expected):
    assert render(gpipe_schedule(num_stages, num_micro_batch)) == expected


@pytest.mark.parametrize(
    ("num_stages", "num_micro_batch", "expected"),
    [
        (2, 1, ["F0 B0", "F0 B0"]),
        (
            2,
            4,
            [
                "F0 F1 B0 F2 B1 F3 B2 B3",
                "F0 B0 F1 B1 F2 B2 F3 B3",
            ],
        ),
        (3, 2, ["F0 F1 B0 B1", "F0 F1 B0 B1", "F0 B0 F1 B1"]),
        # M < S - 1: warm-up is capped at M forwards.
        (4, 2, ["F0 F1 B0 B1", "F0 F1 B0 B1", "F0 F1 B0 B1", "F0 B0 F1 B1"]),
        (
            4,
            8,
            [
                "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
                "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
                "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
                "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
            ],
        ),
    ],
)
def test_one_f_one_b_orders(num_stages, num_micro_batch, expected):
    assert render(one_f_one_b_schedule(num_stages, num_micro_batch)) == expected


def test_single_stage_is_gradient_accumulation_in_both_strategies():
    assert render(gpipe_schedule(1, 3)) == ["F0 F1 F2 B0 B1 B2"]
    assert render(one_f_one_b_schedule(1, 3)) == ["F0 B0 F1 B1 F2 B2"]


@pytest.mark.parametrize(("num_stages", "num_micro_batch"), SIZES)
def test_backwards_ascending_in_both_strategies(num_stages, num_micro_batch):
    # Same accumulation order -> identical numerics between the two strategies.
    for builder in BUILDERS:
        for tasks in builder(num_stages, num_micro_batch):
            backwards = [t.micro_batch for t in tasks if t.kind == BACKWARD]
            assert backwards == list(range(num_micro_batch))


# ---------------------------------------------------------------- make_schedule
def test_make_schedule_maps_config_strategies():
    assert make_schedule("PreferForward", 3, 4) == gpipe_schedule(3, 4)
    assert make_schedule("PreferBackward", 3, 4) == one_f_one_b_schedule(3, 4)


def test_make_schedule_unknown_strategy():
    with pytest.raises(ScheduleError, match=r"PreferBackward.*Received: strategy='1F1B'"):
        make_schedule("1F1B", 2, 2)


@pytest.mark.parametrize(
    ("num_stages", "num_micro_batch", "match"),
    [(0, 2, "num_stages"), (2, 0, "num_micro_batch"), (2.0, 2, "num_stages"), (2, True, "num_")],
)
def test_make_schedule_rejects_bad_sizes(num_stages, num_micro_batch, match):
    with pytest.raises(ScheduleError, match=match):
        make_schedule("PreferBackward", num_stages, num_micro_batch)


def test_schedule_error_is_a_value_error():
    assert issubclass(ScheduleError, ValueError)


# -------------------------------------------------------------------- validate
@pytest.mark.parametrize(("num_stages", "num_micro_batch"), SIZES)
def test_validate_accepts_both_strategies(num_stages, num_micro_batch):
    for builder in BUILDERS:
        validate(builder(num_stages, num_micro_batch))


def test_validate_rejects_missing_task():
    with pytest.raises(ScheduleError, match="Stage 1 never runs B1"):
        validate(parse("F0 F1 B0 B1", "F0 F1 B0"))


def test_validate_rejects_missing_middle_micro_batch():
    with pytest.raises(ScheduleError, match="Stage 0 never runs F1"):
        validate(parse("F0 F2 B0 B2", "F0 F1 F2 B0 B1 B2"))


def test_validate_rejects_backward_before_forward():
    with pytest.raises(ScheduleError, match="Stage 0 runs B1 at position 1 before F1"):
        validate(parse("F0 B1 F1 B0", "F0 F1 B0 B1"))


def test_validate_rejects_duplicate():
    with pytest.raises(ScheduleError, match="Stage 1 runs F0 twice"):
        validate(parse("F0 B0", "F0 F0 B0"))


def test_validate_rejects_deadlock():
    # Stage 1 wants F1 before B0, but stage 0 only sends F1 after receiving B0.
    schedule = parse("F0 B0 F1 B1", "F0 F1 B0 B1")
    with pytest.raises(
        ScheduleError,
        match=r"deadlocks at time step 2: stage 0 waits at B0 for B0 on stage 1; "
        r"stage 1 waits at F1 for F1 on stage 0",
    ):
        validate(schedule)
    with pytest.raises(ScheduleError, match="deadlocks"):
        execution_order(schedule)
    with pytest.raises(ScheduleError, match="deadlocks"):
        timeline(schedule)


def test_validate_rejects_three_stage_cycle():
    # Stage 0 holds F1 back until B0 returns, but B0 leaves stage 2 only after F1 arrived.
    with pytest.raises(
        ScheduleError,
        match=r"time step 3: stage 0 waits at B0 for B0 on stage 1; "
        r"stage 1 waits at F1 for F1 on stage 0; stage 2 waits at F1 for F1 on stage 1\.",
    ):
        validate(parse("F0 B0 F1 B1", "F0 F1 B0 B1", "F0 F1 B0 B1"))


@pytest.mark.parametrize(
    ("schedule", "match"),
    [((), "at least one stage"), (((),), "no tasks"), ((("F0",),), "non-Task")],
)
def test_validate_rejects_malformed(schedule, match):
    with pytest.raises(ScheduleError, match=match):
        validate(schedule)


# ------------------------------------------------------------ execution_order
def test_execution_order_by_hand():
    order = execution_order(gpipe_schedule(2, 2))
    assert [(stage, str(task)) for stage, task in order] == [
        (0, "F0"),
        (0, "F1"),
        (1, "F0"),
        (1, "F1"),
        (1, "B0"),
        (0, "B0"),
        (1, "B1"),
        (0, "B1"),
    ]


@pytest.mark.parametrize(("num_stages", "num_micro_batch"), SIZES)
def test_execution_order_respects_dependencies(num_stages, num_micro_batch):
    for builder in BUILDERS:
        schedule = builder(num_stages, num_micro_batch)
        order = execution_order(schedule)
        assert len(order) == 2 * num_stages * num_micro_batch
        position = {entry: i for i, entry in enumerate(order)}
        assert len(position) == len(order)
        for stage, tasks in enumerate(schedule):
            # each stage's own order is kept
            assert [task for s, task in order if s == stage] == list(tasks)
            for m in range(num_micro_batch):
                forward, backward = (stage, Task("F", m)), (stage, Task("B", m))
                assert position[forward] < position[backward]
                if stage > 0:
                    assert position[(stage - 1, Task("F", m))] < position[forward]
                if stage < num_stages - 1:
                    assert position[(stage + 1, Task("B", m))] < position[backward]


def test_execution_order_is_the_same_in_every_process():
    """Every worker computes the order on its own and the collectives must meet: the
    order may not depend on hash randomisation (set or dict order of strings)."""
    code = (
        "from epl_trainer.core.plan.schedule import execution_order, one_f_one_b_schedule;"
        "print(execution_order(one_f_one_b_schedule(4, 8)))"
    )
    outputs = set()
    for hash_seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        run = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
        )
        outputs.add(run.stdout)
    assert len(outputs) == 1
    assert outputs.pop().strip() == str(execution_order(one_f_one_b_schedule(4, 8)))


# ---------------------------------------------------------- timeline, bubbles
def test_timeline_by_hand_one_f_one_b():
    steps = {(stage, str(task)): step for stage, step, task in timeline(one_f_one_b_schedule(2, 2))}
    assert steps == {
        (0, "F0"): 0,
        (0, "F1"): 1,
        (1, "F0"): 1,
        (1, "B0"): 2,
        (1, "F1"): 3,
        (0, "B0"): 3,
        (1, "B1"): 4,
        (0, "B1"): 5,
    }


@pytest.mark.parametrize(("num_stages", "num_micro_batch"), SIZES)
def test_unit_time_makespan_and_bubble(num_stages, num_micro_batch):
    expected = 2 * (num_micro_batch + num_stages - 1)
    for builder in BUILDERS:
        schedule = builder(num_stages, num_micro_batch)
        entries = timeline(schedule)
        assert len(entries) == 2 * num_stages * num_micro_batch
        # one task per stage per step
        assert len({(stage, step) for stage, step, _ in entries}) == len(entries)
        span = makespan(schedule)
        assert span == expected, builder.__name__
        idle = 1 - len(entries) / (num_stages * span)
        assert idle == pytest.approx(bubble_fraction(num_stages, num_micro_batch))


def test_bubble_fraction_values():
    assert bubble_fraction(1, 4) == 0.0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(2, 1) == pytest.approx(0.5)


# --------------------------------------------------------------- peak_in_flight
@pytest.mark.parametrize(("num_stages", "num_micro_batch"), SIZES)
def test_peak_in_flight(num_stages, num_micro_batch):
    assert (
        peak_in_flight(gpipe_schedule(num_stages, num_micro_batch))
        == [num_micro_batch] * num_stages
    )
    assert peak_in_flight(one_f_one_b_schedule(num_stages, num_micro_batch)) == [
        min(num_stages - s, num_micro_batch) for s in range(num_stages)
    ]


def test_peak_in_flight_by_hand():
    assert peak_in_flight(one_f_one_b_schedule(4, 8)) == [4, 3, 2, 1]
    assert peak_in_flight(one_f_one_b_schedule(4, 2)) == [2, 2, 2, 1]
    assert peak_in_flight(gpipe_schedule(4, 8)) == [8, 8, 8, 8]


# ------------------------------------------------------------------- ZB-H1
@pytest.mark.parametrize(
    ("num_stages", "num_micro_batch", "expected"),
    [
        (1, 3, ["F0 B0 W0 F1 B1 W1 F2 B2 W2"]),
        (2, 4, ["F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3", "F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3"]),
        (
            4,
            8,
            [
                # Forwards and Bs as 1F1B; stage s keeps s Ws pending, run in the cool-down.
                "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7",
                "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7",
                "F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7",
                "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7",
            ],
        ),
    ],
)
def test_zero_bubble_h1_orders(num_stages, num_micro_batch, expected):
    assert render(zero_bubble_h1_schedule(num_stages, num_micro_batch)) == expected
    assert make_schedule("ZeroBubbleH1", num_stages, num_micro_batch) == (
        zero_bubble_h1_schedule(num_stages, num_micro_batch)
    )


@pytest.mark.parametrize(("num_stages", "num_micro_batch"), SIZES)
def test_zero_bubble_h1_keeps_one_f_one_b_order_of_forwards_and_backwards(
    num_stages, num_micro_batch
):
    zb = zero_bubble_h1_schedule(num_stages, num_micro_batch)
    validate(zb)
    without_weights = tuple(tuple(t for t in tasks if t.kind != WEIGHT) for tasks in zb)
    assert without_weights == one_f_one_b_schedule(num_stages, num_micro_batch)
    for tasks in zb:  # Ws ascending: gradients accumulate in 1F1B's order
        assert [t.micro_batch for t in tasks if t.kind == WEIGHT] == list(range(num_micro_batch))


@pytest.mark.parametrize(("num_stages", "num_micro_batch"), SIZES)
def test_zero_bubble_h1_bubble_is_a_third_of_one_f_one_b(num_stages, num_micro_batch):
    zb = zero_bubble_h1_schedule(num_stages, num_micro_batch)
    one_f_one_b = one_f_one_b_schedule(num_stages, num_micro_batch)
    costs = work_costs(zb)
    assert costs == {FORWARD: 1, BACKWARD: 1, WEIGHT: 1}
    starts = timeline(zb, costs)
    makespan = max(step + costs[task.kind] for _, step, task in starts)
    # 1F1B's unsplit backward costs B + W: the same work, (S-1)(F+B+W) idle per stage.
    assert simulated_bubble(one_f_one_b) == pytest.approx(
        bubble_fraction(num_stages, num_micro_batch)
    )
    if num_micro_batch >= num_stages:
        # Idle S - 1 units per stage (the paper: (S-1)(T_F + T_B - T_W)).
        assert makespan == 3 * num_micro_batch + num_stages - 1
        idle = simulated_bubble(zb)
        assert idle == pytest.approx(bubble_fraction(num_stages, num_micro_batch, "ZeroBubbleH1"))
        assert idle * num_stages * makespan / (num_stages * 3 * num_micro_batch) == pytest.approx(
            (num_stages - 1) / (3 * num_micro_batch)  # bubble over work, the paper's form
        )
    assert simulated_bubble(zb) <= simulated_bubble(one_f_one_b)


def test_zero_bubble_h1_bubble_by_hand():
    assert simulated_bubble(zero_bubble_h1_schedule(2, 8)) == pytest.approx(1 / 25)
    assert simulated_bubble(one_f_one_b_schedule(2, 8)) == pytest.approx(1 / 9)
    assert bubble_fraction(4, 8, "ZeroBubbleH1") == pytest.approx(3 / 27)
    assert bubble_fraction(16, 8, "ZeroBubbleH1") == pytest.approx(15 / 39)
    with pytest.raises(ScheduleError, match="strategy='Nope'"):
        bubble_fraction(2, 2, "Nope")


@pytest.mark.parametrize(("num_stages", "num_micro_batch"), SIZES)
def test_zero_bubble_h1_in_flight(num_stages, num_micro_batch):
    # Counted until W: every stage as many as 1F1B's stage 0.
    assert (
        peak_in_flight(zero_bubble_h1_schedule(num_stages, num_micro_batch))
        == [min(num_stages, num_micro_batch)] * num_stages
    )


def test_validate_split_backward():
    validate(parse("F0 B0 W0", "F0 B0 W0"))
    with pytest.raises(ScheduleError, match="runs W0 at position 1 before B0"):
        validate(parse("F0 W0 B0", "F0 B0 W0"))
    with pytest.raises(ScheduleError, match="Stage 1 never runs W1"):
        validate(parse("F0 F1 B0 B1 W0 W1", "F0 B0 W0 F1 B1"))
    with pytest.raises(ScheduleError, match="kind='X'"):
        Task("X", 0)


def test_weight_gradients_wait_for_nothing_across_stages():
    # Stage 0's W0 may run before stage 1 has done anything but F0 and B0.
    steps = {
        (stage, str(task)): step for stage, step, task in timeline(parse("F0 B0 W0", "F0 B0 W0"))
    }
    assert steps == {
        (0, "F0"): 0, (1, "F0"): 1, (1, "B0"): 2, (1, "W0"): 3, (0, "B0"): 3, (0, "W0"): 4,
    }  # fmt: skip
