"""ZeRO through the trainer: parity with single-device Keras in every combination a user
can switch on, and the memory each device holds (zero_layout / zero_exchange have their
unit tests in test_zero_layout.py)."""

import functools
import re

import keras
import numpy as np
import pytest
from _models import (
    adam_trainer,
    keras_reference,
    max_weight_difference,
    parity_data,
    parity_model,
)

from epl_trainer.core.engine.state import variable_bytes
from epl_trainer.core.engine.zero.params import is_gathered

ATOL = 1e-5
PARITY_STAGES = {"conv|embed|pool_.*|concat": 0, "hidden|norm|logits": 1}


@functools.cache  # the same weights for every test that asks for them (read only)
def _keras_weights():
    """parity_model() after plain single-device Keras `fit` (Adam 0.01, 3 steps of 16)."""
    x, y = parity_data()
    reference = parity_model()
    keras_reference(reference, x, y, keras.optimizers.Adam(0.01), batch_size=16, steps=3)
    return tuple(reference.get_weights())


def _difference_from_keras(model) -> float:
    return max(float(np.abs(a - b).max()) for a, b in zip(_keras_weights(), model.get_weights()))


# What each case runs together (the README's features x modes table): 4 replicas, or 2
# replicas of 2 stages; offload where it is on.
COMBINES = {
    ("v0", "data_parallel"): pytest.mark.combines("zero_v0+data_parallel"),
    ("v1", "data_parallel"): pytest.mark.combines("zero_v1+data_parallel"),
    ("v2", "data_parallel"): pytest.mark.combines("zero_v2+data_parallel"),
    ("v0", "2_stages"): pytest.mark.combines("zero_v0+pipeline+data_parallel"),
    ("v1", "2_stages"): pytest.mark.combines("zero_v1+pipeline+data_parallel"),
    ("v2", "2_stages"): pytest.mark.combines("zero_v2+pipeline+data_parallel"),
    ("offload", "data_parallel"): pytest.mark.combines("offload+data_parallel"),
    ("offload", "2_stages"): pytest.mark.combines("offload+pipeline+data_parallel"),
}

# level x {data parallel, 2 stages} with 2 micro-batches, with and without offload; and
# data parallel with one micro-batch (no accumulation). Trimmed for the suite's time, as
# they repeated the same paths: offload with one micro-batch; a pipeline of one micro-batch;
# offload over 2 stages for v0 and v1 (v2's, where the host holds the only copy of the
# parameters, stays).
PARITY_CASES = [
    pytest.param(
        level,
        micro,
        stages,
        offload,
        id=f"{level}-{micro}-{where}-{name}",
        marks=[COMBINES[level, where], *([COMBINES["offload", where]] if offload else [])],
    )
    for level in ("v0", "v1", "v2")
    for micro in (1, 2)
    for where, stages in (("data_parallel", None), ("2_stages", PARITY_STAGES))
    for name, offload in (("offload_off", ""), ("offload_on", "v0"))
    if (micro == 2 or (not offload and stages is None))
    and not (offload and stages and level != "v2")
]


@pytest.mark.parametrize("level, num_micro_batch, stages, offload", PARITY_CASES)
def test_zero_matches_keras(level, num_micro_batch, stages, offload):
    """Adam on a model with Conv, LayerNorm and an Embedding (its IndexedSlices gradient
    stays sparse and is cut into row pieces with the rest) on 4 devices: 4 replicas, or 2
    replicas of a 2-stage pipeline; ZeRO-Offload keeps the shards on the host. v2 holds
    the parameters only as pieces: no lane has a variable of its own."""
    x, y = parity_data()
    model = parity_model()
    trainer = adam_trainer(
        model,
        4,
        stages=stages,
        **{
            "zero.level": level,
            "pipeline.num_micro_batch": num_micro_batch,
            "offload.level": offload,
        },
    )
    trainer.fit(x, y, batch_size=16, steps_per_epoch=3, verbose=0, shuffle=False)
    assert _difference_from_keras(model) < ATOL
    update = trainer.engine.program.update
    cut = {i for _, i, start, _ in update.piece_spans().values() if start is not None}
    assert cut, "the layout cut no variable: the test would not cover row pieces"
    if offload:  # the shards' state lives on the host, not on the compute devices
        host = trainer.cluster.host_device
        devices = {v.value.device for v in update.all_optimizer_variables()}
        assert devices == {host}
    held = [v for lane in trainer.engine.state.trainable for v in lane if v is not None]
    assert all(is_gathered(v) for v in held) == (level == "v2")


