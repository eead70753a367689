"""Interleaved 1F1B ("Interleaved1F1B", Megatron-LM's virtual pipeline stages): the
schedule as data (Megatron's order, valid for every micro-batch count, its bubble and
memory), the plan's round-robin placement, the config's refusals, and training: the
weights equal 1F1B's (same stages, one device each) within 1e-6 with every mode that
combines with pipelines, the step chains each device's tasks across its stages, and
stages on two worker processes equal single-device Keras.

The schedules accumulate each stage's gradients in the same micro-batch order, so only
fused kernels' rounding may differ (observed: 0.0 on these models).
"""

import itertools
import pickle

import keras
import numpy as np
import pytest
import tensorflow as tf
from _models import LOSS
from test_pipeline import STAGE_MAPS, _ops_of, _traced_graph, skip_data, skip_model
from test_zero_bubble import (
    _assert_strategies_agree,
    _data,
    _weights_after_fit,
    bn_model,
    embedding_data,
    embedding_model,
)

import epl_trainer as epl
from epl_trainer.core.plan import schedule as schedule_lib
from epl_trainer.core.plan.ir import PlanError
from epl_trainer.core.plan.schedule import BACKWARD, FORWARD, ScheduleError, Task

ATOL = 1e-6
INTERLEAVED = "Interleaved1F1B"
# skip_model in six stages (so two devices hold three each, or three hold two)
SIX_STAGES = {"block_0": 0, "block_1": 1, "block_2": 2, "skip_add": 3, "block_3": 4, "head": 5}


# ------------------------------------------------------------------ the schedule
def _order(schedule, device):
    return " ".join(f"{task}s{stage}" for stage, task in schedule.device_orders[device])


def test_megatron_order_on_two_devices():
    """p = 2, v = 2, M = 4, as Megatron-LM's forward_backward_pipelining_with_interleaving
    runs it: device 0 warms up with 2 (p-1) + (v-1) p = 4 forwards (micro-batches 0, 1
    through chunk 0, then chunk 1), device 1 with 2; then one forward, one backward."""
    schedule = schedule_lib.interleaved_schedule(4, 4, 2)
    assert _order(schedule, 0) == (
        "F0s0 F1s0 F0s2 F1s2 F2s0 B0s2 F3s0 B1s2 F2s2 B0s0 F3s2 B1s0 B2s2 B3s2 B2s0 B3s0"
    )
    assert _order(schedule, 1) == (
        "F0s1 F1s1 F0s3 B0s3 F1s3 B1s3 F2s1 B0s1 F3s1 B1s1 F2s3 B2s3 F3s3 B3s3 B2s1 B3s1"
    )
    assert schedule.stage_device == (0, 1, 0, 1)
    assert schedule_lib.stage_chains(schedule) == (0, 1, 0, 1)
    # Still one task tuple per stage: stage 2's, in device 0's order.
    assert [str(t) for t in schedule[2]] == ["F0", "F1", "B0", "B1", "F2", "F3", "B2", "B3"]
    assert schedule == schedule_lib.make_schedule(INTERLEAVED, 4, 4, 2)
    assert pickle.loads(pickle.dumps(schedule)).device_orders == schedule.device_orders


def test_every_size_is_valid_and_beats_one_f_one_b():
    """Every p <= 8, v <= 4, M <= 24 (also M not a multiple of p, and M < p) simulates
    without deadlock; the bubble is (p-1)/(vM+p-1) for M a multiple of p and never above
    1F1B's on p devices; each stage's backwards run in ascending micro-batch order (1F1B's
    accumulation order); device 0 keeps p (1 + (p-1)/(p v)) micro-batches' worth of
    activations for M > p a multiple of p (Korthikanti et al. 2022)."""
    for p, v, m in itertools.product(range(1, 9), range(1, 5), range(1, 25)):
        schedule = schedule_lib.interleaved_schedule(p * v, m, v)
        schedule_lib.validate(schedule)
        bubble = schedule_lib.simulated_bubble(schedule)
        one_f_one_b = schedule_lib.simulated_bubble(schedule_lib.one_f_one_b_schedule(p, m))
        assert bubble <= one_f_one_b + 1e-12, (p, v, m)
        if v > 1 and m % p == 0:
            formula = schedule_lib.bubble_fraction(p * v, m, INTERLEAVED, v)
            assert formula == pytest.approx((p - 1) / (v * m + p - 1))
            assert bubble == pytest.approx(formula), (p, v, m)
        for tasks in schedule:
            backwards = [t.micro_batch for t in tasks if t.kind == BACKWARD]
            assert backwards == list(range(m))
        if m > p and m % p == 0:
            worth = schedule_lib.device_peak_in_flight(schedule, [1 / v] * (p * v))
            assert worth[0] == pytest.approx(p * (1 + (p - 1) / (p * v)))


