"""XLA for the whole step on one device or per lane, and `jit_compile="auto"`
(core/engine/jit_choice.py).

On one device a jit-compiled step is one XLA function (forward, backward, loss,
metrics), as Keras compiles its step; with data parallelism on one worker each lane's
forward and backward is one (compiled_lanes.py). The update stays outside, in the
finiteness check. "auto" compiles the one-device step when oneDNN is off and runs plain
ops otherwise. The weights match plain Keras in every case, and the choice is logged.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf
from _models import LOSS, keras_reference, max_weight_difference, mlp, mlp_data
from test_zero_bubble import embedding_data, embedding_model

import epl_trainer as epl
from epl_trainer.core.engine import jit_choice

ATOL = 1e-5


def _whole_step(trainer) -> bool:
    step = trainer.engine.program._step_gradients
    return isinstance(step, tf.types.experimental.PolymorphicFunction)


def _compiled_as(trainer, devices) -> bool:
    """XLA for the whole step (one device) or per lane (several), never per stage."""
    jit = trainer.engine_plan.jit
    per_stage = any(
        c.__qualname__.startswith("compiled_stage_call")
        for c in trainer.engine.program.hooks.stage_calls
    )
    expected = (True, False) if devices == 1 else (False, True)
    return (_whole_step(trainer), jit.per_lane) == expected and jit.compile and not per_stage


def _trainer(model, optimizer, devices=1, **kwargs):
    config = {"cluster.virtual_devices": devices, **kwargs.pop("config", {})}
    return epl.EPLTrainer(model, LOSS, optimizer, config=config, **kwargs)


def _fit(trainer, x, y, steps=4, **kwargs):
    trainer.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False,
                **kwargs)  # fmt: skip


@pytest.mark.combines("jit_compile+one_device", "jit_compile+data_parallel")
@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize(
    "optimizer, steps_per_execution",
    # Adam with 3 steps a call only: the update runs outside the compiled step, so Adam
    # adds its step count advancing 3 times a call; with one step a call it re-ran what
    # SGD shows (trimmed for the suite's time).
    [("sgd", 1), ("sgd", 3), ("adam", 3)],
)
def test_whole_step_in_xla_matches_keras(devices, optimizer, steps_per_execution):
    """SGD shows a wrong gradient scale that Adam's normalisation would hide."""
    make = {"sgd": lambda: keras.optimizers.SGD(0.1), "adam": lambda: keras.optimizers.Adam(0.01)}
    x, y = mlp_data()
    reference = mlp()
    keras_reference(reference, x, y, make[optimizer](), batch_size=16, steps=4)
    model = mlp()
    trainer = _trainer(
        model, make[optimizer](), devices, jit_compile=True,
        steps_per_execution=steps_per_execution,
    )  # fmt: skip
    _fit(trainer, x, y)
    assert _compiled_as(trainer, devices)
    assert max_weight_difference(reference, model) < ATOL


@pytest.mark.parametrize("devices", [1, 2])
def test_whole_step_keeps_sample_weights_metrics_and_batch_norm(devices):
    """Sample weights, a metric, BatchNorm's moving statistics (non-trainable state the
    compiled function returns; over 2 lanes, averaged) and a last batch of odd size, as
    plain ops on the same devices (and, on one device, plain Keras: over 2 lanes each
    BatchNorm normalises by its own half of the batch)."""
    x, y = mlp_data(n=56)
    weights = np.linspace(0.5, 2.0, len(x)).astype("float32")
    runs = {}
    for jit in (False, True):
        model = mlp(batchnorm=True)
        model.compile(keras.optimizers.SGD(0.1), LOSS, weighted_metrics=["accuracy"])
        trainer = epl.EPLTrainer(model, config={"cluster.virtual_devices": devices},
                                 jit_compile=jit)  # fmt: skip
        history = trainer.fit(x, y, sample_weight=weights, batch_size=16, epochs=2,
                              shuffle=False, verbose=0).history  # fmt: skip
        runs[jit] = (model, history)
    assert _compiled_as(trainer, devices)
    if devices == 1:
        reference = mlp(batchnorm=True)
        reference.compile(keras.optimizers.SGD(0.1), LOSS, weighted_metrics=["accuracy"])
        expected = reference.fit(x, y, sample_weight=weights, batch_size=16, epochs=2,
                                 shuffle=False, verbose=0).history  # fmt: skip
        runs["keras"] = (reference, expected)
    for other in [False, "keras"][: 3 - devices]:
        assert max_weight_difference(runs[other][0], runs[True][0]) < ATOL
        for key in ("loss", "accuracy"):
            np.testing.assert_allclose(runs[True][1][key], runs[other][1][key], rtol=1e-5,
                                       atol=1e-6)  # fmt: skip


