"""Synchronized BatchNorm (core/engine/sync_batch_norm.py): with `batch_norm.synchronized`
or `BatchNormalization(synchronized=True)`, a step on several replicas normalises over
the global batch, so it equals one plain Keras step on one device on the whole batch
(weights and moving statistics, 1e-5), with SGD and Adam; with several micro-batches,
micro-batch j of every replica is normalised together. Without it each replica
normalises over its own rows, and training differs from one-device Keras.
"""

import functools
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from _launch import SCRIPTS, run_launch
from _models import max_weight_difference

import epl_trainer as epl

sys.path.insert(0, SCRIPTS)
import train_sync_bn

ATOL = 1e-5
BATCH = train_sync_bn.BATCH
SPARSE_CE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


_bn_model = train_sync_bn.make_model
_data = train_sync_bn.make_data


def _keras_fit(model, x, y, optimizer, batch=BATCH):
    model.compile(optimizer=optimizer, loss=SPARSE_CE)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)


@functools.cache  # the same weights for every test that asks for them (read only)
def _keras_weights(optimizer="sgd"):
    """_bn_model() after one-device Keras `fit` on _data() with OPTIMIZERS[optimizer]
    (SGD: train_sync_bn.py's rate, 0.1): its weights, moving statistics included."""
    reference = _bn_model()
    x, y = _data()
    _keras_fit(reference, x, y, OPTIMIZERS[optimizer]())
    return tuple(reference.get_weights())


def _keras_reference(optimizer="sgd"):
    """A fresh _bn_model() holding `_keras_weights(optimizer)`."""
    reference = _bn_model()
    reference.set_weights(_keras_weights(optimizer))
    return reference


def _epl_fit(model, x, y, optimizer, config, stages=None, batch=BATCH, **kwargs):
    trainer = epl.EPLTrainer(model, SPARSE_CE, optimizer, stages=stages, config=config, **kwargs)
    trainer.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
    return trainer


def _moving_difference(a, b) -> float:
    values = [
        (u, v)
        for la, lb in zip(a.layers, b.layers)
        if isinstance(la, keras.layers.BatchNormalization)
        for u, v in ((la.moving_mean, lb.moving_mean), (la.moving_variance, lb.moving_variance))
    ]
    return max(float(np.abs(np.asarray(u) - np.asarray(v)).max()) for u, v in values)


OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(train_sync_bn.LEARNING_RATE),
    "adam": lambda: keras.optimizers.Adam(0.01),
}
SYNC = {"cluster.virtual_devices": 2, "batch_norm.synchronized": True}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.combines("sync_batch_norm+data_parallel")
def test_two_replicas_equal_keras_on_one_device(optimizer):
    """Synchronized: equal to one-device Keras. The default normalises over each
    replica's rows, and differs (so the option is what changes the step)."""
    x, y = _data()
    reference, model, unsynchronized = _keras_reference(optimizer), _bn_model(), _bn_model()
    _epl_fit(model, x, y, OPTIMIZERS[optimizer](), SYNC)
    assert max_weight_difference(reference, model) < ATOL
    assert _moving_difference(reference, model) < ATOL
    local = {"cluster.virtual_devices": 2}
    _epl_fit(unsynchronized, x, y, OPTIMIZERS[optimizer](), local)
    assert max_weight_difference(reference, unsynchronized) > 1e-3
    assert _moving_difference(reference, unsynchronized) > 1e-2


class _CheckedFinite(keras.layers.Layer):
    """Returns its input through tf.debugging.check_numerics: a stateful op that touches
    no resource, which the next layer's input waits on."""

    def call(self, x):
        return tf.debugging.check_numerics(x, "not finite")


def _checked_bn_model():
    keras.utils.set_random_seed(7)
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.Flatten()(_CheckedFinite()(inputs))
    h = keras.layers.Dense(8, use_bias=False)(h)
    h = keras.layers.BatchNormalization(momentum=0.8, synchronized=True)(h)
    h = _CheckedFinite()(keras.layers.Activation("tanh")(h))
    return keras.Model(inputs, keras.layers.Dense(3)(h))


def test_checks_around_a_synchronized_batch_norm_do_not_deadlock():
    """A check of the input before the synchronized BatchNorm and another after it: TF ran
    them in one program order over the replicas, so replica 1's input check waited for
    replica 0's second check, which waited for the statistics' all-reduce with replica
    1: the first step hung (core/engine/lane_order.py)."""
    x, y = _data()
    reference = _checked_bn_model()
    _keras_fit(reference, x, y, OPTIMIZERS["sgd"]())
    model = _checked_bn_model()
    config = {**SYNC, "communication.timeout_seconds": 60}
    _epl_fit(model, x, y, OPTIMIZERS["sgd"](), config)
    assert max_weight_difference(reference, model) < ATOL


