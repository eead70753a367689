"""Rows added to fill an odd batch (weight-0 copies of real rows, objective.py) stay out
of BatchNorm's batch statistics (sync_batch_norm.RealRowBatchNorm).

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