def test_micro_batches_not_a_multiple_of_the_devices():
    # M = 5 on p = 2: groups of 2 and 3 (the last takes the remainder), each through
    # chunk 0 then chunk 1; device 0 warms up with 2 (p-1) + (v-1) 3 = 5 forwards (the
    # last group's size for p), device 1 with 3, so that every backward follows its
    # forward (with Megatron's (v-1) p, device 1's B2 of stage 3 would come before F2).
    schedule = schedule_lib.interleaved_schedule(4, 5, 2)
    assert _order(schedule, 0).startswith("F0s0 F1s0 F0s2 F1s2 F2s0 F3s0 B0s2 F4s0 B1s2")
    assert _order(schedule, 1) == (
        "F0s1 F1s1 F0s3 F1s3 B0s3 F2s1 B1s3 F3s1 B0s1 F4s1 B1s1 F2s3 B2s3 F3s3 B3s3 F4s3 "
        "B4s3 B2s1 B3s1 B4s1"
    )
    assert schedule_lib.simulated_bubble(schedule) < schedule_lib.simulated_bubble(
        schedule_lib.one_f_one_b_schedule(2, 5)
    )


def test_schedule_errors_name_the_values():
    with pytest.raises(ScheduleError, match=r"virtual_stages must be an integer >= 2.*=1"):
        schedule_lib.make_schedule(INTERLEAVED, 4, 4)
    with pytest.raises(ScheduleError, match=r"needs pipeline.strategy='Interleaved1F1B'"):
        schedule_lib.make_schedule("PreferBackward", 4, 4, 2)
    with pytest.raises(ScheduleError, match=r"num_stages=4, virtual_stages=3"):
        schedule_lib.make_schedule(INTERLEAVED, 4, 4, 3)
    with pytest.raises(ScheduleError, match=r"Stage 1 has tasks on devices 0 and 1"):
        schedule_lib.PlacedSchedule([[(1, Task(FORWARD, 0))], [(1, Task(BACKWARD, 0))]], 2)


def test_a_device_order_that_deadlocks_is_reported_per_device():
    # Device 0 runs stage 2's forward before stage 1 (device 1) can have run its own,
    # which waits for stage 0: device 0's order blocks itself.
    f, b = Task(FORWARD, 0), Task(BACKWARD, 0)
    bad = schedule_lib.PlacedSchedule(
        [[(2, f), (0, f), (2, b), (0, b)], [(1, f), (1, b)]], num_stages=3
    )
    with pytest.raises(
        ScheduleError,
        match=r"deadlocks at time step 0: device 0 \(stage 2\) waits at F0 for F0 on stage 1; "
        r"device 1 \(stage 1\) waits at F0 for F0 on stage 0\.",
    ):
        schedule_lib.validate(bad)


# ------------------------------------------------------------------ plan and config
def _trainer(stages, devices, num_micro_batch=4, **config):
    return epl.EPLTrainer(
        skip_model(),
        LOSS,
        keras.optimizers.SGD(0.1),
        stages=stages,
        config={
            "cluster.virtual_devices": devices,
            "pipeline.num_micro_batch": num_micro_batch,
            "pipeline.strategy": INTERLEAVED,
            **config,
        },
    )


