"""Rows added to fill an odd batch (weight-0 copies of real rows, objective.py) stay out
of BatchNorm's batch statistics (sync_batch_norm.RealRowBatchNorm), and out of the losses a
model adds of its own data (activity regularizers, `add_loss`).

Before, the copies entered each lane's batch moments, so the normalisation of the real
rows and the moving statistics: the moving mean after one step of 9 rows on 2 lanes was
off by the copied row's share. A BatchNormalization right after the input makes the
expected statistics a formula of the data alone.
"""

import keras
import numpy as np
import pytest

import epl_trainer as epl

MOMENTUM = 0.5
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _model():
    keras.utils.set_random_seed(6)
    inputs = keras.Input((4,))
    h = keras.layers.BatchNormalization(momentum=MOMENTUM, name="bn")(inputs)
    h = keras.layers.Dense(8, activation="relu", name="hidden")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))


def _data(n):
    rng = np.random.default_rng(7)
    return rng.normal(loc=2.0, size=(n, 4)).astype("float32"), rng.integers(0, 3, n)


def _moving_mean(model):
    return model.get_layer("bn").moving_mean.numpy()


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_data_parallel_lanes_normalise_their_real_rows(optimizer):
    """9 rows on 2 lanes: lane 0 has rows 0-4, lane 1 rows 5-8 and a copy of row 0; each
    lane's moving mean moves by its real rows' mean, and the lanes' are averaged."""
    x, y = _data(9)
    model = _model()
    trainer = epl.EPLTrainer(model, LOSS, optimizer, config={"cluster.virtual_devices": 2})
    trainer.fit(x, y, batch_size=9, epochs=1, shuffle=False, verbose=0)
    lane_means = (x[:5].mean(0) + x[5:].mean(0)) / 2
    expected = (1 - MOMENTUM) * lane_means  # the moving mean starts at 0
    np.testing.assert_allclose(_moving_mean(model), expected, atol=1e-6)


def test_synchronized_batch_norm_equals_keras_on_the_real_rows():
    x, y = _data(9)
    reference = _model()
    reference.compile(keras.optimizers.SGD(0.1), LOSS)
    reference.fit(x, y, batch_size=9, epochs=1, shuffle=False, verbose=0)
    model = _model()
    trainer = epl.EPLTrainer(
        model,
        LOSS,
        keras.optimizers.SGD(0.1),
        config={"cluster.virtual_devices": 2, "batch_norm.synchronized": True},
    )
    trainer.fit(x, y, batch_size=9, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(_moving_mean(model), _moving_mean(reference), atol=1e-6)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_pipeline_micro_batches_normalise_their_real_rows():
    """A 2-stage pipeline with 2 micro-batches of a 9-row batch: 5 rows, then 4 real rows
    and a copy; the moving mean moves once per micro-batch by its real rows' mean."""
    x, y = _data(9)
    model = _model()
    trainer = epl.EPLTrainer(
        model,
        LOSS,
        "sgd",
        stages={"bn|hidden": 0, "logits": 1},
        config={"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2},
    )
    trainer.fit(x, y, batch_size=9, epochs=1, shuffle=False, verbose=0)
    after_first = (1 - MOMENTUM) * x[:5].mean(0)
    expected = MOMENTUM * after_first + (1 - MOMENTUM) * x[5:].mean(0)
    np.testing.assert_allclose(_moving_mean(model), expected, atol=1e-6)


class _MeanSquare(keras.layers.Layer):
    """Adds its input's mean square as a loss: an `add_loss` of activations."""

    def call(self, x):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(x)))
        return x


def _model_adding_losses():
    keras.utils.set_random_seed(6)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(
        8, activation="relu", activity_regularizer=keras.regularizers.l1(0.05), name="hidden"
    )(inputs)
    h = _MeanSquare()(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))


def test_losses_of_the_data_count_each_real_row_once():
    """Keras's activity regularizer and an `add_loss` of activations are means over the
    batch's rows. 9 rows on 2 lanes: lane 0 trains on rows 0-5, lane 1 on rows 6-8 twice,
    weighed 6 : 3 (objective.fill_rows); evaluating batches of 4, 4 and 1 row fills the
    last one with whole copies too, not up to 4 rows. Before, the copies entered those
    means: after one step the weights were 9.7e-4 from Keras's and the reported loss
    4.5e-3, the evaluated loss 1.8e-2."""
    x, y = _data(9)
    reference = _model_adding_losses()
    reference.compile(keras.optimizers.SGD(0.1, momentum=0.9), LOSS)
    expected = reference.fit(x, y, batch_size=9, epochs=1, shuffle=False, verbose=0)
    model = _model_adding_losses()
    trainer = epl.EPLTrainer(
        model, LOSS, keras.optimizers.SGD(0.1, momentum=0.9), config={"cluster.virtual_devices": 2}
    )
    history = trainer.fit(x, y, batch_size=9, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-6)
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    np.testing.assert_allclose(
        trainer.evaluate(x, y, batch_size=4, verbose=0),
        reference.evaluate(x, y, batch_size=4, verbose=0),
        rtol=1e-6,
    )
