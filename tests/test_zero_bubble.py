"""ZB-H1 ("ZeroBubbleH1"): the backward split into B (input gradients) and W (weight
gradients) trains to 1F1B's weights, alone and with every mode that combines with
pipelines; the step holds W's ops back to W's place in the schedule and builds the
backward once.

Tolerance 1e-6: the weights after 3 steps; the schedules accumulate in the same order,
so only fused kernels' rounding may differ (observed <= ~1e-7).
"""

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf
from _models import LOSS
from test_pipeline import STAGE_MAPS, skip_model

import epl_trainer as epl
from epl_trainer.core.engine.pipeline.boundaries import LaneBoundaries
from epl_trainer.core.plan import schedule as schedule_lib

ATOL = 1e-6


def _data(batch):
    rng = np.random.default_rng(7)
    n = 3 * batch
    return rng.normal(size=(n, 8)).astype("float32"), rng.integers(0, 3, n).astype("int32")


def _trainer(strategy, stages, devices, num_micro_batch, optimizer="sgd", **config):
    model = skip_model()
    make = {"sgd": lambda: keras.optimizers.SGD(0.1), "adam": lambda: keras.optimizers.Adam(0.01)}
    jit = config.pop("jit_compile", None)
    steps_per_execution = config.pop("steps_per_execution", 1)
    trainer = epl.EPLTrainer(
        model,
        LOSS,
        make[optimizer](),
        stages=STAGE_MAPS[stages],
        jit_compile=jit,
        steps_per_execution=steps_per_execution,
        config={
            "cluster.virtual_devices": devices,
            "pipeline.num_micro_batch": num_micro_batch,
            "pipeline.strategy": strategy,
            **config,
        },
    )
    return trainer, model


def _weights_after_fit(strategy, stages, devices, num_micro_batch, batch, **kwargs):
    trainer, model = _trainer(strategy, stages, devices, num_micro_batch, **kwargs)
    x, y = _data(batch)
    trainer.fit(x, y, batch_size=batch, steps_per_epoch=3, verbose=0, shuffle=False)
    return model.get_weights(), trainer


def _assert_as_one_f_one_b(stages, devices, num_micro_batch, batch, **kwargs):
    reference, _ = _weights_after_fit(
        "PreferBackward", stages, devices, num_micro_batch, batch, **kwargs
    )
    weights, trainer = _weights_after_fit(
        "ZeroBubbleH1", stages, devices, num_micro_batch, batch, **kwargs
    )
    assert trainer.engine.program.schedule == schedule_lib.zero_bubble_h1_schedule(
        stages, num_micro_batch
    )
    initial = skip_model().get_weights()
    assert max(float(np.abs(a - b).max()) for a, b in zip(weights, initial)) > 1e-3  # trained
    difference = max(float(np.abs(a - b).max()) for a, b in zip(weights, reference))
    assert difference < ATOL, difference
    return trainer


@pytest.mark.parametrize(
    ("stages", "num_micro_batch", "batch", "optimizer"),
    # 5 micro-batches on 3 stages; one micro-batch. SGD at every size: equal weights are
    # equal gradients, however the schedule split and ordered the backward (B, then W).
    # Adam adds nothing to that order (it applies the same summed gradients once per
    # step), so it runs at one size only; Adam over 2 stages x 4 micro-batches runs in
    # test_zero_bubble_h1_with_zero and test_zero_bubble_h1_with (2 replicas). Trimmed
    # for the suite's time: Adam at the other two sizes.
    [(2, 4, 16, "sgd"), (3, 5, 15, "sgd"), (3, 5, 15, "adam"), (2, 1, 16, "sgd")],
)
def test_zero_bubble_h1_trains_as_one_f_one_b(stages, num_micro_batch, batch, optimizer):
    _assert_as_one_f_one_b(stages, stages, num_micro_batch, batch, optimizer=optimizer)


@pytest.mark.parametrize(
    "level",
    [
        pytest.param("v1", marks=pytest.mark.combines("zero_v1+pipeline+data_parallel")),
        pytest.param("v2", marks=pytest.mark.combines("zero_v2+pipeline+data_parallel")),
    ],
)
def test_zero_bubble_h1_with_zero(level):
    # 2 replicas of 2 stages; v1 reduce-scatters each micro-batch's gradients at its W.
    _assert_as_one_f_one_b(2, 4, 4, 16, optimizer="adam", **{"zero.level": level})


@pytest.mark.combines("amp+pipeline")
def test_zero_bubble_h1_with_amp():
    _assert_as_one_f_one_b(2, 2, 4, 16, **{"amp.level": "O1", "amp.dtype": "bfloat16"})