@pytest.mark.parametrize(
    "devices, config",
    [
        (1, {"pipeline.num_micro_batch": 2}),  # the micro-batches as a loop in the graph
        (2, {"zero.level": "v1"}),
    ],
)
def test_each_stage_compiled_keeps_each_micro_batchs_real_rows_in_batch_norm(devices, config):
    """A compiled stage is traced once for every micro-batch and lane; BatchNorm's real
    rows differ between them (the last batch of 21 is filled up to 22 rows, one added
    row in the last micro-batch or lane), so they are an argument of the compiled
    function, not a tensor its first trace captured (which failed in a loop, and over 2
    lanes normalised the second lane's added row too: 3.7e-2 off plain ops)."""
    x, y = mlp_data(n=21)
    models = {}
    for jit in (False, True):
        models[jit] = mlp(batchnorm=True)
        trainer = _trainer(models[jit], keras.optimizers.SGD(0.1), devices, config=config,
                           jit_compile=jit)  # fmt: skip
        trainer.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert trainer.engine_plan.jit.per_stage
    assert max_weight_difference(models[False], models[True]) < ATOL


def _lstm(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(20, 4, mask_zero=True, name="embed")(inputs)
    h = keras.layers.LSTM(4, name="lstm")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))


class _LoopInBranch(keras.layers.Layer):
    """A loop inside a `tf.cond` branch: the loop is in a branch function, not among the
    stage graph's own ops."""

    def build(self, shape):
        self.kernel = self.add_weight((shape[-1], shape[-1]), name="kernel")

    def call(self, x):
        def body(i, h):
            return i + 1, tf.tanh(tf.matmul(h, self.kernel))

        def looped():
            return tf.while_loop(lambda i, _: i < 3, body, (tf.constant(0), x))[1]

        return tf.cond(tf.reduce_sum(x) > -1e9, looped, lambda: x)


def _loop_in_branch(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(20, 4, name="embed")(inputs)
    h = keras.layers.Flatten(name="flatten")(h)
    h = _LoopInBranch(name="branch_loop")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))


@pytest.mark.parametrize("build", [_lstm, _loop_in_branch], ids=["lstm", "loop_in_a_branch"])
def test_a_compiled_stage_with_a_loop_runs_as_plain_ops(build, caplog):
    """TensorFlow cannot differentiate a loop (an LSTM's) inside an XLA function from
    outside it (its intermediates, TensorLists, do not cross the function's boundary);
    Keras's compiled step has the backward inside. A compiled stage with a loop runs as
    plain ops, with a warning naming the loop, where the step failed in TensorFlow with
    "Support for TensorList crossing the XLA/TF boundary is not implemented". A loop
    inside a `tf.cond` branch is found in the graph's function library."""
    caplog.set_level(logging.WARNING, logger="epl_trainer")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, size=(16, 5)).astype("int32")
    x[::3, 3:] = 0
    y = rng.integers(0, 3, 16).astype("int32")
    models = {}
    for jit in (False, True):
        models[jit] = build()
        trainer = _trainer(models[jit], keras.optimizers.SGD(0.1),
                           config={"pipeline.num_micro_batch": 2}, jit_compile=jit)  # fmt: skip
        trainer.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert trainer.engine_plan.jit.per_stage
    assert max_weight_difference(models[False], models[True]) < ATOL
    assert "stage 0" in caplog.text and "while" in caplog.text