def test_stage_k_is_placed_on_device_k_mod_p():
    trainer = _trainer(SIX_STAGES, 6, **{"pipeline.virtual_stages": 3})  # 3 replicas of p=2
    plan = trainer.plan
    assert (plan.num_replicas, plan.devices_per_replica, plan.pipeline_devices) == (3, 2, 2)
    for replica in range(3):
        row = plan.placement[replica]
        assert [d.local_index for (d,) in row] == [2 * replica + k % 2 for k in range(6)]
    names = [d.rsplit("/", 1)[1] for d in trainer.lanes[1].devices]
    assert names == ["device:CPU:2", "device:CPU:3"] * 3
    assert "6 TaskGraphs on 2 device slot(s) (3 stages each, round-robin)" in plan.summary()
    assert type(plan).from_dict(plan.to_dict()) == plan


@pytest.mark.parametrize(
    ("stages", "config", "match"),
    [
        (4, {}, r"set pipeline.virtual_stages >= 2.*Received: pipeline.virtual_stages=1"),
        (4, {"pipeline.virtual_stages": 3}, r"Received: 4 TaskGraphs \(stages\), .*=3"),
        (2, {"pipeline.virtual_stages": 4}, r"Received: 2 TaskGraphs \(stages\), .*=4"),
        (
            4,
            {"pipeline.virtual_stages": 2, "pipeline.strategy": "ZeroBubbleH1"},
            r"needs pipeline.strategy='Interleaved1F1B'. Received: "
            r"pipeline.strategy='ZeroBubbleH1', pipeline.virtual_stages=2",
        ),
    ],
)
def test_impossible_settings_name_the_values(stages, config, match):
    with pytest.raises(PlanError, match=match):
        _trainer(STAGE_MAPS[stages], 4, **config)


def test_virtual_stages_below_one_is_a_config_error():
    with pytest.raises(epl.ConfigError, match=r"'pipeline.virtual_stages' must be >= 1"):
        epl.Config({"pipeline.virtual_stages": 0})


def test_split_layers_are_refused():
    from epl_trainer.core.plan import rules
    from epl_trainer.core.plan.ir import SplitError

    config = {"cluster.virtual_devices": 2, "cluster.colocate_split_and_replicate": True}
    epl.init(epl.Config({**config, "pipeline.strategy": INTERLEAVED, "pipeline.virtual_stages": 2}))
    with epl.replicate(device_count=2):
        inputs = keras.Input((8,))
        h = keras.layers.Dense(16, name="features")(inputs)
    with epl.split(device_count=2):
        outputs = keras.layers.Dense(4, name="classifier")(h)
    model = keras.Model(inputs, outputs)
    with pytest.raises(SplitError, match=r"split TaskGraphs.*pipeline.virtual_stages=2") as error:
        epl.EPLTrainer(model, LOSS, "sgd")
    assert rules.REFUSALS["interleaved_split"].why in str(error.value)


# ------------------------------------------------------------------ training
def _assert_as_one_f_one_b(stages, replicas, num_micro_batch, batch, v=2, **kwargs):
    """Interleaved on `stages / v` devices per replica against 1F1B on `stages`."""
    reference, _ = _weights_after_fit(
        "PreferBackward", stages, stages * replicas, num_micro_batch, batch, **kwargs
    )
    weights, trainer = _weights_after_fit(
        INTERLEAVED,
        stages,
        stages // v * replicas,
        num_micro_batch,
        batch,
        **{"pipeline.virtual_stages": v},
        **kwargs,
    )
    assert trainer.engine.program.schedule.device_orders == (
        schedule_lib.interleaved_schedule(stages, num_micro_batch, v).device_orders
    )
    assert trainer.plan.num_replicas == replicas
    initial = skip_model().get_weights()
    assert max(float(np.abs(a - b).max()) for a, b in zip(weights, initial)) > 1e-3  # trained
    difference = max(float(np.abs(a - b).max()) for a, b in zip(weights, reference))
    assert difference < ATOL, difference
    return trainer


@pytest.mark.parametrize(
    ("stages", "v", "num_micro_batch", "batch", "optimizer"),
    # 5 micro-batches on p = 2 devices (not a multiple); one micro-batch; M < p = 4.
    # SGD at every size: equal weights are equal gradients, whatever the order the
    # schedule ran the micro-batches in. Adam adds nothing to that order (it applies the
    # same summed gradients once per step), so it runs at one size only; Adam over the
    # 4-micro-batch schedule runs in test_interleaved_with_zero and test_interleaved_with
    # (2 replicas). Trimmed for the suite's time: Adam at the other three sizes.
    [
        (4, 2, 4, 16, "sgd"),
        (4, 2, 5, 15, "sgd"),
        (4, 2, 5, 15, "adam"),
        (4, 2, 1, 16, "sgd"),
        (4, 2, 3, 15, "sgd"),
    ],
)
def test_interleaved_trains_as_one_f_one_b(stages, v, num_micro_batch, batch, optimizer):
    _assert_as_one_f_one_b(stages, 1, num_micro_batch, batch, v, optimizer=optimizer)


