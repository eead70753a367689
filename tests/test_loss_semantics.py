"""One-batch loss semantics (core/engine/objective.py): however a step's batch is cut into
micro-batches, replicas and stages, its gradient is the single-device gradient of the
whole batch, with Keras's reduction: sample weights, masks behind
`Embedding(mask_zero=True)`, reduction="sum", and batches that do not split evenly.

Every case trains with **SGD** (Adam divides a constant factor of the gradient away) and
compares the weights after an epoch with Keras `fit` on the same batches, to 1e-5. The
reported loss is compared with Keras's history too.

Before the one-batch semantics, each micro-batch's own mean was scaled by 1/M and the
replicas averaged: measured here, padded sequences with a per-token loss ended 0.32
from Keras on 2 devices, and reduction="sum" 40 away; sample weights and odd batches
were refused.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _models import max_weight_difference

import epl_trainer as epl

ATOL = 1e-5
BATCH = 8
STEPS = 4

LAYOUTS = {
    "dp2": {"cluster.virtual_devices": 2},
    "micro_batches": {"pipeline.num_micro_batch": 2},
    "dp2_micro_batches": {"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2},
    "pipeline": {"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2},
    "zero_v1": {"cluster.virtual_devices": 2, "zero.level": "v1"},
    "zero_v2": {"cluster.virtual_devices": 2, "zero.level": "v2"},
}


def _dense_model(seed=3, classes=3):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,), name="x")
    h = keras.layers.Dense(16, activation="tanh", name="dense_in")(inputs)
    h = keras.layers.Dense(16, activation="tanh", name="hidden")(h)
    return keras.Model(inputs, keras.layers.Dense(classes, name="logits")(h))


def _dense_data(n=BATCH * STEPS, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = rng.integers(0, 3, n).astype("int32")
    w = rng.uniform(0.0, 3.0, n).astype("float32")
    return x, y, w


def _token_model(seed=5):
    """Padded token sequences: the mask of Embedding(mask_zero=True) reaches a per-token
    loss (a sequence-to-sequence tagger)."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((7,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(30, 8, mask_zero=True, name="embed")(tokens)
    h = keras.layers.Dense(16, activation="tanh", name="dense_in")(h)
    h = keras.layers.Dense(16, activation="tanh", name="hidden")(h)
    return keras.Model(tokens, keras.layers.Dense(5, name="logits")(h))


def _token_data(n=BATCH * STEPS, seed=1):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 30, size=(n, 7)).astype("int32")
    lengths = rng.integers(1, 8, n)  # very different numbers of real tokens per row
    tokens[np.arange(7)[None, :] >= lengths[:, None]] = 0
    labels = rng.integers(0, 5, size=(n, 7)).astype("int32")
    return tokens, labels


def _dataset(*arrays, batch=BATCH):
    return tf.data.Dataset.from_tensor_slices(arrays).batch(batch)


def _stages(layout, model):
    if layout != "pipeline":
        return None
    names = {layer.name for layer in model.layers}
    if "embed" in names:
        return {"embed|dense_in": 0, "hidden|logits": 1}
    return {"dense_in": 0, "hidden|logits": 1}


def _keras_fit(model, dataset, loss, learning_rate=0.5):
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss=loss)
    return model.fit(dataset, epochs=1, verbose=0, shuffle=False).history["loss"][-1]


def _epl_fit(model, dataset, loss, layout, learning_rate=0.5):
    trainer = epl.EPLTrainer(
        model, loss, keras.optimizers.SGD(learning_rate), stages=_stages(layout, model),
        config=LAYOUTS[layout],
    )  # fmt: skip
    return trainer.fit(dataset, epochs=1, verbose=0).history["loss"][-1]


def _compare(make_model, dataset, loss, layout, loss_atol=ATOL):
    reference, model = make_model(), make_model()
    expected = _keras_fit(reference, dataset, loss)
    reported = _epl_fit(model, dataset, loss, layout)
    assert max_weight_difference(reference, model) < ATOL
    np.testing.assert_allclose(reported, expected, atol=loss_atol, rtol=1e-5)


SPARSE_CE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.mark.parametrize("layout", ["dp2", "micro_batches", "pipeline", "zero_v1", "zero_v2"])
def test_sample_weights_with_sgd(layout):
    x, y, w = _dense_data()
    _compare(_dense_model, _dataset(x, y, w), SPARSE_CE, layout)


# dp2_micro_batches: per-token weights cut over replicas and micro-batches at once.
@pytest.mark.parametrize("layout", ["dp2", "dp2_micro_batches", "pipeline", "zero_v1"])
def test_masked_tokens_with_sgd(layout):
    tokens, labels = _token_data()
    _compare(_token_model, _dataset(tokens, labels), SPARSE_CE, layout)


@pytest.mark.parametrize("layout", ["dp2", "pipeline"])
def test_reduction_sum_with_sgd(layout):
    x, y, w = _dense_data()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    reference, model = _dense_model(), _dense_model()
    # The gradient of a sum is BATCH times the mean's: the learning rate is scaled down.
    expected = _keras_fit(reference, _dataset(x, y, w), loss, 0.5 / BATCH)
    reported = _epl_fit(model, _dataset(x, y, w), loss, layout, 0.5 / BATCH)
    assert max_weight_difference(reference, model) < ATOL
    np.testing.assert_allclose(reported, expected, rtol=1e-5)