@pytest.mark.parametrize("devices", [1, 2])
def test_whole_step_with_sparse_embedding_gradients(devices):
    """An Embedding's gradient leaves the compiled function as IndexedSlices (over 2
    lanes, gathered as rows)."""
    x, y = embedding_data()
    reference = embedding_model()
    keras_reference(reference, x, y, keras.optimizers.Adam(0.01), batch_size=16, steps=3)
    model = embedding_model()
    trainer = _trainer(
        model,
        keras.optimizers.Adam(0.01),
        devices,
        jit_compile=True,
        config={"communication.sparse_as_dense": False},
    )
    _fit(trainer, x, y, steps=3)
    assert _compiled_as(trainer, devices)
    assert max_weight_difference(reference, model) < ATOL


@pytest.mark.parametrize("devices", [1, 2])
def test_whole_step_skips_a_nonfinite_step(devices):
    """The finiteness check stays outside the compiled functions: a NaN batch leaves the
    weights as they were, and the trainer counts the step."""
    x, y = mlp_data(n=32)
    x[20] = np.nan  # in the second batch
    model = mlp()
    trainer = _trainer(
        model,
        keras.optimizers.SGD(0.1),
        devices,
        jit_compile=True,
        config={"optimizer.nonfinite_loss": "skip"},
    )
    _fit(trainer, x[:16], y[:16], steps=1)
    before = model.get_weights()
    _fit(trainer, x[16:], y[16:], steps=1)
    assert _compiled_as(trainer, devices)
    assert trainer.stats_history["nonfinite_steps"][-1] == 1
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


def _plan(devices=1, stages=None, micro_batches=1):
    model = mlp()
    config = {"cluster.virtual_devices": devices, "pipeline.num_micro_batch": micro_batches}
    return epl.EPLTrainer(model, LOSS, keras.optimizers.SGD(0.1), stages=stages, config=config)


@pytest.mark.parametrize("onednn", [True, False])
def test_auto_compiles_the_whole_step_only_without_onednn(monkeypatch, caplog, onednn):
    monkeypatch.setattr(jit_choice, "onednn_enabled", lambda: onednn)
    monkeypatch.setattr(epl.core.engine.engine, "_ANNOUNCED", set())
    caplog.set_level(logging.INFO, logger="epl_trainer")
    x, y = mlp_data()
    reference = mlp()
    keras_reference(reference, x, y, keras.optimizers.SGD(0.1), batch_size=16, steps=4)
    model = mlp()
    trainer = _trainer(model, keras.optimizers.SGD(0.1))
    assert trainer.jit_compile == "auto"
    _fit(trainer, x, y)
    assert _whole_step(trainer) is not onednn
    assert trainer.engine_plan.jit.compile is not onednn
    logged = caplog.text
    assert ("oneDNN is off" in logged) is not onednn
    assert ("oneDNN is on" in logged) is onednn
    assert max_weight_difference(reference, model) < ATOL


def test_auto_without_onednn_by_layout(monkeypatch):
    """Without oneDNN, "auto" compiles data parallelism per lane and leaves a pipeline,
    gradient accumulation and ZeRO as plain ops; the user's True compiles those per
    stage."""
    monkeypatch.setattr(jit_choice, "onednn_enabled", lambda: False)
    layouts = {
        "pipeline": (_plan(2, {"dense_in": 0, "logits": 1}), "the lanes have 2 stages"),
        "data parallel": (_plan(2), "each lane in XLA"),
        # The reason named stages here before (a test that failed then).
        "micro-batches": (_plan(1, micro_batches=2), "each step has 2 micro-batches"),
        "dp micro-batches": (_plan(2, micro_batches=2), "each step has 2 micro-batches"),
    }
    for name, (trainer, reason) in layouts.items():
        lanes = name == "data parallel"
        choice = jit_choice.choose("auto", trainer.plan, trainer.config)
        assert choice.compile is lanes and choice.per_lane is lanes, name
        assert reason in choice.reason, (name, choice.reason)
        assert not choice.whole_step, name
        chosen = jit_choice.choose(True, trainer.plan, trainer.config)
        assert chosen.compile and not chosen.whole_step, name
        assert chosen.per_lane is lanes, name
    one = _plan(1)
    zero = one.config.replace({"zero.level": "v1"})
    assert jit_choice.choose("auto", one.plan, one.config).whole_step
    assert "ZeRO v1" in jit_choice.choose("auto", one.plan, zero).reason
    synchronized = jit_choice.choose("auto", one.plan, one.config, synchronized=True)
    assert not synchronized.compile and "synchronized BatchNorm" in synchronized.reason
    assert not jit_choice.choose(False, one.plan, one.config).compile