def test_interleaved_with_other_stage_and_device_counts(monkeypatch):
    monkeypatch.setitem(STAGE_MAPS, 6, SIX_STAGES)
    _assert_as_one_f_one_b(6, 1, 4, 16, v=3)  # p = 2, v = 3
    _assert_as_one_f_one_b(6, 1, 3, 15, v=2)  # p = 3, M = 3
    # p = 1: every stage on one device, whose order must respect its own stages.
    _assert_as_one_f_one_b(4, 1, 2, 16, v=4)


@pytest.mark.parametrize(
    "level",
    [
        pytest.param("v1", marks=pytest.mark.combines("zero_v1+pipeline+data_parallel")),
        pytest.param("v2", marks=pytest.mark.combines("zero_v2+pipeline+data_parallel")),
    ],
)
def test_interleaved_with_zero(level):
    # 2 replicas of 4 stages on 2 devices each; v1 reduce-scatters each backward's
    # gradients over the replicas, the groups of stages 0 and 2 on the same devices.
    _assert_as_one_f_one_b(4, 2, 4, 16, optimizer="adam", **{"zero.level": level})


@pytest.mark.combines("amp+pipeline")
def test_interleaved_with_amp():
    _assert_as_one_f_one_b(4, 1, 4, 16, **{"amp.level": "O1", "amp.dtype": "bfloat16"})


@pytest.mark.combines("gradient_checkpoint+pipeline")
def test_interleaved_with_gradient_checkpointing():
    trainer = _assert_as_one_f_one_b(4, 1, 5, 15, **{"gradient_checkpoint.type": "auto"})
    assert trainer.engine.program.recomputed


@pytest.mark.combines("jit_compile+pipeline")
def test_interleaved_with_xla_stages():
    _assert_as_one_f_one_b(4, 1, 4, 16, jit_compile=True)


@pytest.mark.parametrize(
    "setting",
    [
        pytest.param(
            {"offload.level": "v0"}, marks=pytest.mark.combines("offload+pipeline+data_parallel")
        ),
        pytest.param(
            {"steps_per_execution": 3}, marks=pytest.mark.combines("steps_per_execution+pipeline")
        ),
    ],
    ids=["offload", "steps_per_execution"],
)
def test_interleaved_with(setting):
    _assert_as_one_f_one_b(4, 2, 4, 16, optimizer="adam", **setting)


