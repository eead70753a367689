"""A model that went through `model.compile(...)` trains with what compile was given.

`EPLTrainer(model, strategy=...).fit(dataset)` on a compiled model failed with "needs a
loss"; the optimizer default would also have replaced the compiled one silently.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _models import max_weight_difference, mlp, mlp_data

import epl_trainer as epl

ATOL = 1e-5
CONFIG = {"cluster.virtual_devices": 2}


def _compiled(model, optimizer, loss="sparse_categorical_crossentropy", **kwargs):
    model.compile(optimizer=optimizer, loss=loss, **kwargs)
    return model


def _dataset(x, y, batch_size=16):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)


def _softmax_mlp(seed=0):
    model = mlp(seed)
    outputs = keras.layers.Softmax()(model.outputs[0])
    return keras.Model(model.inputs, outputs)


def test_compiled_model_trains_with_its_optimizer_loss_and_metrics():
    x, y = mlp_data()
    reference = _compiled(_softmax_mlp(), keras.optimizers.Adam(0.01), metrics=["accuracy"])
    expected = reference.fit(_dataset(x, y), epochs=2, verbose=0, shuffle=False).history
    model = _compiled(_softmax_mlp(), keras.optimizers.Adam(0.01), metrics=["accuracy"])
    trainer = epl.EPLTrainer(model, strategy=epl.replicate(1), config=CONFIG)
    history = trainer.fit(_dataset(x, y), epochs=2, verbose=0)
    assert trainer.plan.num_replicas == 2
    assert isinstance(trainer.optimizer, keras.optimizers.Adam)
    assert max_weight_difference(reference, model) < ATOL
    np.testing.assert_allclose(history.history["loss"], expected["loss"], atol=1e-5)
    np.testing.assert_allclose(history.history["accuracy"], expected["accuracy"], atol=1e-6)


def test_passed_arguments_win_over_compiled_ones():
    x, y = mlp_data()
    reference = _compiled(_softmax_mlp(), keras.optimizers.SGD(0.3))
    reference.fit(_dataset(x, y), epochs=1, verbose=0, shuffle=False)
    model = _compiled(_softmax_mlp(), keras.optimizers.Adam(0.5), loss="mse")
    trainer = epl.EPLTrainer(
        model,
        loss="sparse_categorical_crossentropy",
        optimizer=keras.optimizers.SGD(0.3),
        config=CONFIG,
    )
    trainer.fit(_dataset(x, y), epochs=1, verbose=0)
    assert max_weight_difference(reference, model) < ATOL


def _two_outputs(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,), name="x")
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    a = keras.layers.Dense(1, name="a")(hidden)
    b = keras.layers.Dense(1, name="b")(hidden)
    return keras.Model(inputs, {"a": a, "b": b})


@pytest.mark.parametrize("weights", [{"a": 0.25, "b": 2.0}, [3.0, 0.5]])
def test_compiled_loss_weights_are_applied(weights):
    x, _ = mlp_data()
    y = {"a": x[:, :1], "b": x[:, 1:2] * 3}
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    loss = {"a": "mse", "b": "mse"}
    reference = _compiled(_two_outputs(), keras.optimizers.SGD(0.05), loss, loss_weights=weights)
    expected = reference.fit(dataset, epochs=1, verbose=0, shuffle=False).history["loss"]
    model = _compiled(_two_outputs(), keras.optimizers.SGD(0.05), loss, loss_weights=weights)
    history = epl.EPLTrainer(model, config=CONFIG).fit(dataset, epochs=1, verbose=0)
    assert max_weight_difference(reference, model) < ATOL
    np.testing.assert_allclose(history.history["loss"], expected, rtol=1e-5)


def test_uncompiled_model_without_loss_names_both_ways_to_give_one():
    """It may predict (as in Keras); training names both ways to give a loss."""
    trainer = epl.EPLTrainer(mlp(), config=CONFIG)
    x = np.zeros((4, 6), "float32")
    with pytest.raises(ValueError, match=r"to fit: pass loss=\.\.\., or compile the model"):
        trainer.fit(x, np.zeros(4, "int32"), batch_size=4, verbose=0)
