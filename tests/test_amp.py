"""Tests for epl_trainer.core.engine.precision.amp: mixed-precision policies and loss scaling."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from epl_trainer.config.sections import AmpConfig
from epl_trainer.core.engine.precision import amp

HOST = "/CPU:0"
LOW = {"float16": tf.float16, "bfloat16": tf.bfloat16}


# ---- LossScaleSchedule: DeepSpeed's dynamic schedule ------------------------------------


def run_schedule(schedule, overflows):
    scales = []
    for overflow in overflows:
        schedule.update(overflow)
        scales.append(schedule.scale)
    return scales


def test_schedule_doubles_every_window_clean_steps():
    schedule = amp.LossScaleSchedule(2.0**4, window=3, hysteresis=2)
    assert run_schedule(schedule, [False] * 9) == [16, 16, 32, 32, 32, 64, 64, 64, 128]


def test_schedule_halves_only_at_the_hysteresis_th_overflow():
    schedule = amp.LossScaleSchedule(2.0**10, window=100, hysteresis=3)
    assert run_schedule(schedule, [True, False, True, True]) == [1024, 1024, 1024, 512]
    assert schedule.cur_hysteresis == 1
    # Not restored by clean steps (consecutive_hysteresis=False): the next overflow halves.
    assert run_schedule(schedule, [False, False, True]) == [512, 512, 256]
    assert schedule.skipped_steps == 4


def test_schedule_hysteresis_one_halves_every_overflow():
    schedule = amp.LossScaleSchedule(2.0**3, window=100, hysteresis=1)
    assert run_schedule(schedule, [True, True, False, True]) == [4, 2, 2, 1]


def test_schedule_window_counts_from_last_overflow_and_restores_hysteresis():
    schedule = amp.LossScaleSchedule(2.0**8, window=2, hysteresis=2)
    # Overflow at step 0 uses up one hysteresis; growth at step 2 restores it.
    assert run_schedule(schedule, [True, False, False]) == [256, 256, 512]
    assert schedule.cur_hysteresis == 2 and schedule.last_overflow_iter == 0
    assert run_schedule(schedule, [True, False, True]) == [512, 512, 256]


def test_schedule_never_goes_below_the_minimum_then_raises():
    schedule = amp.LossScaleSchedule(6.0, window=100, hysteresis=1, min_scale=2.0)
    assert run_schedule(schedule, [True, True]) == [3.0, 2.0]
    with pytest.raises(
        amp.MinLossScaleError, match=r"^Loss scale hit amp.min_loss_scale=2 .* at step 3\."
    ):
        schedule.update(True)


def test_schedule_growth_is_capped():
    schedule = amp.LossScaleSchedule(amp.MAX_LOSS_SCALE / 2, window=1, hysteresis=1)
    assert run_schedule(schedule, [False, False]) == [amp.MAX_LOSS_SCALE] * 2


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((4.0, 0, 2, 1.0), r"loss_scale_window and amp.hysteresis must be >= 1"),
        ((4.0, 10, 0, 1.0), r"loss_scale_window and amp.hysteresis must be >= 1"),
        ((1.0, 10, 2, 2.0), r"min_loss_scale <= 2\*\*amp.initial_scale_power.*initial_scale=1"),
        ((2.0**65, 10, 2, 1.0), r"<= 1\.84467e\+19"),
    ],
)
def test_schedule_rejects_inconsistent_settings(args, match):
    with pytest.raises(ValueError, match=match):
        amp.LossScaleSchedule(*args)
    with pytest.raises(ValueError, match=match):
        amp.DynamicLossScaler(*args, device=HOST)


# ---- DynamicLossScaler: the same schedule in the graph ------------------------------------


def test_tf_scaler_matches_reference_over_random_overflows():
    rng = np.random.default_rng(3)
    overflows = rng.random(200) < 0.25
    reference = amp.LossScaleSchedule(2.0**4, window=4, hysteresis=2, min_scale=2.0**-30)
    scaler = amp.DynamicLossScaler(2.0**4, 4, 2, 2.0**-30, device=HOST)

    @tf.function
    def step(finite):
        used = scaler.scale()
        scaler.update(finite)
        return used

    for overflow in overflows:
        used = step(tf.constant(not overflow))
        assert float(used) == reference.scale
        reference.update(bool(overflow))
        assert float(scaler.scale()) == reference.scale
        assert int(scaler.cur_hysteresis) == reference.cur_hysteresis
        assert int(scaler.last_overflow_iter) == reference.last_overflow_iter
    assert int(scaler.cur_iter) == 200
    assert int(scaler.skipped_steps) == reference.skipped_steps == overflows.sum()
    # The sequence exercised both directions.
    assert 0 < reference.skipped_steps < 200 and reference.scale != 2.0**4


def test_tf_scaler_state_lives_on_the_device():
    scaler = amp.DynamicLossScaler(8.0, 2, 2, 1.0, device="/CPU:1")
    assert all(v.device.endswith("CPU:1") for v in scaler.variables)
    assert not any(v.trainable for v in scaler.variables)


def test_tf_scaler_at_minimum_raises_in_graph_before_changing_state():
    scaler = amp.DynamicLossScaler(4.0, 10, 1, 2.0, device=HOST)
    update = tf.function(scaler.update)
    update(tf.constant(False))  # 4 -> 2
    with pytest.raises(tf.errors.InvalidArgumentError, match=amp.MIN_SCALE_ERROR) as info:
        update(tf.constant(False))
    assert float(scaler.scale()) == 2.0 and int(scaler.cur_iter) == 1
    error = amp.min_scale_error(info.value)
    assert isinstance(error, amp.MinLossScaleError)
    assert str(error).startswith("Loss scale hit amp.min_loss_scale=2 and the gradients")
    assert "at step 2." in str(error)


def test_tf_scaler_debug_log_prints_overflows(capfd):
    scaler = amp.DynamicLossScaler(64.0, 10, 2, 1.0, device=HOST, debug_log=True)
    update = tf.function(scaler.update)
    update(tf.constant(True))
    update(tf.constant(False))
    update(tf.constant(False))
    err = capfd.readouterr().err
    assert err.count("OVERFLOW! Skipping step. Attempted loss scale: 64") == 2
    assert "hysteresis 2 -> 1" in err and "-> now 32" in err


def test_min_scale_error_ignores_other_errors():
    error = tf.errors.InvalidArgumentError(None, None, "assertion failed: [something] [3]")
    assert amp.min_scale_error(error) is None


def test_fixed_scaler_counts_skipped_steps():
    scaler = amp.FixedLossScaler(128, device=HOST)
    update = tf.function(scaler.update)
    for finite in [True, False, False, True]:
        update(tf.constant(finite))
    assert float(scaler.scale()) == 128.0 and int(scaler.skipped_steps) == 2
    with pytest.raises(ValueError, match=r"must be > 0\. Received: amp.loss_scale=0"):
        amp.FixedLossScaler(0, device=HOST)


def test_make_loss_scaler_follows_the_config():
    dynamic = amp.make_loss_scaler(
        AmpConfig(level="O1", initial_scale_power=8, loss_scale_window=5, hysteresis=3), HOST
    )
    assert isinstance(dynamic, amp.DynamicLossScaler)
    assert float(dynamic.scale()) == 256.0 and (dynamic.window, dynamic.hysteresis) == (5, 3)
    fixed = amp.make_loss_scaler(AmpConfig(level="O1", loss_scale=64), HOST)
    assert isinstance(fixed, amp.FixedLossScaler) and float(fixed.scale()) == 64.0
    bf16 = amp.make_loss_scaler(AmpConfig(level="O1", dtype="bfloat16"), HOST)
    assert isinstance(bf16, amp.FixedLossScaler) and float(bf16.scale()) == 1.0
    with pytest.raises(ValueError, match=r"amp.level='O1'\. Received: amp.level=''"):
        amp.make_loss_scaler(AmpConfig(), HOST)


# ---- finite check, unscale, conditional apply ---------------------------------------------


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_all_finite_detects_inf_and_nan(bad):
    clean = [tf.ones((2, 3)), None, tf.zeros((4,), tf.float16)]
    assert bool(amp.all_finite(clean))
    assert bool(amp.all_finite([]))
    poisoned = tf.constant([1.0, bad, 2.0])
    assert not bool(amp.all_finite([*clean, poisoned]))
    assert not bool(tf.function(amp.all_finite)([*clean[:1], poisoned]))
    sparse = tf.IndexedSlices(poisoned[:, None], tf.constant([0, 1, 2]), tf.constant([5, 1]))
    assert not bool(amp.all_finite([sparse]))


def test_unscale_gradients_divides_by_the_scale_in_float32():
    grads = [tf.constant([1024.0, 2048.0]), None, tf.constant([512.0], tf.float16)]
    unscaled = amp.unscale_gradients(grads, tf.constant(1024.0))
    np.testing.assert_array_equal(unscaled[0], [1.0, 2.0])
    assert unscaled[1] is None and unscaled[2].dtype == tf.float16
    sparse = tf.IndexedSlices(tf.constant([[8.0]]), tf.constant([3]), tf.constant([5, 1]))
    (result,) = amp.unscale_gradients([sparse], 8.0)
    assert isinstance(result, tf.IndexedSlices) and float(result.values[0, 0]) == 1.0
    loss = amp.scale_loss(tf.constant(0.5), tf.constant(4.0))
    assert float(loss) == 2.0


def test_apply_if_finite_skips_the_optimizer_step():
    # The optimizer and its variable live on another device than the flag (as a stage's).
    with tf.device("/CPU:1"):
        variable = keras.Variable(np.ones(3, "float32"))
        optimizer = keras.optimizers.Adam(0.1)
        optimizer.build([variable])

    def apply(grad):
        with tf.device("/CPU:1"):
            optimizer.apply([grad], [variable])

    @tf.function
    def step(grad):
        with tf.device(HOST):
            finite = amp.all_finite([grad])
        return amp.apply_if_finite(finite, lambda: apply(grad))

    assert not bool(step(tf.constant([1.0, np.nan, 1.0])))
    np.testing.assert_array_equal(variable.numpy(), 1.0)
    assert int(optimizer.iterations) == 0
    assert all(np.all(v.numpy() == 0) for v in optimizer.variables[2:])  # slots untouched
    assert bool(step(tf.constant([1.0, 1.0, 1.0])))
    assert int(optimizer.iterations) == 1 and np.all(variable.numpy() < 1.0)


# ---- apply_mixed_precision ----------------------------------------------------------------


class Block(keras.layers.Layer):
    """A custom layer with its own weight and sublayers built in `build`."""

    def build(self, input_shape):
        self.inner = keras.layers.Dense(8, name="inner")
        self.inner.build(input_shape)
        self.gate = self.add_weight(shape=(8,), initializer="ones", name="gate")

    def call(self, x):
        return self.inner(x) * self.gate


def transformer_like(seed=0):
    keras.utils.set_random_seed(seed)
    features = keras.Input((6, 8), name="features")
    tokens = keras.Input((6,), dtype="int32", name="tokens")
    x = keras.layers.Add()([features, keras.layers.Embedding(30, 8, name="embed")(tokens)])
    x = keras.layers.LayerNormalization(name="norm")(x)
    x = keras.layers.MultiHeadAttention(2, 4, name="attention")(x, x)
    x = keras.layers.Conv1D(8, 3, padding="same", name="conv")(x)
    x = keras.layers.BatchNormalization(name="batchnorm")(x)
    x = keras.layers.Dropout(0.1, name="dropout")(x)
    inner_in = keras.Input((6, 8))
    nested = keras.Model(inner_in, Block(name="block")(inner_in), name="nested")
    x = nested(x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    logits = keras.layers.Dense(4, name="logits")(x)
    probabilities = keras.layers.Softmax(name="probabilities")(logits)
    model = keras.Model({"features": features, "tokens": tokens}, [logits, probabilities])
    rng = np.random.default_rng(seed)
    data = {
        "features": rng.normal(size=(3, 6, 8)).astype("float32"),
        "tokens": rng.integers(0, 30, size=(3, 6)).astype("int32"),
    }
    return model, data


COMPUTE_OPS = {"MatMul", "BatchMatMulV2", "Einsum", "Conv2D", "Conv2DBackpropFilter"}


@pytest.mark.onednn
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mixed_precision_keeps_float32_variables_and_computes_low(dtype):
    model, data = transformer_like()
    variables = list(model.variables)
    values = [v.numpy() for v in variables]
    expected_fp32, _ = model.stateless_call(
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        data,
    )

    changed = amp.apply_mixed_precision(model, dtype)

    # Every layer, sublayers and nested models included; input layers keep their dtype.
    layers = _all_layers(model)
    assert len(changed) == len(layers) == len(set(changed))
    assert {layer.dtype_policy.name for layer in layers} == {f"mixed_{dtype}"}
    assert {"embed", "attention/query", "nested/block/inner", "logits"} <= set(changed)
    assert any(name.startswith("attention/softmax") for name in changed)
    # The same variable objects, still float32, with the same values; nothing added.
    assert len(model.variables) == len(variables)
    assert all(a is b for a, b in zip(model.variables, variables))
    floats = [v for v in model.variables if "int" not in v.dtype]
    assert floats and all(v.dtype == "float32" for v in floats)
    for v, value in zip(model.variables, values):
        np.testing.assert_array_equal(v.numpy(), value)
    assert amp.apply_mixed_precision(model, dtype) == []  # idempotent

    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    @tf.function
    def step(trainable, non_trainable):
        with tf.GradientTape() as tape:
            tape.watch(trainable)
            (logits, probabilities), new_non_trainable = model.stateless_call(
                trainable, non_trainable, data, training=True
            )
            loss = tf.reduce_mean(tf.square(amp.float32_outputs(logits)))
        grads = tape.gradient(loss, trainable)
        return logits, probabilities, new_non_trainable, grads

    logits, probabilities, new_non_trainable, grads = step(trainable, non_trainable)
    assert logits.dtype == LOW[dtype] and probabilities.dtype == LOW[dtype]
    assert all(g.dtype == tf.float32 for g in grads)
    assert all(np.all(np.isfinite(tf.convert_to_tensor(g))) for g in grads)
    # BatchNorm statistics stay float32.
    assert all(v.dtype in (tf.float32, tf.int64) for v in new_non_trainable)

    # Every matmul / convolution of the traced stateless step runs in the low dtype.
    graph = step.get_concrete_function(trainable, non_trainable).graph
    compute = [op for op in graph.get_operations() if op.type in COMPUTE_OPS]
    assert compute and {op.get_attr("T") for op in compute} == {LOW[dtype]}

    (low_logits, _), _ = model.stateless_call(trainable, non_trainable, data)
    # Inference in low precision is close to the float32 result, within a bound derived
    # from the arithmetic, not from one CPU's kernels: every rounding to the low dtype has
    # relative error at most the unit roundoff u, and an implementation may accumulate a
    # dot product of n terms in the low dtype itself (TensorFlow's Einsum does on CPU, so
    # n roundings; MatMul accumulates in float32, 1). Errors of independent roundings add
    # like a random walk: Higham & Mary's probabilistic bound, lambda * sqrt(N) * u of the
    # magnitude, for N roundings on the way to a logit. Measured: float16 3.3e-4 on every
    # CPU tried; bfloat16 3.0e-3 (AVX-512 with oneDNN) and 8.6e-3 (AVX2-only EPYC, oneDNN
    # on or off); the bound is 4.6e-3 and 3.7e-2. A wrong layer moves a logit by O(1).
    assert np.abs(expected_fp32[0]).max() < 1.0
    unit_roundoff = 2.0**-11 if dtype == "float16" else 2.0**-8
    tolerance = 2 * np.sqrt(sum(ROUNDINGS_TO_A_LOGIT.values())) * unit_roundoff
    tolerance *= np.abs(expected_fp32[0]).max()
    np.testing.assert_allclose(
        np.asarray(tf.cast(low_logits, tf.float32)), expected_fp32[0], atol=tolerance
    )


# Roundings to the low dtype on the way from the inputs to one logit of `transformer_like`
# (worst case: every accumulation step of a dot product rounds).
ROUNDINGS_TO_A_LOGIT = {
    "inputs and embedding rows cast": 1,
    "add": 1,
    "layer norm output": 1,
    "query/key/value projections (8 features)": 8,
    "attention scores (key_dim 4)": 4,
    "softmax": 1,
    "weighted values (6 positions)": 6,
    "attention output (2 heads x 4)": 8,
    "conv (3 taps x 8 channels)": 24,
    "batch norm": 1,
    "block's inner dense (8) and gate": 9,
    "pool (mean of 6)": 6,
    "logits (8 features)": 8,
}


def test_mixed_precision_matches_a_model_built_under_the_global_policy():
    model, data = transformer_like(seed=4)
    amp.apply_mixed_precision(model, "float16")
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        reference, _ = transformer_like(seed=4)
    finally:
        keras.config.set_dtype_policy(previous)
    reference.set_weights(model.get_weights())
    ours = [(type(x).__name__, x.dtype_policy.name) for x in _all_layers(model)]
    theirs = [(type(x).__name__, x.dtype_policy.name) for x in _all_layers(reference)]
    assert ours == theirs
    np.testing.assert_array_equal(model(data)[0], reference(data)[0])


def _all_layers(model):
    return [
        layer
        for layer in model._flatten_layers(include_self=True, recursive=True)
        if not isinstance(layer, keras.layers.InputLayer)
    ]


def test_keep_float32_and_other_policies_are_left_alone():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    x = keras.layers.Dense(4, name="body")(inputs)
    x = keras.layers.Dense(4, name="wide", dtype="float64")(x)
    outputs = keras.layers.Dense(2, name="head")(x)
    model = keras.Model(inputs, outputs, name="model")
    changed = amp.apply_mixed_precision(model, "bfloat16", keep_float32="head")
    assert changed == ["model", "body"]
    assert model.get_layer("head").compute_dtype == "float32"
    assert model.get_layer("wide").compute_dtype == "float64"


def test_apply_mixed_precision_errors():
    model = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=r"needs a built model.*Received: unbuilt Sequential"):
        amp.apply_mixed_precision(model, "float16")
    model.build((None, 3))
    with pytest.raises(ValueError, match=r"Received: dtype='float8'"):
        amp.apply_mixed_precision(model, "float8")


def test_float32_outputs_keeps_softmax_logits_for_crossentropy():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(inputs))
    amp.apply_mixed_precision(model, "float16")
    model.layers[1].kernel.assign(np.array([[30.0, -30.0, 0.0]] * 4, "float32"))
    x, y = np.ones((2, 4), "float32"), np.array([1, 1])
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    @tf.function
    def losses(trainable):
        probabilities, _ = model.stateless_call(trainable, [], x)
        outputs = amp.float32_outputs({"p": probabilities, "ids": tf.constant([1])})
        assert outputs["p"].dtype == tf.float32 and outputs["ids"].dtype == tf.int32
        return loss_fn(y, probabilities), loss_fn(y, outputs["p"])

    plain, kept = losses([v.value for v in model.trainable_variables])
    # Logit gap 4 * 60 = 240: the float16 probability underflows to 0 and is clipped,
    # while the carried logits give the exact loss.
    assert float(kept) == pytest.approx(240.0)
    assert float(plain) < 20.0