# 7 rows (4 + 3 over the replicas, a short last batch of 4) re-ran what 5 rows show (3 + 2,
# a short last batch of 2): trimmed for the suite's time.
@pytest.mark.parametrize("batch", [5, 1])
@pytest.mark.parametrize("layout", ["dp2", "pipeline"])
def test_batches_that_do_not_split_evenly(layout, batch):
    """5 and 1 rows over 2 replicas (or 2 stages x 2 micro-batches): the missing rows
    are repeated with weight 0, so the step equals Keras's on exactly the real rows; the
    epoch's last batch is short too (32 = 6 x 5 + 2)."""
    x, y, _ = _dense_data()
    _compare(_dense_model, _dataset(x, y, batch=batch), SPARSE_CE, layout)


def test_sample_weights_and_an_odd_last_batch_with_accumulation():
    x, y, w = _dense_data(n=30)
    _compare(_dense_model, _dataset(x, y, w), SPARSE_CE, "micro_batches")


def test_mean_with_sample_weight_reduction():
    x, y, w = _dense_data()
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="mean_with_sample_weight"
    )
    _compare(_dense_model, _dataset(x, y, w), loss, "dp2")


class _AddsLoss(keras.layers.Layer):
    """An auxiliary loss on its input (as an activity regularizer would add)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True

    def call(self, x):
        self.add_loss(1e-3 * keras.ops.mean(keras.ops.square(x)))
        return x


def test_a_masked_loss_next_to_an_auxiliary_loss_is_refused_with_the_alternatives():
    tokens, labels = _token_data()
    keras.utils.set_random_seed(5)
    inputs = keras.Input((7,), dtype="int32")
    h = keras.layers.Embedding(30, 8, mask_zero=True)(inputs)
    h = _AddsLoss()(keras.layers.Dense(16, activation="tanh")(h))
    model = keras.Model(inputs, keras.layers.Dense(5)(h))
    trainer = epl.EPLTrainer(model, SPARSE_CE, keras.optimizers.SGD(0.5), config=LAYOUTS["dp2"])
    with pytest.raises(ValueError, match="auxiliary losses"):
        trainer.fit(_dataset(tokens, labels), epochs=1, verbose=0)


def _loss_of(result):
    return result["loss"] if isinstance(result, dict) else np.ravel(result)[0]


@pytest.mark.parametrize("batch", [8, 5])
def test_evaluate_weighs_rows_as_keras(batch):
    x, y, w = _dense_data()
    reference, model = _dense_model(), _dense_model()
    reference.compile(loss=SPARSE_CE)
    expected = reference.evaluate(_dataset(x, y, w, batch=batch), verbose=0)
    trainer = epl.EPLTrainer(model, SPARSE_CE, config=LAYOUTS["dp2"])
    logs = trainer.evaluate(_dataset(x, y, w, batch=batch))
    np.testing.assert_allclose(_loss_of(logs), _loss_of(expected), rtol=1e-5)


@pytest.mark.parametrize("batch", [8, 5])
def test_split_head_with_sample_weights_and_odd_batches(batch):
    """A column-split classifier (2 lanes of one replica) computes its loss shard-wise
    (split.py's sharded cross-entropy): weighted and with padded rows, still the
    single-device step."""
    x, y, w = _dense_data()
    reference, model = _dense_model(classes=4), _dense_model(classes=4)
    dataset = _dataset(x, y, w, batch=batch)
    expected = _keras_fit(reference, dataset, SPARSE_CE)
    trainer = epl.EPLTrainer(
        model, SPARSE_CE, keras.optimizers.SGD(0.5), split=["logits"],
        config={"cluster.virtual_devices": 2, "cluster.colocate_split_and_replicate": True},
    )  # fmt: skip
    reported = trainer.fit(dataset, epochs=1, verbose=0).history["loss"][-1]
    assert max_weight_difference(reference, model) < ATOL
    np.testing.assert_allclose(reported, expected, rtol=1e-5)


@pytest.mark.parametrize("layout", ["dp2", "pipeline"])
def test_weighted_metrics_get_the_sample_weights_and_metrics_do_not(layout):
    """As Keras's compile: `weighted_metrics` see the data's sample weights, `metrics`
    only the real rows (the rows added to fill a batch of 5 count in neither)."""
    x, y, w = _dense_data()
    dataset = _dataset(x, y, w, batch=5)
    reference, model = _dense_model(), _dense_model()
    for m in (reference, model):
        m.compile(
            optimizer=keras.optimizers.SGD(0.5),
            loss=SPARSE_CE,
            metrics=[keras.metrics.SparseCategoricalAccuracy(name="acc")],
            weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="weighted_acc")],
        )
    expected = reference.fit(dataset, epochs=1, verbose=0, shuffle=False).history
    trainer = epl.EPLTrainer(model, stages=_stages(layout, model), config=LAYOUTS[layout])
    history = trainer.fit(dataset, epochs=1, verbose=0).history
    assert expected["acc"][-1] != expected["weighted_acc"][-1]  # the weights matter here
    for key in ("loss", "acc", "weighted_acc"):
        np.testing.assert_allclose(history[key][-1], expected[key][-1], rtol=1e-5)
    assert max_weight_difference(reference, model) < ATOL