def test_layer_argument_synchronizes_that_layer():
    """Keras's own `synchronized=True` is honoured without the config key."""
    x, y = _data()
    reference, model = _bn_model(synchronized=True), _bn_model(synchronized=True)
    _keras_fit(reference, x, y, keras.optimizers.SGD(0.1))
    _epl_fit(model, x, y, keras.optimizers.SGD(0.1), {"cluster.virtual_devices": 2})
    assert max_weight_difference(reference, model) < ATOL
    assert _moving_difference(reference, model) < ATOL


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(  # lanes emitted in lockstep
            {"zero.level": "v1"},
            marks=pytest.mark.combines("sync_batch_norm+zero_v1+data_parallel"),
        ),
        pytest.param(
            {"zero.level": "v2"},
            marks=pytest.mark.combines("sync_batch_norm+zero_v2+data_parallel"),
        ),
        pytest.param(  # the recomputed forward reuses the statistics
            {"gradient_checkpoint.type": "auto"},
            marks=pytest.mark.combines("sync_batch_norm+gradient_checkpoint+data_parallel"),
        ),
        pytest.param(
            {"offload.level": "v0"},
            marks=pytest.mark.combines("sync_batch_norm+offload+data_parallel"),
        ),
    ],
    ids=lambda layout: "-".join(f"{v}" for v in layout.values()),
)
def test_memory_features_keep_keras_semantics(layout):
    x, y = _data()
    reference, model = _keras_reference(), _bn_model()
    _epl_fit(model, x, y, keras.optimizers.SGD(0.1), {**SYNC, **layout})
    assert max_weight_difference(reference, model) < ATOL
    assert _moving_difference(reference, model) < ATOL


def test_rows_filling_an_odd_batch_do_not_count():
    """Batch 7 on 2 replicas is filled up to 8 with a copy of a real row (weight 0): the
    copy enters neither the statistics nor the loss, and an epoch's short last batch (5
    rows) trains as Keras's does."""
    x, y = _data(n=19)
    reference, model = _bn_model(), _bn_model()
    _keras_fit(reference, x, y, keras.optimizers.SGD(0.1), batch=7)
    _epl_fit(model, x, y, keras.optimizers.SGD(0.1), SYNC, batch=7)
    assert max_weight_difference(reference, model) < ATOL
    assert _moving_difference(reference, model) < ATOL


@pytest.mark.combines("sync_batch_norm+steps_per_execution+data_parallel")
def test_steps_per_execution():
    x, y = _data()
    reference, model = _keras_reference(), _bn_model()
    _epl_fit(model, x, y, keras.optimizers.SGD(0.1), SYNC, steps_per_execution=3)
    assert max_weight_difference(reference, model) < ATOL
    assert _moving_difference(reference, model) < ATOL


def _keras_micro_batch_steps(model, x, y, optimizer, lanes, micro):
    """One-device Keras reference of `lanes` replicas x `micro` micro-batches: per step,
    micro-batch j is row block j of every replica's rows, normalised together; the loss
    is the global batch's mean, the moving statistics move once per micro-batch."""
    optimizer.build(model.trainable_variables)
    for start in range(0, len(x), BATCH):
        xb, yb = x[start : start + BATCH], y[start : start + BATCH]
        per = BATCH // (lanes * micro)
        grads = None
        for j in range(micro):
            rows = np.concatenate(
                [np.arange(per) + (lane * micro + j) * per for lane in range(lanes)]
            )
            with tf.GradientTape() as tape:
                logits = model(xb[rows], training=True)
                loss = SPARSE_CE(yb[rows], logits) * (len(rows) / BATCH)
            g = tape.gradient(loss, model.trainable_variables)
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        optimizer.apply(grads, model.trainable_variables)


def test_micro_batches_normalise_each_micro_batch_across_replicas():
    x, y = _data()
    reference, model = _bn_model(), _bn_model()
    _keras_micro_batch_steps(reference, x, y, keras.optimizers.SGD(0.1), lanes=2, micro=2)
    _epl_fit(model, x, y, keras.optimizers.SGD(0.1), {**SYNC, "pipeline.num_micro_batch": 2})
    assert max_weight_difference(reference, model) < ATOL
    assert _moving_difference(reference, model) < ATOL


@pytest.mark.combines("sync_batch_norm+pipeline+data_parallel")
def test_pipeline_normalises_over_the_replicas_of_each_stage():
    """BatchNorms in both stages of 2 pipelines (4 devices), 2 micro-batches: each
    stage's layer normalises micro-batch j over its stage's 2 replicas."""
    x, y = _data()
    reference, model = _bn_model(), _bn_model()
    _keras_micro_batch_steps(reference, x, y, keras.optimizers.SGD(0.1), lanes=2, micro=2)
    config = {**SYNC, "cluster.virtual_devices": 4, "pipeline.num_micro_batch": 2}
    _epl_fit(model, x, y, keras.optimizers.SGD(0.1), config, stages=train_sync_bn.STAGES)
    assert max_weight_difference(reference, model) < ATOL
    assert _moving_difference(reference, model) < ATOL


MULTI_WORKER_LAYOUTS = ("data_parallel", "pipelines", "straddle")