@pytest.mark.parametrize(
    "config",
    [
        {"optimizer.num_apply_group": 3},
        {"communication.fp16": True, "communication.max_splits": 3},
        {"communication.clip_after_allreduce": False},
        pytest.param(
            {"gradient_checkpoint.type": "auto"},
            marks=pytest.mark.combines("gradient_checkpoint+data_parallel"),
        ),
    ],
    ids=["grouped_apply", "fp16_wire_buckets", "clip_before_reduction", "recompute"],
)
@pytest.mark.parametrize(
    "level",
    [
        pytest.param("v1", marks=pytest.mark.combines("zero_v1+data_parallel")),
        pytest.param("v2", marks=pytest.mark.combines("zero_v2+data_parallel")),
    ],
)
def test_zero_combines_with(level, config):
    """Grouped apply (groups of pieces, chained), gradients on the float16 wire in several
    buckets, global-norm clipping before the reduction (EPL's default: gradients then
    accumulate per lane before they are reduce-scattered), gradient checkpointing (v2:
    each segment gathers its parameters, and again in its backward)."""
    x, y = parity_data()
    clip = 0.05 if "communication.clip_after_allreduce" in config else None
    optimizer = lambda: keras.optimizers.Adam(0.01, global_clipnorm=clip)  # noqa: E731
    model = parity_model()
    trainer = adam_trainer(
        model, 2, optimizer(), **{"zero.level": level, "pipeline.num_micro_batch": 2, **config}
    )
    trainer.fit(x, y, batch_size=16, steps_per_epoch=3, verbose=0, shuffle=False)
    # The float16 wire rounds each gradient to 11 bits: 1e-5 is out of reach there.
    tolerance = 2e-3 if config.get("communication.fp16") else ATOL
    if clip:  # per-replica clipping: the reference is plain data parallelism
        assert trainer.engine.program.hooks.gradient_sink is None
        assert max_weight_difference(_clipped_data_parallel(), model) < tolerance
    else:
        assert _difference_from_keras(model) < tolerance
    if "optimizer.num_apply_group" in config:
        assert all(len(stage) == 3 for stage in trainer.engine.program.update.steps[0])
    gathers = trainer.engine.program.hooks.gather_per_segment
    assert bool(gathers) == (level == "v2" and "gradient_checkpoint.type" in config)


@functools.cache  # the same model for the v1 and v2 cells (read only)
def _clipped_data_parallel():
    """parity_model() after plain 2-device data parallelism, 2 micro-batches, Adam 0.01
    clipped before the reduction (global_clipnorm 0.05 per replica), 3 steps of 16."""
    x, y = parity_data()
    reference = parity_model()
    optimizer = keras.optimizers.Adam(0.01, global_clipnorm=0.05)
    trainer = adam_trainer(reference, 2, optimizer, **{"pipeline.num_micro_batch": 2})
    trainer.fit(x, y, batch_size=16, steps_per_epoch=3, verbose=0, shuffle=False)
    return reference


