"""The loss the trainer reports is the loss Keras reports, whatever the data shape."""

import keras
import numpy as np
import pytest
from _models import LOSS

import epl_trainer as epl


def _data(n=8):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype("float32"), rng.integers(0, 3, n).astype("int32")


def test_epoch_loss_without_steps_per_epoch_counts_each_sample_once():
    """Regression: the last, empty pull of the iterator used to count a batch."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    x, y = _data()
    expected = float(LOSS(y, model(x)))
    trainer = epl.EPLTrainer(model, LOSS, keras.optimizers.SGD(0.0))
    history = trainer.fit(x, y, batch_size=8, verbose=0, shuffle=False)
    assert history.history["loss"][0] == pytest.approx(expected, rel=1e-6)


def _regularised(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(5, activation="tanh", name="first")(inputs)
    h = keras.layers.ActivityRegularization(l2=0.5, name="reg")(h)
    out = keras.layers.Dense(3, name="last")(h)
    return keras.Model(inputs, out)


def test_auxiliary_losses_of_earlier_stages_are_reported_once():
    x, y = _data(16)
    one_stage = epl.EPLTrainer(_regularised(), LOSS, keras.optimizers.SGD(0.0))
    expected = one_stage.fit(x, y, batch_size=16, verbose=0, shuffle=False).history["loss"][0]
    two_stages = epl.EPLTrainer(
        _regularised(),
        LOSS,
        keras.optimizers.SGD(0.0),
        stages={"first|reg": 0, "last": 1},
        config={"cluster.virtual_devices": 2},
    )
    got = two_stages.fit(x, y, batch_size=16, verbose=0, shuffle=False).history["loss"][0]
    assert got == pytest.approx(expected, rel=1e-6)
    reference = _regularised()
    assert expected == pytest.approx(float(LOSS(y, reference(x)) + sum(reference.losses)), rel=1e-6)


def test_evaluate_on_no_data_is_an_error_not_a_zero_loss():
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    trainer = epl.EPLTrainer(model, LOSS, keras.optimizers.SGD(0.0))
    x, y = _data()
    empty = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).take(0)
    with pytest.raises(ValueError, match="evaluate received no data"):
        trainer.evaluate(empty)