@pytest.fixture(scope="module")
def multi_worker_job(tmp_path_factory):
    """One job of 2 worker processes x 2 devices (epl-launch) that trains each layout of
    tests/scripts/train_sync_bn.py in turn, a trainer each (one job, not one per layout:
    the three took 25.5 s, most of it starting processes). Returns its output folder."""
    tmp_path = tmp_path_factory.mktemp("sync_bn_workers")
    script = os.path.join(SCRIPTS, "train_sync_bn.py")
    layouts = ["--layout", *MULTI_WORKER_LAYOUTS]
    result = run_launch(script, tmp_path, 2, 2, *layouts, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    for layout in MULTI_WORKER_LAYOUTS:
        assert f"worker 0/2 {layout} devices=2" in result.stdout, result.stdout
    return tmp_path / "out"


@pytest.mark.slow
@pytest.mark.timeout(360)
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(
            "data_parallel",
            marks=pytest.mark.combines("sync_batch_norm+multi_worker+data_parallel"),
        ),
        pytest.param(
            "pipelines", marks=pytest.mark.combines("sync_batch_norm+pipeline+multi_worker")
        ),
        pytest.param(
            "straddle",
            marks=pytest.mark.combines(
                "sync_batch_norm+pipeline+stages_across_workers+data_parallel"
            ),
        ),
    ],
)
def test_two_workers_of_two_devices_equal_keras_on_one_device(multi_worker_job, layout):
    """2 worker processes x 2 devices (epl-launch; layouts in tests/scripts/train_sync_bn.py).
    data_parallel: 4 replicas, statistics summed over the lanes of both workers.
    pipelines: a 2-stage replica per worker, each stage's statistics summed over the
    workers. straddle: 2 replicas that each span both workers, a worker computing one
    stage of each (it builds no collective of the stage it does not hold); before the
    lanes were emitted in lockstep this one hung."""
    expected = _keras_weights()  # moving statistics included
    for w in range(2):
        saved = np.load(multi_worker_job / f"{layout}_{w}.npz")
        for i, value in enumerate(expected):
            np.testing.assert_allclose(saved[f"arr_{i}"], value, atol=ATOL)


@pytest.mark.combines("sync_batch_norm+amp+data_parallel")
def test_mixed_precision_keeps_float32_statistics():
    """AMP (float16 layers, a fixed loss scale): BatchNorm computes its statistics in
    float32 and they are summed over the replicas in float32; measured 6.6e-4 from
    float32 Keras on one device, 0.47 without synchronization."""
    x, y = _data()
    reference = _keras_reference()
    amp = {"amp.level": "O1", "amp.dtype": "float16", "amp.loss_scale": 128}
    differences = {}
    for synchronized in (True, False):
        model = _bn_model()
        config = {**SYNC, **amp, "batch_norm.synchronized": synchronized}
        _epl_fit(model, x, y, keras.optimizers.SGD(0.1), config)
        differences[synchronized] = max_weight_difference(reference, model)
        moving = [w for w in model.weights if "moving" in w.path]
        assert {w.dtype for w in moving} == {"float32"}
    assert differences[True] < 2e-3
    assert differences[False] > 0.1


def _masked_model(seed=3):
    """Padded token sequences: Keras's mask (Embedding(mask_zero=True)) reaches the
    BatchNorm, whose statistics count only the unmasked positions."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((7,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(20, 4, mask_zero=True, name="embed")(tokens)
    h = keras.layers.BatchNormalization(momentum=0.8, name="bn")(h)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(tokens, keras.layers.Dense(3, name="logits")(h))


def test_keras_mask_reaches_the_statistics():
    rng = np.random.default_rng(2)
    n = BATCH * 3
    tokens = rng.integers(1, 20, size=(n, 7)).astype("int32")
    lengths = np.where(np.arange(n) % BATCH < BATCH // 2, 2, 7)  # one replica's rows short
    tokens[np.arange(7)[None, :] >= lengths[:, None]] = 0
    y = rng.integers(0, 3, n).astype("int32")
    reference, model = _masked_model(), _masked_model()
    _keras_fit(reference, tokens, y, keras.optimizers.SGD(0.1))
    _epl_fit(model, tokens, y, keras.optimizers.SGD(0.1), SYNC)
    assert max_weight_difference(reference, model) < ATOL
    assert _moving_difference(reference, model) < ATOL


def test_split_layers_are_refused():
    model = _bn_model()
    config = {**SYNC, "cluster.colocate_split_and_replicate": True}
    with pytest.raises(ValueError, match=r"Synchronized BatchNorm cannot be combined with split"):
        epl.EPLTrainer(
            model, SPARSE_CE, keras.optimizers.SGD(0.1), config=config,
            strategy=epl.Strategy(default=epl.replicate(2), split=["logits"]),
        )  # fmt: skip


def test_jit_compile_is_refused():
    model = _bn_model()
    with pytest.raises(ValueError, match=r"Synchronized BatchNorm .* jit_compile=True"):
        epl.EPLTrainer(model, SPARSE_CE, keras.optimizers.SGD(0.1), config=SYNC, jit_compile=True)
