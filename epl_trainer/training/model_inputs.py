"""How the data's features meet the model's inputs, as Keras matches them.

- Python generators and `keras.utils.PyDataset`s are read by Keras's own data adapters
  into a `tf.data.Dataset` of their batches (`python_source_dataset`), as `Model.fit`
  reads them; from there they are batches like any Dataset's.
- A dict of features given to a model whose inputs are a list is matched to the inputs
  by name (Keras's Functional does it at call time; the engine splits the batch before
  the call, so the dataset's elements are put in the model's order once, here).
- None for an optional input (`keras.Input(..., optional=True)`): tf.data holds no
  None, so the feature is left out of the data (`without_absent_inputs` for arrays;
  Keras's generator adapter writes an empty `tf.experimental.Optional`, dropped here)
  and the model is called with None for it (`partition.whole_model`).
- `check_element_spec`: the features' structure and shapes against the model's inputs,
  before anything is traced.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import keras
import tensorflow as tf
from keras import tree

from epl_trainer.core.engine import step_batch
from epl_trainer.core.graph.partition import optional_input_names


def python_source_dataset(x, shuffle=False):
    """A generator or `keras.utils.PyDataset` as a Dataset of its batches (read through
    Keras's own adapters); anything else is returned as it is.

    Its batches are then a Dataset's, sharded across workers as one (io.auto_shard: by
    data, tf.data sees no files), so every worker must yield the same batches in the same
    order. A generator is read once: a second epoch finds it exhausted, as in Keras.
    """
    from keras.src.trainers.data_adapters import GeneratorDataAdapter, PyDatasetAdapter

    if isinstance(x, keras.utils.PyDataset):
        return PyDatasetAdapter(x, shuffle=bool(shuffle)).get_tf_dataset()
    if inspect.isgenerator(x):
        return GeneratorDataAdapter(x).get_tf_dataset()
    return x


def without_absent_inputs(x):
    """`x` without its None features: a dict's None entries are inputs left out (Keras's
    optional inputs; `check_element_spec` refuses a required one by name). A None
    elsewhere has no name to be matched by: refused by position."""
    if isinstance(x, Mapping):
        x = {key: value for key, value in x.items() if value is not None}
    missing = [i for i, a in enumerate(tree.flatten(x)) if a is None]
    if missing:
        raise ValueError(
            f"x holds None for input(s) at flat position(s) {missing}: such an input is "
            "not optional. Only a model's optional inputs (keras.Input(optional=True)) may "
            "be None, given by name in a dict."
        )
    return x


def arrays_for_model(model, x):
    """Numpy features as the model takes them: None entries left out, a dict in the
    order of a list-input model's inputs. Datasets (and a model not built yet, which
    is built from these features) are returned as they are."""
    if x is None or isinstance(x, tf.data.Dataset):
        return x
    x = without_absent_inputs(x)
    ordered = _in_input_order(_model_inputs(model), x)
    return x if ordered is None else ordered


def fitted_to_model(dataset: tf.data.Dataset, model, with_labels: bool) -> tf.data.Dataset:
    """`dataset` with its features as the model takes them (absent optional inputs left
    out, a dict put in the order of a model's list of inputs), checked against the
    model's inputs (`check_element_spec`)."""
    features = _features(dataset.element_spec, with_labels)
    if features is not None:
        present = _present_features(features)
        if present is not features:
            dataset = _map_features(dataset, with_labels, _present_features)
        ordered = _in_input_order(_model_inputs(model), present)
        if ordered is not None:
            dataset = _map_features(
                dataset, with_labels, lambda f: _in_input_order(_model_inputs(model), f)
            )
    check_element_spec(dataset.element_spec, model, with_labels)
    return dataset


def _features(element_spec, with_labels: bool):
    if not with_labels:
        return element_spec
    if isinstance(element_spec, tuple) and len(element_spec) in (2, 3):
        return element_spec[0]
    return None  # the step's own check names the wrong structure


def _map_features(dataset, with_labels: bool, fn):
    if with_labels:
        return dataset.map(lambda x, *rest: (fn(x), *rest))
    if isinstance(dataset.element_spec, tuple):
        return dataset.map(lambda *x: fn(tuple(x)))
    return dataset.map(fn)


def _present_features(features):
    """A features dict without its empty Optional entries (a None a generator yielded)."""
    if not isinstance(features, Mapping):
        return features
    kept = {
        k: v
        for k, v in features.items()
        if not isinstance(v, (tf.OptionalSpec, tf.experimental.Optional))
    }
    return features if len(kept) == len(features) else kept


def _model_inputs(model):
    try:
        return model.input
    except (AttributeError, ValueError):
        return None  # not built, or subclassed: Keras matches nothing either


def _in_input_order(expected, features):
    """A dict of features as the list (or single tensor) of inputs the model takes,
    matched by input name; None when there is nothing to reorder."""
    if expected is None or isinstance(expected, Mapping) or not isinstance(features, Mapping):
        return None
    inputs = tree.flatten(expected)
    names = [getattr(t, "name", None) for t in inputs]
    if None in names or not set(names) <= set(features):
        return None  # check_element_spec names what is missing
    ordered = tuple(features[name] for name in names)
    return ordered if tree.is_nested(expected) else ordered[0]


def check_element_spec(element_spec, model, with_labels: bool) -> None:
    """Checks a dataset's features against the model's inputs before anything is traced.

    Compares the structure (dict keys, number of inputs), the rank and every known
    non-batch dimension, so a mismatched dataset fails with one error that shows both
    sides instead of a shape error deep inside a compiled step. Models whose inputs are
    not known yet (subclassed, never called) are not checked.
    """
    # The step's own check, made here first: (x, y) or (x, y, sample_weight) to train.
    features = step_batch.unpack_element(element_spec)[0] if with_labels else element_spec
    expected = _model_inputs(model)
    if expected is None:
        return
    wanted = tree.map_structure(lambda t: tuple(t.shape), expected)
    given = tree.map_structure(lambda s: getattr(s, "shape", None), features)

    def fail(why: str):
        raise ValueError(
            f"The dataset's features do not match the model's inputs: {why}. "
            f"Model inputs: {wanted}; dataset features: {given}"
        )

    if isinstance(expected, Mapping):
        if not isinstance(features, Mapping):
            fail(f"the model takes a dict with keys {sorted(expected)}")
        missing = sorted(set(expected) - set(features) - set(optional_input_names(model)))
        if missing:
            fail(f"missing key(s) {missing}")
        pairs = [(repr(key), expected[key], features[key]) for key in expected if key in features]
    else:
        inputs, specs = tree.flatten(expected), tree.flatten(features)
        if len(inputs) != len(specs):
            fail(f"the model has {len(inputs)} input(s), the dataset gives {len(specs)} tensor(s)")
        pairs = [(str(i), kt, spec) for i, (kt, spec) in enumerate(zip(inputs, specs))]
    for name, keras_tensor, spec in pairs:
        shape = getattr(spec, "shape", None)
        if shape is None or shape.rank is None:
            continue
        want = tuple(keras_tensor.shape)
        dims_differ = any(
            w is not None and g is not None and w != g
            for w, g in zip(want[1:], shape.as_list()[1:])
        )
        if shape.rank != len(want) or dims_differ:
            fail(f"input {name} expects shape {want}, the dataset gives {tuple(shape.as_list())}")