@pytest.mark.combines("gradient_checkpoint+pipeline")
def test_zero_bubble_h1_with_gradient_checkpointing():
    trainer = _assert_as_one_f_one_b(3, 3, 5, 15, **{"gradient_checkpoint.type": "auto"})
    assert trainer.engine.program.recomputed  # the stages did run as recomputed segments


@pytest.mark.combines("jit_compile+pipeline")
def test_zero_bubble_h1_with_xla_stages():
    # A compiled stage's backward is one op: it runs whole at B (nothing to hold back).
    _assert_as_one_f_one_b(2, 2, 4, 16, jit_compile=True)


def _assert_strategies_agree(make_model, stages, x, y, optimizer, strategies=None, **config):
    """A model of its own trains to the same weights under 1F1B and ZB-H1, or each of
    `strategies` ({strategy: its own config keys}), in 3 steps of 16 rows (non-trainable
    state included)."""
    weights = []
    for strategy, own in (strategies or {"PreferBackward": {}, "ZeroBubbleH1": {}}).items():
        model = make_model()
        trainer = epl.EPLTrainer(
            model,
            LOSS,
            optimizer(),
            stages=stages,
            config={"pipeline.strategy": strategy, **config, **own},
        )
        trainer.fit(x, y, batch_size=16, steps_per_epoch=3, verbose=0, shuffle=False)
        weights.append(model.get_weights())
    difference = max(float(np.abs(a - b).max()) for a, b in zip(*weights))
    assert difference < ATOL, difference


