"""The user's objects act as in Keras, found by Keras's own trainer tests routed through
the trainer (tests/keras_conformance):

* weight constraints (`kernel_constraint=...`) are applied after every update, as Keras's
  optimizer applies them (the engine's copies carry the user's constraint); before, a
  MaxNorm / NonNeg kernel trained unconstrained without a word;
* an uncompiled model without a loss predicts (before: refused when the trainer was made);
* a callback's assign to a model variable in a batch hook stays (before: the next
  write-back of the engine's copies overwrote it).
"""

import keras
import numpy as np
import pytest

import epl_trainer as epl

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.5), "adam": lambda: keras.optimizers.Adam(0.05)}


def _model():
    keras.utils.set_random_seed(9)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(
        8, activation="relu", kernel_constraint=keras.constraints.MaxNorm(0.3), name="hidden"
    )(inputs)
    outputs = keras.layers.Dense(3, kernel_constraint=keras.constraints.NonNeg(), name="out")(h)
    return keras.Model(inputs, outputs)


def _data():
    rng = np.random.default_rng(9)
    return rng.normal(size=(48, 6)).astype("float32"), rng.integers(0, 3, 48)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("layout", ["dp2", "pipeline"])
def test_constraints_apply_as_in_keras(optimizer, layout):
    x, y = _data()
    reference = _model()
    reference.compile(OPTIMIZERS[optimizer](), LOSS)
    reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model = _model()
    stages = {"hidden": 0, "out": 1} if layout == "pipeline" else None
    trainer = epl.EPLTrainer(
        model, LOSS, OPTIMIZERS[optimizer](), stages=stages,
        config={"cluster.virtual_devices": 2},
    )  # fmt: skip
    trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert model.get_layer("out").kernel.numpy().min() >= 0
    norms = np.linalg.norm(model.get_layer("hidden").kernel.numpy(), axis=0)
    assert norms.max() <= 0.3 + 1e-6
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=2e-6)


def test_constraints_under_zero_are_refused_by_name():
    x, y = _data()
    trainer = epl.EPLTrainer(
        _model(), LOSS, "sgd", config={"cluster.virtual_devices": 2, "zero.level": "v1"}
    )
    with pytest.raises(
        ValueError, match=r"constrained variables \['hidden/kernel', 'out/kernel'\]"
    ):
        trainer.fit(x, y, batch_size=16, verbose=0)


def test_an_uncompiled_model_without_a_loss_predicts_and_refuses_to_train():
    """As Keras: predict needs no compile; fit and evaluate name the missing loss."""
    x, y = _data()
    model = _model()
    trainer = epl.EPLTrainer(model, config={"cluster.virtual_devices": 2})
    np.testing.assert_allclose(
        trainer.predict(x, batch_size=16, verbose=0), model.predict(x, verbose=0), atol=1e-6
    )
    with pytest.raises(ValueError, match=r"needs a loss to fit: .* Received: loss=None"):
        trainer.fit(x, y, batch_size=16, verbose=0)
    with pytest.raises(ValueError, match="needs a loss to evaluate"):
        trainer.evaluate(x, y, batch_size=16, verbose=0)


def test_a_batch_hooks_assign_to_a_model_variable_stays():
    class Counted(keras.Model):
        def __init__(self):
            super().__init__()
            self.counter = self.add_weight(shape=(), initializer="zeros", trainable=False)
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return self.dense(x)

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.model.counter.assign_add(1.0)

        def on_test_batch_end(self, batch, logs=None):
            self.model.counter.assign_add(100.0)

    x, y = _data()
    model = Counted()
    model(x[:1])
    trainer = epl.EPLTrainer(model, LOSS, "sgd", config={"cluster.virtual_devices": 2})
    trainer.fit(
        x, y, batch_size=16, epochs=2, callbacks=[Count()], verbose=0,
        validation_data=(x[:16], y[:16]),
    )  # fmt: skip
    # 3 training batches and 1 validation batch in each of 2 epochs, as in Keras.
    assert float(model.counter.numpy()) == 2 * (3 + 100)
