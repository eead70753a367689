"""A model Keras set up for mixed precision keeps it under EPLTrainer (compiled.py's
`mixed_precision_keys`): built under the mixed_float16 policy and compiled (Keras wraps
its optimizer in a LossScaleOptimizer), it trains with the engine's dynamic loss scale on
Keras's schedule (start 2**15, halve and skip at an overflow, double after 2000 clean
steps); mixed_bfloat16 without a scale. Before, the LossScaleOptimizer was unwrapped and
the float16 model ran without any loss scaling, silently."""

import keras
import numpy as np
import pytest
from _models import max_weight_difference

import epl_trainer as epl


@pytest.fixture
def policy():
    previous = keras.config.dtype_policy()
    yield lambda name: keras.config.set_dtype_policy(name)
    keras.config.set_dtype_policy(previous)


def _model(seed=2):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(16, activation="tanh")(inputs)
    outputs = keras.layers.Dense(3, dtype="float32")(keras.layers.Dense(8)(h))
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _data(n=32, scale=1.0):
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(n, 6)) * scale).astype("float32")
    return x, rng.integers(0, 3, n).astype("int32")


@pytest.mark.parametrize("name", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.combines("amp+data_parallel")
def test_keras_mixed_precision_becomes_the_engines_amp(policy, name):
    policy(name)
    reference, model = _model(), _model()
    dtype = name.split("_")[1]
    if dtype == "float16":
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    x, y = _data()
    reference.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    trainer = epl.EPLTrainer(model, config={"cluster.virtual_devices": 2})
    trainer.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    stats = trainer.stats_history
    assert trainer.config.amp.level == "O1" and trainer.config.amp.dtype == dtype
    if dtype == "float16":
        assert stats["loss_scale"][-1] == reference.optimizer.dynamic_scale.numpy() == 2.0**15
    # Low-precision rounding on half batches per device: close, not bit-equal.
    assert max_weight_difference(reference, model) < (2e-3 if dtype == "float16" else 2e-2)


def test_an_overflowing_float16_step_is_skipped_and_the_scale_halved_as_keras(policy):
    policy("mixed_float16")
    reference, model = _model(), _model()
    start = [w.copy() for w in model.get_weights()]
    x, y = _data(n=8, scale=1e5)  # float16 activations overflow: inf gradients
    reference.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    trainer = epl.EPLTrainer(model, config={"cluster.virtual_devices": 2})
    trainer.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    stats = trainer.stats_history
    assert reference.optimizer.dynamic_scale.numpy() == stats["loss_scale"][-1] == 2.0**14
    assert stats["skipped_steps"][-1] == 1
    for before, after, keras_after in zip(start, model.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(after, before)
        np.testing.assert_array_equal(keras_after, before)


def test_loss_scale_keys_the_user_sets_win_over_keras_schedule(policy):
    """A mixed_float16 model with config amp.loss_scale=128 trained at Keras's dynamic
    2**15: the compiled model's keys replaced the user's silently."""
    policy("mixed_float16")
    x, y = _data()
    config = {"cluster.virtual_devices": 2, "amp.loss_scale": 128}
    trainer = epl.EPLTrainer(_model(), config=config)
    trainer.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert trainer.config.amp.level == "O1" and trainer.config.amp.loss_scale == 128
    assert trainer.stats_history["loss_scale"][-1] == 128


def test_amp_keys_given_while_amp_is_off_are_refused():
    """amp.loss_scale / amp.debug_log with amp.level '' trained in float32 and did
    nothing (EPL's table lists them under AMP)."""
    with pytest.raises(ValueError, match=r"amp\.loss_scale only apply with AMP on.*128"):
        epl.EPLTrainer(_model(), config={"amp.loss_scale": 128}).fit(*_data(), verbose=0)
