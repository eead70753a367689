"""A `keras.losses.Loss` that overrides `__call__` (Keras's own layer test harness uses one)
is called as Keras calls it (objective.called_loss_term). Before, the engine called
`Loss.call`, which such a loss does not implement: `NotImplementedError` inside the step."""

import keras
import numpy as np
import pytest
from keras import ops

import epl_trainer as epl

OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.1), "adam": lambda: keras.optimizers.Adam(0.01)}


class CalledMean(keras.losses.Loss):
    """A mean cross-entropy over the rows, with sample weights, written in `__call__`."""

    def __call__(self, y_true, y_pred, sample_weight=None):
        per_row = keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
        if sample_weight is not None:
            per_row = per_row * ops.cast(sample_weight, per_row.dtype)
        return ops.mean(per_row)


class CalledSum(keras.losses.Loss):
    """Keras's layer-test loss (testing/test_case.py), declared as the sum it computes."""

    def __init__(self):
        super().__init__(reduction="sum")

    def __call__(self, y_true, y_pred, sample_weight=None):
        return ops.sum(y_pred)


def _model():
    keras.utils.set_random_seed(4)
    inputs = keras.Input((6,))
    return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(8, "tanh")(inputs)))


def _data(n):
    rng = np.random.default_rng(5)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n)


# SGD in every cell: a loss scaled wrongly over the replicas or the filled-up odd batch
# moves SGD's weights, where Adam's normalisation would hide it. Adam once, on the odd
# batch with the summing loss; its other three cells re-ran SGD's with another update
# rule (trimmed for the suite's time).
@pytest.mark.parametrize(
    "batch_size, loss, optimizer",
    [
        pytest.param(16, CalledMean, "sgd", id="even-CalledMean-sgd"),
        pytest.param(16, CalledSum, "sgd", id="even-CalledSum-sgd"),
        pytest.param(9, CalledMean, "sgd", id="odd-CalledMean-sgd"),
        pytest.param(9, CalledSum, "sgd", id="odd-CalledSum-sgd"),
        pytest.param(9, CalledSum, "adam", id="odd-CalledSum-adam"),
    ],
)
def test_a_loss_overriding_call_trains_as_in_keras(loss, optimizer, batch_size):
    x, y = _data(36)
    reference = _model()
    reference.compile(OPTIMIZERS[optimizer](), loss())
    expected = reference.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    model = _model()
    trainer = epl.EPLTrainer(
        model, loss(), OPTIMIZERS[optimizer](), config={"cluster.virtual_devices": 2}
    )
    got = trainer.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=2e-6)
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], rtol=1e-5)


def test_a_per_element_loss_overriding_call_is_refused_by_name():
    class PerElement(keras.losses.Loss):
        def __init__(self):
            super().__init__(reduction=None, name="per_element")

        def __call__(self, y_true, y_pred, sample_weight=None):
            return y_pred

    x, y = _data(8)
    trainer = epl.EPLTrainer(_model(), PerElement(), "sgd", config={"cluster.virtual_devices": 2})
    with pytest.raises(ValueError, match="'per_element' overrides __call__ and has reduction=None"):
        trainer.fit(x, y, batch_size=8, verbose=0)