def embedding_heavy_model(seed: int = 0) -> keras.Model:
    """Half of the parameters are one Embedding (as a BERT vocabulary is a large share)."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(1000, 32, name="embed")(tokens)  # 32,000
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(160, activation="relu", name="hidden")(h)  # 30,880
    h = keras.layers.Dense(6, name="mid")(h)  # 966
    return keras.Model(tokens, keras.layers.Dense(3, name="logits")(h))


@pytest.mark.parametrize("level", ["v0", "v1", "v2"])
def test_memory_report_divides_optimizer_state_and_gradients_exactly(level):
    model = embedding_heavy_model()
    rng = np.random.default_rng(0)
    x = rng.integers(0, 1000, size=(64, 6)).astype("int32")
    y = rng.integers(0, 3, size=(64,)).astype("int32")
    trainer = adam_trainer(model, 4, **{"zero.level": level})
    trainer.fit(x, y, batch_size=16, steps_per_epoch=1, verbose=0, shuffle=False)
    report = trainer.memory_report(print_table=False)
    sizes = [variable_bytes(v) for v in model.trainable_variables]
    total = sum(sizes)
    assert max(sizes) > 0.45 * total  # the embedding is about half the model
    rows = [report[lane.devices[0]] for lane in trainer.lanes]
    # Adam's two slots plus the master copy of the owned rows: 3 x total / 4 each, within
    # 1% (the step counters are a few bytes). Under v2 the owned rows are the parameters.
    optimizer_share = 2 if level == "v2" else 3
    for row in rows:
        assert abs(row.optimizer - optimizer_share * total / 4) <= 0.01 * total, [
            r.optimizer for r in rows
        ]
        if level == "v2":  # a quarter of the parameters each, between steps
            assert abs(row.parameters - total / 4) <= 0.01 * total / 4, [r.parameters for r in rows]
        else:
            assert row.parameters >= total  # each replica's working copy of the model
        # v1, v2: each device keeps the reduced gradients of its quarter; v0: all of them.
        expected = total if level == "v0" else total / 4
        assert abs(row.gradients - expected) <= 0.01 * expected


def test_lockstep_hands_every_lane_the_reduce_scatter_of_its_micro_batch():
    """ZeRO v1's lanes are emitted task by task; after each backward the sink is flushed
    once (one reduce-scatter over the lanes) and every lane's next task gets its own
    markers to wait for. (Flushing once per lane left lanes 1.. with nothing to wait for.)"""
    import contextlib
    import types

    from epl_trainer.core.engine.program import Program
    from epl_trainer.core.plan.schedule import BACKWARD, FORWARD, Task

    tasks = [Task(FORWARD, 0), Task(BACKWARD, 0), Task(FORWARD, 1), Task(BACKWARD, 1)]
    received = {0: [], 1: []}

    def lane(li):
        for task in tasks:
            sent = yield 0, task
            received[li].append(sent)
        return f"lane {li} done"

    class Sink:
        flushes = 0

        def clear(self):
            pass

        def flush(self, stage):
            Sink.flushes += 1
            return {0: [f"rs{Sink.flushes} lane 0"], 1: [f"rs{Sink.flushes} lane 1"]}

    program = types.SimpleNamespace(
        hooks=types.SimpleNamespace(
            gradient_sink=Sink(),
            lanes=types.SimpleNamespace(lane=lambda li: contextlib.nullcontext()),
        ),
        _lane_runs=lambda runs: runs,  # the lanes' task generators, given directly
    )
    results = Program._emit_lanes_in_lockstep(program, [lane(0), lane(1)])
    assert results == ["lane 0 done", "lane 1 done"]
    assert Sink.flushes == 2  # one per backward round
    for li in (0, 1):  # the task after each backward waits for that round's markers
        assert received[li] == [None, [f"rs1 lane {li}"], None, [f"rs2 lane {li}"]]


def test_v2_across_workers_refuses_gradient_checkpointing_on_those_stages_by_name():
    from epl_trainer.core.plan.rules import check_zero_v2_recompute

    check_zero_v2_recompute([0], [1])  # the recomputed stage's group is on one worker
    match = r"zero.stage 3\) with gradient checkpointing .* zero.level 'v1'.* stage\(s\) \[1\]"
    with pytest.raises(ValueError, match=match):
        check_zero_v2_recompute([0, 1], [1, 2])


def test_gathered_parameter_joins_and_splits_its_pieces():
    import tensorflow as tf

    from epl_trainer.core.engine.zero.layout import Piece
    from epl_trainer.core.engine.zero.params import GatheredParameter

    original = keras.Variable(np.arange(12, dtype="float32").reshape(3, 4), name="w")
    pieces = [
        (Piece(0, 0, 5, 12, (7,), False), keras.Variable(np.zeros(7, "float32"))),
        (Piece(0, 0, 0, 5, (5,), False), keras.Variable(np.zeros(5, "float32"))),
    ]
    view = GatheredParameter(original, pieces)
    view.assign(original.value)
    np.testing.assert_array_equal(pieces[1][1].numpy(), np.arange(5))
    np.testing.assert_array_equal(view.value.numpy(), original.numpy())
    delayed = view.gather(after=tf.constant(0.0))
    np.testing.assert_array_equal(delayed.numpy(), original.numpy())
    with pytest.raises(ValueError, match=r"cover 5 of its 12 elements"):
        GatheredParameter(original, pieces[1:])


def test_v2_per_segment_gathers_are_not_kept_for_backward(monkeypatch):
    """With gradient checkpointing, each segment's gathered parameters feed only its
    forward (so they are freed after it); its backward gathers them again. Checked on
    the traced step: no op under a backward name scope consumes a forward gather, and
    every forward gather has a gather in a backward scope. (Measured, bench/memory.py
    --only zero: 47.1 MiB per device gathering once per step, 41.4 per segment.)"""
    from epl_trainer.core.engine.zero import params as zero_params

    made = {"gather": [], "regather": []}
    for name in made:
        original = getattr(zero_params.SegmentGathers, name)

        def recording(self, *args, _original=original, _name=name):
            values = _original(self, *args)
            made[_name].extend(values)
            return values

        monkeypatch.setattr(zero_params.SegmentGathers, name, recording)
    x, y = parity_data()
    trainer = adam_trainer(
        parity_model(), 2, **{"zero.level": "v2", "gradient_checkpoint.type": "auto"}
    )
    trainer.fit(x, y, batch_size=16, steps_per_epoch=1, verbose=0, shuffle=False)
    graph = made["gather"][-1].graph  # the last traced step
    forward = [t for t in made["gather"] if t.graph is graph]
    again = [t for t in made["regather"] if t.graph is graph]
    backward = re.compile(r"_stage\d+_B\d+/")  # the executor's backward name scopes
    consumers = [op.name for t in forward for op in t.consumers()]
    assert consumers and not [name for name in consumers if backward.search(name)]
    assert len(again) == len(forward) and all(backward.search(t.name) for t in again)


def test_v2_evaluates_and_predicts_from_the_gathered_parameters():
    """Evaluation and prediction read the pieces through the same gather as training;
    `set_weights` on the Keras model reaches the pieces (`load_from_model`)."""
    x, y = parity_data()
    model = parity_model()
    trainer = adam_trainer(model, 4, stages=PARITY_STAGES, **{"zero.level": "v2"})
    trainer.fit(x, y, batch_size=16, steps_per_epoch=2, verbose=0, shuffle=False)
    reference = parity_model()
    reference.set_weights(model.get_weights())  # the trained weights, written back
    np.testing.assert_allclose(trainer.predict(x, batch_size=16), reference.predict(x, verbose=0),
                               atol=1e-5)  # fmt: skip
    model.set_weights(parity_model(seed=3).get_weights())
    trainer.engine.load_from_model()
    reference.set_weights(model.get_weights())
    np.testing.assert_allclose(trainer.predict(x, batch_size=16), reference.predict(x, verbose=0),
                               atol=1e-5)  # fmt: skip
    reference.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    expected = reference.evaluate(x, y, batch_size=16, verbose=0)
    assert abs(trainer.evaluate(x, y, batch_size=16, return_dict=True)["loss"] - expected) < 1e-5
