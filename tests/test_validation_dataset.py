"""`fit(..., batch_size=..., validation_data=<tf.data.Dataset>)` evaluates the dataset as
given, as `Model.fit` does (batch_size applies to array inputs only)."""

import keras
import pytest
import tensorflow as tf
from _models import LOSS, mlp, mlp_data

import epl_trainer as epl


def test_fit_with_a_batch_size_accepts_a_validation_dataset():
    x, y = mlp_data()
    trainer = epl.EPLTrainer(
        mlp(),
        LOSS,
        keras.optimizers.SGD(0.1),
        metrics=["accuracy"],
        config={"cluster.virtual_devices": 2},
    )
    validation = tf.data.Dataset.from_tensor_slices((x[:20], y[:20])).batch(10)
    history = trainer.fit(x, y, batch_size=16, epochs=1, verbose=0, validation_data=validation)
    expected = trainer.evaluate(validation)
    assert history.history["val_loss"][0] == pytest.approx(expected["loss"], abs=1e-6)
    assert history.history["val_accuracy"][0] == pytest.approx(expected["accuracy"], abs=1e-6)
