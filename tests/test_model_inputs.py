"""Inputs as Keras matches them to a model (`epl_trainer/training/model_inputs.py`): a dict given
to a list-input model, Python generators and `keras.utils.PyDataset`s, None for an
optional input. Expected values come from plain Keras on the same model, data and seed;
the trainer runs data parallel on 2 devices with SGD."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import epl_trainer as epl

ATOL = 1e-5
DP2 = {"cluster.virtual_devices": 2}


def _weights_differ(a: keras.Model, b: keras.Model) -> float:
    return max(float(np.abs(u - v).max()) for u, v in zip(a.get_weights(), b.get_weights()))


def _two_input_model(seed=0):
    """Inputs of different widths in a list, so a dict read in key order (sorted) would
    not fit: "wide" sorts after "narrow" but comes first."""
    keras.utils.set_random_seed(seed)
    wide = keras.Input((6,), name="wide")
    narrow = keras.Input((2,), name="narrow")
    hidden = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([wide, narrow]))
    return keras.Model([wide, narrow], keras.layers.Dense(1)(hidden))


def _two_input_data(n=32):
    rng = np.random.default_rng(0)
    x = {"narrow": rng.normal(size=(n, 2)), "wide": rng.normal(size=(n, 6))}
    return {k: v.astype("float32") for k, v in x.items()}, rng.normal(size=(n, 1)).astype("float32")


@pytest.mark.parametrize("as_dataset", [False, True], ids=["arrays", "dataset"])
def test_a_dict_given_to_a_list_input_model_is_matched_by_name_as_keras(as_dataset):
    x, y = _two_input_data()
    reference = _two_input_model()
    reference.compile(keras.optimizers.SGD(0.1), "mse")
    reference.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    model = _two_input_model()
    trainer = epl.EPLTrainer(model, "mse", keras.optimizers.SGD(0.1), config=DP2)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8) if as_dataset else x
    trainer.fit(data, None if as_dataset else y, batch_size=None if as_dataset else 8,
                shuffle=False, verbose=0)  # fmt: skip
    assert _weights_differ(model, reference) < ATOL
    assert trainer.evaluate(x, y, batch_size=8, verbose=0) == pytest.approx(
        reference.evaluate(x, y, batch_size=8, verbose=0), abs=ATOL
    )
    np.testing.assert_allclose(
        trainer.predict(x, batch_size=8, verbose=0), reference.predict(x, verbose=0), atol=ATOL
    )


def test_a_dict_missing_an_input_of_a_list_input_model_is_refused_by_name():
    x, y = _two_input_data()
    trainer = epl.EPLTrainer(_two_input_model(), "mse", "sgd", config=DP2)
    with pytest.raises(ValueError, match=r"model has 2 input\(s\), the dataset gives 1"):
        trainer.fit({"wide": x["wide"]}, y, verbose=0)


def _batches(x, y, with_y=True, batch_size=8):
    for start in range(0, len(y), batch_size):
        part = slice(start, start + batch_size)
        yield (x[part],) + ((y[part],) if with_y else ())


class _Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch_size=8):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return len(self.y) // self.batch_size

    def __getitem__(self, index):
        part = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[part], self.y[part]


def _mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
    )


@pytest.mark.parametrize("source", ["generator", "py_dataset"])
def test_python_data_sources_train_evaluate_and_predict_as_keras(source):
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(40, 4)).astype("float32"), rng.normal(size=(40, 1)).astype("float32")

    def data(with_y=True):
        if source == "generator":
            return _batches(x, y, with_y)
        return _Batches(x, y)

    reference = _mlp()
    reference.compile(keras.optimizers.SGD(0.1), "mse")
    reference.fit(data(), epochs=1, verbose=0)
    model = _mlp()
    trainer = epl.EPLTrainer(model, "mse", keras.optimizers.SGD(0.1), config=DP2)
    trainer.fit(data(), epochs=1, verbose=0)
    assert _weights_differ(model, reference) < ATOL
    assert trainer.evaluate(data(), verbose=0) == pytest.approx(
        reference.evaluate(data(), verbose=0), abs=ATOL
    )
    expected = reference.predict(data(with_y=False), verbose=0)
    np.testing.assert_allclose(trainer.predict(data(with_y=False), verbose=0), expected, atol=ATOL)


class OptionalInput(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def call(self, x, o=None):
        return self.dense(x if o is None else x * o)


def _optional_input_model(seed=0):
    keras.utils.set_random_seed(seed)
    x = keras.Input((3,), name="x")
    o = keras.Input((3,), name="o", optional=True)
    return keras.Model({"x": x, "o": o}, OptionalInput()(x, o))


@pytest.mark.parametrize("given", ["none", "array", "generator_none"])
def test_an_optional_input_given_none_or_an_array_trains_as_keras(given):
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(16, 3)).astype("float32"), rng.normal(size=(16, 2)).astype("float32")
    o = None if given != "array" else rng.uniform(0.5, 1.5, size=(16, 3)).astype("float32")

    def data():
        if given == "generator_none":
            return ((({"x": x[i : i + 8], "o": None}), y[i : i + 8]) for i in (0, 8))
        return {"x": x, "o": o}

    targets = None if given == "generator_none" else y
    reference = _optional_input_model()
    reference.compile(keras.optimizers.SGD(0.1), "mse")
    reference.fit(data(), targets, batch_size=8, shuffle=False, verbose=0)
    model = _optional_input_model()
    trainer = epl.EPLTrainer(model, "mse", keras.optimizers.SGD(0.1), config=DP2)
    batch_size = None if given == "generator_none" else 8
    trainer.fit(data(), targets, batch_size=batch_size, shuffle=False, verbose=0)
    assert _weights_differ(model, reference) < ATOL
    if given == "none":  # the model is called with o=None, not with zeros or ones
        expected = reference.predict({"x": x, "o": None}, verbose=0)
        np.testing.assert_allclose(trainer.predict({"x": x, "o": None}, verbose=0), expected,
                                   atol=ATOL)  # fmt: skip


def test_none_for_a_required_input_is_refused_by_name():
    trainer = epl.EPLTrainer(_optional_input_model(), "mse", "sgd", config=DP2)
    x = np.ones((4, 3), "float32")
    with pytest.raises(ValueError, match=r"missing key\(s\) \['x'\]"):
        trainer.fit({"x": None, "o": x}, np.ones((4, 2)), verbose=0)