def bn_model(seed=3):
    """Dense, BatchNorm, Dense, BatchNorm, Dense."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8,), name="x")
    h = keras.layers.Dense(16, name="block_0")(inputs)
    h = keras.layers.BatchNormalization(name="block_1")(h)
    h = keras.layers.Dense(16, activation="tanh", name="block_2")(h)
    h = keras.layers.BatchNormalization(name="norm")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(h))


def embedding_model():
    """Embedding, pooling, Dense, Dense over 6 token ids below 50."""
    keras.utils.set_random_seed(4)
    inputs = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(50, 8, name="embed")(inputs)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    h = keras.layers.Dense(16, activation="tanh", name="block")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(h))


def embedding_data():
    x = np.random.default_rng(2).integers(0, 50, (48, 6)).astype("int32")
    return x, np.random.default_rng(3).integers(0, 3, 48).astype("int32")


@pytest.mark.combines("sync_batch_norm+pipeline+data_parallel")
def test_zero_bubble_h1_with_synchronized_batch_norm():
    # 2 replicas of 2 stages; stage 0's whole backward (the moments' all-reduce with it)
    # runs at W, in every lane's same place.
    x, y = _data(16)
    _assert_strategies_agree(
        bn_model,
        {"block_0|block_1": 0, "block_2|norm|head": 1},
        x,
        y,
        lambda: keras.optimizers.SGD(0.1),
        **{
            "cluster.virtual_devices": 4,
            "pipeline.num_micro_batch": 2,
            "batch_norm.synchronized": True,
        },
    )


@pytest.mark.parametrize("sparse", [True, False])
def test_zero_bubble_h1_with_an_embedding(sparse):
    # Stage 0's Embedding gradient (IndexedSlices unless sparse_as_dense) is computed at W.
    x, y = embedding_data()
    _assert_strategies_agree(
        embedding_model,
        {"embed|pool": 0, "block|head": 1},
        x,
        y,
        lambda: keras.optimizers.Adam(0.01),
        **{
            "cluster.virtual_devices": 2,
            "pipeline.num_micro_batch": 4,
            "communication.sparse_as_dense": not sparse,
        },
    )


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
def test_zero_bubble_h1_with(setting):
    _assert_as_one_f_one_b(2, 4, 4, 16, optimizer="adam", **setting)


@pytest.mark.combines("tied_weights+pipeline")
def test_zero_bubble_h1_with_tied_weights():
    # The embedding matrix is used on both stages: each stage's W adds its share.
    from test_tied_weights import STAGES, tied_data, tied_model

    x, y = tied_data()
    weights = {}
    for strategy in ("PreferBackward", "ZeroBubbleH1"):
        model = tied_model(reverse_call=False)
        trainer = epl.EPLTrainer(
            model,
            LOSS,
            keras.optimizers.Adam(0.02),
            stages=STAGES,
            config={
                "cluster.virtual_devices": 2,
                "pipeline.num_micro_batch": 4,
                "pipeline.strategy": strategy,
            },
        )
        trainer.fit(x, y, batch_size=16, steps_per_epoch=3, verbose=0, shuffle=False)
        weights[strategy] = model.get_weights()
    difference = max(float(np.abs(a - b).max()) for a, b in zip(*weights.values()))
    assert difference < ATOL, difference


# ----------------------------------------------------------------- the built step
def _graph(trainer, batch):
    x, y = _data(batch)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    trainer.fit(dataset, steps_per_epoch=1, verbose=0)
    return trainer.engine.program.train_on_iterator.get_concrete_function(iter(dataset)).graph


def _of_task(op_name: str, stage: int, task) -> bool:
    scope = f"lane0_stage{stage}_{task}/"
    forward = f"gradient_tape/lane0_stage{stage}_F{task.micro_batch}/"
    return op_name.startswith(scope) or (task.kind != schedule_lib.FORWARD and forward in op_name)


def test_weight_gradients_wait_for_their_place_in_the_schedule():
    trainer, _ = _trainer("ZeroBubbleH1", 2, 2, 4)
    graph = _graph(trainer, 16)
    gates = [op for op in graph.get_operations() if "weight_gradients_after_previous" in op.name]
    # One gate per W of a stage that has weight-only ops (stage 0 has no input gradient,
    # so its whole backward waits for W; stage 1 holds back x^T dy and the bias sums).
    assert len(gates) == 2 * 4
    by_name = {op.name: op for op in graph.get_operations()}
    for stage, tasks in enumerate(trainer.engine.program.schedule):
        for position, (before, task) in enumerate(itertools.pairwise(tasks)):
            if task.kind != schedule_lib.WEIGHT:
                continue
            if stage == 0 and before.kind == schedule_lib.BACKWARD:
                before = tasks[position - 1]  # stage 0's B computes nothing to wait for
            (gate,) = [g for g in gates if g.name.startswith(f"lane0_stage{stage}_{task}/")]
            held = [op for op in by_name.values() if gate in op.control_inputs]
            assert held, (stage, task)
            # The gate waits for the stage's previous task, whatever it is (F, B or W);
            # gradient ops are named after the forward they differentiate. From the
            # third W on, also for the running sums the previous W made (executor.py:
            # else grappler merges the adds into one AddN after the last W).
            earlier_ws = [t for t in tasks[: position + 1] if t.kind == schedule_lib.WEIGHT]
            sums = f"lane0_stage{stage}_{earlier_ws[-1]}/add" if len(earlier_ws) >= 2 else None
            names = [c.name for c in gate.control_inputs]
            waited = [name for name in names if not _of_task(name, stage, before)]
            assert names and all(sums and name.startswith(sums) for name in waited), names
            assert any(name.startswith(sums) for name in names) if sums else not waited, names
            if stage == 1:  # x^T dy and the bias sums read only B's activation gradients
                assert {"MatMul", "BiasAddGrad"} <= {op.type for op in held}


def test_the_backward_is_built_once():
    """The split adds one gate per W and computes nothing twice: the same MatMuls as 1F1B
    (two `tape.gradient` calls per (stage, micro-batch) would add the activation
    gradients' MatMuls again)."""
    counts = {}
    for strategy in ("PreferBackward", "ZeroBubbleH1"):
        trainer, _ = _trainer(strategy, 2, 2, 4)
        graph = _graph(trainer, 16)
        ops = graph.get_operations()
        counts[strategy] = (len(ops), sum(op.type == "MatMul" for op in ops))
    (ops_1f1b, matmuls_1f1b), (ops_zb, matmuls_zb) = counts.values()
    assert matmuls_zb == matmuls_1f1b
    assert ops_1f1b <= ops_zb <= ops_1f1b + 2 * 4  # + one gate per W


def test_task_clock_times_the_executed_schedule():
    from epl_trainer.core.engine.pipeline import TaskClock

    trainer, _ = _trainer("ZeroBubbleH1", 2, 2, 4)
    x, y = _data(16)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    clock = TaskClock()
    trainer.runtime.ensure_for(dataset).program.hooks.task_clock = clock  # before tracing
    trainer.fit(dataset, steps_per_epoch=2, verbose=0)
    times = clock.read()
    schedule = trainer.engine.program.schedule
    assert sorted((s, t) for s, t, _, _ in times) == sorted(
        (s, t) for s, tasks in enumerate(schedule) for t in tasks
    )
    ends = {(s, t): end for s, t, _, end in times}
    slack = 1e-3  # a start and the end it waits for read the clock once the same tensors
    # exist, in either order
    for stage, task, start, end in times:
        assert start <= end
        if task.kind == schedule_lib.BACKWARD and stage == 0:  # waits for stage 1's B
            assert start >= ends[(1, task)] - slack
        if task.kind == schedule_lib.FORWARD and stage == 1:
            assert start >= ends[(0, task)] - slack
    for stage, tasks in enumerate(schedule):
        starts = [next(a for s, t, a, _ in times if (s, t) == (stage, task)) for task in tasks]
        assert starts == sorted(starts)  # each stage ran its tasks in schedule order


# ZB-H1 with stages on two worker processes x 2 devices:
# test_span_workers.py::test_zero_bubble_h1_with_stages_on_two_workers (a run of that
# file's 2-worker job, which starts its processes once for all its runs).


def test_plot_draws_the_weight_gradients():
    pytest.importorskip("matplotlib")
    from epl_trainer.training.plot import _COLORS, _schedule_figure

    zb = schedule_lib.zero_bubble_h1_schedule(4, 8)
    figure = _schedule_figure(zb)
    boxes = [p for p in figure.axes[0].patches if (p.get_gid() or "").startswith("task:")]
    assert len(boxes) == 3 * 4 * 8
    weights = [b for b in boxes if b.get_gid().split(":")[2].startswith("W")]
    assert len(weights) == 4 * 8
    to_hex = pytest.importorskip("matplotlib.colors").to_hex
    assert {to_hex(b.get_facecolor()) for b in weights} == {_COLORS["W"].lower()}
    title = figure.axes[0].get_title()
    # Unit time per task: 3M + S - 1 = 27 steps, idle (S-1)/(3M+S-1) = 11.1%.
    assert title == "ZeroBubbleH1 (ZB-H1): 4 stages x 8 micro-batches, 27 steps, bubble 11.1%"
    (legend,) = figure.legends
    labels = [text.get_text() for text in legend.get_texts()]
    assert labels == ["forward", "backward", "weight gradient"]


class _RecordedSends:
    """Stands in for a lane's cross-worker transfers in one process: every forward of
    stage 0 and backward of stage 1 "sends" (an identity op named after the task), as
    they do when the two stages live on different workers."""

    def __init__(self):
        self._sent = None

    collecting_sends = LaneBoundaries.collecting_sends

    def _record(self, name):
        sent = tf.identity(tf.constant(0.0), name=name)
        if self._sent is not None:  # inside the executor's `collecting_sends`
            self._sent.append(sent)

    def forward_sends(self, stage, values):
        if stage == 0:
            self._record("recorded_send")

    def gradient_sends(self, stage, values, upstream):
        if stage == 1:
            self._record("recorded_send")


@pytest.mark.parametrize("strategy", ["PreferBackward", "ZeroBubbleH1"])
def test_weight_gradients_wait_for_the_stages_sends(strategy):
    """With stages on different workers, a W starts once the sends its stage built since
    its previous W are done. Before, its ops competed with them for the process's core
    and the tensors the other stage waits for left late (ZB-H1, m = 8: about 4% of a
    step, docs/reference/pipelines.md). Forwards and Bs do not wait for sends: they are
    on the critical path, and waiting would idle their core for a round trip."""
    trainer, _ = _trainer(strategy, 2, 2, 4)
    x, y = _data(16)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    program = trainer.runtime.ensure_for(dataset).program
    program.executors[0].boundaries = _RecordedSends()  # before the first trace
    ops = _graph(trainer, 16).get_operations()

    def waiting_on(send: str, task, stage: int) -> list:
        return [
            op
            for op in ops
            if _of_task(op.name, stage, task) and any(c.name == send for c in op.control_inputs)
        ]

    weights_checked = 0
    for stage, tasks in enumerate(program.schedule):
        since_w = []
        for task, following in itertools.pairwise(tasks):
            if (stage, task.kind) in {(0, "F"), (1, "B")}:
                since_w.append(f"lane0_stage{stage}_{task}/recorded_send")
            if following.kind == schedule_lib.WEIGHT:
                gate = f"lane0_stage{stage}_{following}/weight_gradients_after_previous_task"
                (gate,) = [op for op in ops if op.name == gate]
                assert set(since_w) <= {c.name for c in gate.control_inputs}, (stage, task)
                since_w, weights_checked = [], weights_checked + 1
            elif since_w:
                assert not waiting_on(since_w[-1], following, stage), (stage, following)
    assert weights_checked == (8 if strategy == "ZeroBubbleH1" else 0)
