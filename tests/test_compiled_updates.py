"""XLA-compiled optimizer updates (`optimizer.jit_compile`, core/engine/update/apply.py).

An `OptimizerStep` must give exactly the update of Keras's own `optimizer.apply` (1e-6
relative) for every optimizer family the engine runs, with per-variable clipping, weight
decay exclusions and the IndexedSlices gradients of an Embedding; an optimizer that XLA
cannot compile falls back to plain ops with a warning; and the trainer with compiled
updates ends where the trainer with plain ones does.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

import epl_trainer as epl
from epl_trainer.core.engine.update import apply
from epl_trainer.core.engine.update.apply import AUTO_MIN_ELEMENTS, OptimizerStep

DEVICE = "/job:localhost/replica:0/task:0/device:CPU:1"
RTOL = 1e-6


def adamw_with_exclusions(variables):
    optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.1)
    optimizer.exclude_from_weight_decay(var_list=[variables[1]])  # the bias
    return optimizer


OPTIMIZERS = {
    "adam": lambda variables: keras.optimizers.Adam(0.01),
    "adamw_exclusions": adamw_with_exclusions,
    "lion": lambda variables: keras.optimizers.Lion(0.001),
    "lamb": lambda variables: keras.optimizers.Lamb(0.01),
    "adagrad": lambda variables: keras.optimizers.Adagrad(0.1),
    "sgd_momentum": lambda variables: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adam_clipnorm": lambda variables: keras.optimizers.Adam(0.01, clipnorm=0.05),
    "sgd_clipvalue": lambda variables: keras.optimizers.SGD(0.1, clipvalue=0.01),
}
SHAPES = [(6, 4), (4,), (10, 3)]  # kernel, bias, embedding table (sparse gradients)


def variables_on(device, seed=0):
    rng = np.random.default_rng(seed)
    with tf.device(device):
        return [
            keras.Variable(rng.normal(size=s).astype("float32"), name=n)
            for s, n in zip(SHAPES, ["kernel", "bias", "embeddings"])
        ]


def gradients(step):
    rng = np.random.default_rng(100 + step)
    dense = [tf.constant(rng.normal(size=s).astype("float32")) for s in SHAPES[:2]]
    rows = tf.constant([1, 7, 1, 3])  # a repeated row: Keras sums it in the update
    sparse = tf.IndexedSlices(
        tf.constant(rng.normal(size=(4, 3)).astype("float32")), rows, tf.constant([10, 3])
    )
    return [*dense, sparse]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_compiled_update_equals_keras_apply(name):
    reference, compiled = variables_on(DEVICE), variables_on(DEVICE)
    with tf.device(DEVICE):
        keras_optimizer = OPTIMIZERS[name](reference)
        keras_optimizer.build(reference)
        ours = OPTIMIZERS[name](compiled)
        ours.build(compiled)
    step = OptimizerStep(ours, compiled, DEVICE, jit_compile=True)
    assert step.jit_compile  # every Keras optimizer here compiles

    @tf.function
    def plain_apply(grads):
        with tf.device(DEVICE):
            keras_optimizer.apply(grads, reference)

    traced_step = tf.function(step)
    for i in range(3):
        plain_apply(gradients(i))
        traced_step(gradients(i))
    for a, b, initial in zip(reference, compiled, variables_on(DEVICE)):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=RTOL, atol=1e-7)
        assert not np.allclose(a.numpy(), initial.numpy())  # the updates did something
    assert int(ours.iterations.numpy()) == 3


def test_shared_learning_rate_on_another_device_is_mirrored_before_each_update():
    """The replicas share the user's learning-rate variable (LR callbacks reach all of
    them); a compiled update cannot read it across devices, so it reads a copy."""
    with tf.device("/job:localhost/replica:0/task:0/device:CPU:0"):
        master = keras.optimizers.SGD(0.5)
    variables = variables_on(DEVICE)[:2]
    with tf.device(DEVICE):
        replica = keras.optimizers.SGD(0.5)
        replica._learning_rate = master._learning_rate
        replica.build(variables)
    step = tf.function(OptimizerStep(replica, variables, DEVICE, jit_compile=True))
    before = variables[1].numpy().copy()
    master.learning_rate.assign(0.25)  # what a LearningRateScheduler callback does
    step([tf.zeros(SHAPES[0]), tf.ones(SHAPES[1])])
    np.testing.assert_allclose(variables[1].numpy(), before - 0.25, rtol=RTOL)


class NumpyClipSGD(keras.optimizers.SGD):
    """An optimizer with an op XLA does not have (tf.numpy_function)."""

    def update_step(self, gradient, variable, learning_rate):
        clipped = tf.numpy_function(lambda g: np.clip(g, -1, 1), [gradient], gradient.dtype)
        clipped = tf.reshape(clipped, gradient.shape)
        super().update_step(clipped, variable, learning_rate)


def test_an_optimizer_xla_cannot_compile_runs_as_plain_ops_with_a_warning(caplog):
    variables = variables_on(DEVICE)[:2]
    with tf.device(DEVICE):
        optimizer = NumpyClipSGD(0.1)
        optimizer.build(variables)
    with caplog.at_level(logging.WARNING):
        step = OptimizerStep(optimizer, variables, DEVICE, jit_compile=True)
    assert not step.jit_compile
    assert "NumpyClipSGD does not compile with XLA" in caplog.text
    before = variables[1].numpy().copy()
    tf.function(step)([tf.zeros(SHAPES[0]), tf.fill(SHAPES[1], 5.0)])
    np.testing.assert_allclose(variables[1].numpy(), before - 0.1, rtol=RTOL)  # clipped to 1


def test_auto_compiles_only_updates_of_a_million_parameters_or_more():
    """XLA's compile (0.2-2.5 s here) is repaid only by large arrays (bench/optim.py
    --sweep): "auto" leaves a small model's update as plain ops."""
    small = variables_on(DEVICE)
    with tf.device(DEVICE):
        large = [keras.Variable(tf.zeros([AUTO_MIN_ELEMENTS // 2])) for _ in range(2)]
    for variables, compiled in ((small, False), (large, True), (large[:1], False)):
        with tf.device(DEVICE):
            optimizer = keras.optimizers.Adam(0.01)
            optimizer.build(variables)
        assert OptimizerStep(optimizer, variables, DEVICE, "auto").jit_compile == compiled


def test_an_update_is_lowered_once_per_optimizer_config_and_shapes(monkeypatch):
    """Every lane, and every later trainer of the same optimizer on the same model, has the
    same update: it is lowered to HLO once per process. The name and the learning rate's
    value do not count; another config or other shapes are lowered again."""
    monkeypatch.setattr(apply, "_LOWERING_FAILURES", {})
    lowered = []
    real_lower = OptimizerStep._lower
    monkeypatch.setattr(
        OptimizerStep, "_lower", lambda step: lowered.append(step) or real_lower(step)
    )

    def step(variables, **adam):
        with tf.device(DEVICE):  # its iteration counter too
            optimizer = keras.optimizers.Adam(**adam)
            optimizer.build(variables)
        return OptimizerStep(optimizer, variables, DEVICE, jit_compile=True)

    assert step(variables_on(DEVICE), learning_rate=0.01, name="a").jit_compile
    assert step(variables_on(DEVICE), learning_rate=0.5, name="b").jit_compile
    assert len(lowered) == 1
    step(variables_on(DEVICE), amsgrad=True)
    step(variables_on(DEVICE)[:2])
    assert len(lowered) == 3


def embedding_model():
    keras.utils.set_random_seed(3)
    tokens = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(20, 8, name="embed")(tokens)
    h = keras.layers.GlobalAveragePooling1D()(h)
    h = keras.layers.Dense(8, activation="relu", name="hidden")(h)
    return keras.Model(tokens, keras.layers.Dense(3, name="head")(h))


@pytest.mark.parametrize(
    "config",
    [
        {"cluster.virtual_devices": 2},
        {"cluster.virtual_devices": 2, "zero.level": "v1"},
        {"cluster.virtual_devices": 2, "offload.level": "v0"},
        {"cluster.virtual_devices": 2, "optimizer.num_apply_group": 2},
        {"cluster.virtual_devices": 2, "zero.level": "v2", "pipeline.num_micro_batch": 2},
        {
            "cluster.virtual_devices": 2,
            "auto.auto_parallel": True,
            "pipeline.num_stages": 2,
            "pipeline.num_micro_batch": 2,
        },
    ],
    ids=["data_parallel", "zero_v1", "offload", "grouped_apply", "zero_v2", "auto_pipeline"],
)
def test_trainer_with_compiled_updates_ends_where_plain_updates_do(config):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, size=(64, 5)).astype("int32")
    y = rng.integers(0, 3, size=64).astype("int32")
    weights = {}
    for jit in (False, True):
        model = embedding_model()
        optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.05, global_clipnorm=1.0)
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        trainer = epl.EPLTrainer(
            model,
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer,
            config={**config, "optimizer.jit_compile": jit},
        )
        trainer.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=4, verbose=0, shuffle=False)
        steps = [s for lane in trainer.engine.update.steps for s in _flat(lane) if s]
        assert steps and all(s.jit_compile == jit for s in steps)
        weights[jit] = model.get_weights()
    for plain, compiled in zip(weights[False], weights[True]):
        np.testing.assert_allclose(compiled, plain, rtol=1e-5, atol=1e-6)


def _flat(items):
    for item in items:
        if isinstance(item, list):
            yield from _flat(item)
        else:
            yield item


# ---- each stage's forward and backward compiled with XLA (the trainer's jit_compile)


@pytest.mark.combines("jit_compile+pipeline")
def test_stages_compiled_with_xla_train_like_plain_ones():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 20, size=(64, 5)).astype("int32")
    y = rng.integers(0, 3, size=64).astype("int32")
    weights, losses = {}, {}
    for jit in (False, True):
        model = embedding_model()
        trainer = epl.EPLTrainer(
            model,
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            keras.optimizers.Adam(0.01),
            stages={"embed|global_average_pooling1d.*": 0, "hidden|head": 1},
            config={"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2},
            jit_compile=jit,
        )
        history = trainer.fit(
            x, y, batch_size=16, epochs=1, steps_per_epoch=4, verbose=0, shuffle=False
        )
        losses[jit] = history.history["loss"]
        weights[jit] = model.get_weights()
        evaluated = trainer.evaluate(x, y, batch_size=16, return_dict=True)["loss"]
        losses[jit] = [*losses[jit], evaluated]
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-5)
    for plain, compiled in zip(weights[False], weights[True]):
        np.testing.assert_allclose(compiled, plain, rtol=1e-5, atol=1e-6)


def test_jit_compile_comes_from_compile_and_is_refused_with_gradient_checkpointing():
    model = embedding_model()
    model.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=True)
    assert epl.EPLTrainer(model, config={"cluster.virtual_devices": 1}).jit_compile
    model = embedding_model()
    model.compile(keras.optimizers.SGD(0.1), "mse")  # Keras's "auto": the trainer's rule
    assert epl.EPLTrainer(model, config={"cluster.virtual_devices": 1}).jit_compile == "auto"
    with pytest.raises(ValueError, match=r"Use one of them.*gradient_checkpoint.type=.auto."):
        epl.EPLTrainer(
            embedding_model(),
            "mse",
            config={"cluster.virtual_devices": 1, "gradient_checkpoint.type": "auto"},
            jit_compile=True,
        )