def test_the_compiled_models_choice_wins(monkeypatch):
    """On a CPU-only machine `Model.compile(jit_compile=True)` is kept; Keras records its
    own default ("auto", False on a CPU) as False, so False leaves the choice to the rule,
    and `EPLTrainer(jit_compile=False)` is the way to refuse XLA (on a GPU:
    test_jit_intent.py)."""
    monkeypatch.setattr(jit_choice, "onednn_enabled", lambda: False)
    for given, expected in ((False, "auto"), (True, True), ("auto", "auto")):
        model = mlp()
        model.compile(keras.optimizers.SGD(0.1), LOSS, jit_compile=given)
        trainer = epl.EPLTrainer(model, config={"cluster.virtual_devices": 1})
        assert trainer.jit_compile == expected
    model = mlp()
    model.compile(keras.optimizers.SGD(0.1), LOSS, jit_compile=True)
    trainer = epl.EPLTrainer(model, config={"cluster.virtual_devices": 1}, jit_compile=False)
    assert trainer.jit_compile is False


@pytest.mark.onednn
@pytest.mark.parametrize("devices", [1, 2])
def test_default_on_this_cpu_matches_keras(devices):
    """The default as this process's TensorFlow runs (CI runs it with oneDNN on and off):
    XLA for the whole step or each lane exactly when oneDNN is off, Keras's weights
    either way."""
    from epl_trainer.core.graph.peak import onednn_enabled

    x, y = mlp_data()
    reference = mlp()
    keras_reference(reference, x, y, keras.optimizers.Adam(0.01), batch_size=16, steps=4)
    model = mlp()
    trainer = _trainer(model, keras.optimizers.Adam(0.01), devices)
    _fit(trainer, x, y)
    assert trainer.engine_plan.jit.compile is not onednn_enabled()
    if not onednn_enabled():
        assert _compiled_as(trainer, devices)
    assert max_weight_difference(reference, model) < ATOL


@pytest.mark.combines("jit_compile+amp")
@pytest.mark.parametrize("devices", [1, 2])
def test_compiled_step_with_amp_and_dropout_matches_plain_ops(devices):
    """AMP's loss scale (a variable on the host) reaches the compiled function of every
    lane, also the one on the second device; dropout's seed state is each lane's."""
    x, y = mlp_data()
    amp = {"amp.level": "O1", "amp.dtype": "float16"}
    models = {}
    for jit in (False, True):
        models[jit] = mlp(dropout=0.3)
        trainer = _trainer(models[jit], keras.optimizers.SGD(0.1), devices, jit_compile=jit,
                           config=amp)  # fmt: skip
        _fit(trainer, x, y)
    assert _compiled_as(trainer, devices)
    assert trainer.stats_history["skipped_steps"][-1] == 0
    assert max_weight_difference(models[False], models[True]) < 1e-3


class _NoXLA(keras.layers.Layer):
    """A layer that says it does not compile with XLA (as StringLookup does)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_jit = False

    def call(self, x):
        return x


def test_auto_keeps_plain_ops_for_layers_without_xla(monkeypatch, caplog):
    """As Keras's own "auto": a layer with `supports_jit=False` keeps the step as plain
    ops, and the logged reason names it."""
    monkeypatch.setattr(jit_choice, "onednn_enabled", lambda: False)
    monkeypatch.setattr(epl.core.engine.engine, "_ANNOUNCED", set())
    caplog.set_level(logging.INFO, logger="epl_trainer")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    outputs = keras.layers.Dense(3)(_NoXLA(name="no_xla")(inputs))
    trainer = _trainer(keras.Model(inputs, outputs), keras.optimizers.SGD(0.1))
    assert not trainer.engine_plan.jit.compile
    assert "no XLA for layers ['no_xla']" in caplog.text
    with_xla = _trainer(mlp(), keras.optimizers.SGD(0.1))
    assert with_xla.engine_plan.jit.whole_step
