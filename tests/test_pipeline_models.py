"""`pipeline_models.py` on a model that is not KerasHub's: any model with a
`preprocess_samples` gets its raw batches preprocessed, as KerasHub's `PipelineModel`
does. Here the raw samples are strings of comma-separated numbers that the model's
preprocessing parses; training on them (numpy reshuffled every epoch, odd batches,
sample weights) must equal training on the parsed numbers themselves."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import epl_trainer as epl


class ParsingModel(keras.Model):
    """A functional model whose samples arrive as "x0,x1,x2" strings."""

    def preprocess_samples(self, x, y=None, sample_weight=None):
        parts = tf.strings.split(x, ",").to_tensor(shape=[None, 3])
        return keras.utils.pack_x_y_sample_weight(
            tf.strings.to_number(parts, tf.float32), y, sample_weight
        )


def model(parsing: bool, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((3,), name="x")
    h = keras.layers.Dense(8, activation="tanh", name="hidden")(inputs)
    outputs = keras.layers.Dense(2, name="logits")(h)
    return (ParsingModel if parsing else keras.Model)(inputs, outputs)


def data(n=13, seed=0):
    rng = np.random.default_rng(seed)
    numbers = rng.normal(size=(n, 3)).astype("float32").round(3)
    texts = [",".join(f"{v:.3f}" for v in row) for row in numbers]
    return texts, numbers, rng.integers(0, 2, n), rng.uniform(0.5, 2.0, n).astype("float32")


def train(net, x, y, weights):
    trainer = epl.EPLTrainer(
        net,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.SGD(0.5),
        config={"cluster.virtual_devices": 2},
    )
    keras.utils.set_random_seed(7)  # the shuffling seed: the same order on both sides
    trainer.fit(x, y, sample_weight=weights, batch_size=5, epochs=2, shuffle=True, verbose=0)
    return trainer


def test_raw_samples_train_as_their_preprocessed_rows():
    texts, numbers, labels, weights = data()
    parsed, reference = model(parsing=True), model(parsing=False)
    parsed_trainer = train(parsed, texts, labels, weights)  # a list of strings: one array
    reference_trainer = train(reference, numbers, labels, weights)
    initial = model(parsing=False).get_weights()
    moved = max(float(np.abs(a - b).max()) for a, b in zip(reference.get_weights(), initial))
    assert moved > 1e-2
    for a, b in zip(parsed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)
    np.testing.assert_allclose(
        parsed_trainer.predict(np.asarray(texts), batch_size=4, verbose=0),
        reference_trainer.predict(numbers, batch_size=4, verbose=0),
        atol=1e-6,
    )
    dataset = tf.data.Dataset.from_tensor_slices((texts, labels)).batch(4)
    np.testing.assert_allclose(
        parsed_trainer.evaluate(dataset, verbose=0),
        reference_trainer.evaluate(numbers, labels, batch_size=4, verbose=0),
        rtol=1e-6,
    )
    with pytest.raises(ValueError, match=r"need a batch dimension.*Received: '0\.1,0\.2,0\.3'"):
        parsed_trainer.predict("0.1,0.2,0.3")