def _one_f_one_b_and_interleaved(devices: int, v: int = 2) -> dict:
    return {
        "PreferBackward": {"cluster.virtual_devices": devices},
        INTERLEAVED: {"cluster.virtual_devices": devices // v, "pipeline.virtual_stages": v},
    }


@pytest.mark.combines("sync_batch_norm+pipeline+data_parallel")
def test_interleaved_with_synchronized_batch_norm():
    # 2 replicas of 4 stages (two BatchNorms, on stages 1 and 3, devices 1 and 1).
    x, y = _data(16)
    _assert_strategies_agree(
        bn_model,
        {"block_0": 0, "block_1": 1, "block_2": 2, "norm|head": 3},
        x,
        y,
        lambda: keras.optimizers.SGD(0.1),
        strategies=_one_f_one_b_and_interleaved(8),
        **{"pipeline.num_micro_batch": 2, "batch_norm.synchronized": True},
    )


@pytest.mark.parametrize("sparse", [True, False])
def test_interleaved_with_an_embedding(sparse):
    x, y = embedding_data()
    _assert_strategies_agree(
        embedding_model,
        {"embed": 0, "pool": 1, "block": 2, "head": 3},
        x,
        y,
        lambda: keras.optimizers.Adam(0.01),
        strategies=_one_f_one_b_and_interleaved(4),
        **{"pipeline.num_micro_batch": 4, "communication.sparse_as_dense": not sparse},
    )


@pytest.mark.combines("tied_weights+pipeline")
def test_interleaved_with_tied_weights():
    # The embedding matrix is used by stage 0 (device 0) and stage 3 (device 1); stage
    # 3's copy is updated from stage 0's after each step.
    from test_tied_weights import tied_data, tied_model

    x, y = tied_data()
    _assert_strategies_agree(
        lambda: tied_model(reverse_call=False),
        {"embed": 0, "block_0": 1, "block_1": 2, "norm|logits": 3},
        x,
        y,
        lambda: keras.optimizers.Adam(0.02),
        strategies=_one_f_one_b_and_interleaved(4),
        **{"pipeline.num_micro_batch": 4},
    )


# ------------------------------------------------------------------ the built step
def test_the_step_chains_each_device_across_its_stages():
    """Consecutive tasks of a device are joined by a control edge even when they belong to
    different stages (device 0: F1 of stage 0, then F0 of stage 2)."""
    x, y = skip_data()
    trainer = _trainer(STAGE_MAPS[4], 2, **{"pipeline.virtual_stages": 2})
    graph = _traced_graph(trainer, x, y)
    schedule = trainer.engine.program.schedule
    crossing = 0
    for pairs in schedule.device_orders:
        for (s0, before), (s1, after) in itertools.pairwise(pairs):
            before_ops = {op.name for op in _ops_of(graph, 0, s0, before)}
            after_ops = _ops_of(graph, 0, s1, after)
            edges = [c for op in after_ops for c in op.control_inputs if c.name in before_ops]
            assert edges, f"no control edge from {before} of stage {s0} to {after} of {s1}"
            crossing += s0 != s1
    assert crossing >= 8
    lane = trainer.lanes[0]
    for stage in range(4):  # every computing op of a stage on its device, k mod p
        ops = [op for t in schedule[stage] for op in _ops_of(graph, 0, stage, t) if op.device]
        assert ops and {op.device for op in ops} == {lane.devices[stage % 2]}


def test_task_clock_times_each_device_in_its_order():
    from epl_trainer.core.engine.pipeline import TaskClock

    trainer = _trainer(STAGE_MAPS[4], 2, **{"pipeline.virtual_stages": 2})
    x, y = skip_data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    clock = TaskClock()
    trainer.runtime.ensure_for(dataset).program.hooks.task_clock = clock
    trainer.fit(dataset, steps_per_epoch=2, verbose=0)
    times = {(s, t): (a, b) for s, t, a, b in clock.read()}
    schedule = trainer.engine.program.schedule
    assert len(times) == sum(len(tasks) for tasks in schedule)
    for pairs in schedule.device_orders:  # a device's task starts after its previous ends
        for previous, task in itertools.pairwise(pairs):
            assert times[task][0] >= times[previous][1]


# Interleaved 1F1B with stages on two worker processes:
# test_span_workers.py::test_interleaved_with_stages_on_two_workers (a run of that file's
# 2-worker job, which starts its processes once for all its runs).


def test_plot_draws_one_row_per_device():
    pytest.importorskip("matplotlib")
    from epl_trainer.training.plot import _schedule_figure

    schedule = schedule_lib.interleaved_schedule(4, 8, 2)
    figure = _schedule_figure(schedule)
    axes = figure.axes[0]
    boxes = [p for p in axes.patches if (p.get_gid() or "").startswith("task:")]
    assert len(boxes) == 2 * 4 * 8
    assert [t.get_text() for t in axes.get_yticklabels()] == ["device 0", "device 1"]
    # Unit time per task, as drawn: device 1 ends its 32 tasks at the makespan.
    makespan = 1 + max(step for _, step, _ in schedule_lib.timeline(schedule))
    bubble = 1 - 64 / (2 * makespan)
    assert axes.get_title() == (
        f"Interleaved1F1B (v=2): 4 stages on 2 devices x 8 micro-batches, {makespan} steps, "
        f"bubble {bubble:.1%}"
    )
    chunk_1 = [b for b in boxes if int(b.get_gid().split(":")[1]) >= 2]  # stages 2 and 3
    assert len(chunk_1) == 32 and {b.get_alpha() for b in chunk_1} == {0.55}
