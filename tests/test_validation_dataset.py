"""`fit(..., batch_size=..., validation_data=<tf.data.Dataset>)` evaluates the dataset as
given, as `Model.fit` does (batch_size applies to array inputs only)."""

import keras
import pytest
import tensorflow as tf
from _models import LOSS, mlp, mlp_data

import epl_trainer as epl


def test_fit_with_a_batch_size_validates_on_the_dataset_as_keras_does():
    """The expected values come from plain Keras fit on the same model and data."""
    x, y = mlp_data()
    validation = tf.data.Dataset.from_tensor_slices((x[:20], y[:20])).batch(10)
    reference = mlp()
    reference.compile(keras.optimizers.SGD(0.1), LOSS, metrics=["accuracy"])
    expected = reference.fit(
        x, y, batch_size=16, epochs=1, verbose=0, shuffle=False, validation_data=validation
    ).history
    trainer = epl.EPLTrainer(
        mlp(),
        LOSS,
        keras.optimizers.SGD(0.1),
        metrics=["accuracy"],
        config={"cluster.virtual_devices": 2},
    )
    history = trainer.fit(
        x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, validation_data=validation
    )
    assert history.history["val_loss"][0] == pytest.approx(expected["val_loss"][0], abs=1e-5)
    assert history.history["val_accuracy"][0] == pytest.approx(expected["val_accuracy"][0])
