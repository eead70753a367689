"""Models given as functions: `model_fn()` and EPL's Estimator-style `model_fn(features,
labels, mode, params)`.

EPL programs are TF1 Estimator programs: the model is a function of the input tensors.
Here the trainer calls such a function with symbolic Keras inputs made from the
dataset's element spec (so it runs at the first `fit` / `evaluate` / `predict`) and
builds a functional Keras model from what it returns.
"""

from __future__ import annotations

import dataclasses
import inspect

import keras
import tensorflow as tf
from keras import tree

# tf.estimator's ModeKeys values, so ported programs can compare against them.
TRAIN, EVAL, INFER = "train", "eval", "infer"


@dataclasses.dataclass
class ModelSpec:
    """What a `model_fn` may return instead of a bare model or outputs.

    Attributes:
      model: a keras.Model, or the output tensor(s) of the symbolic inputs the trainer
        passed (an Estimator-style model_fn), from which the trainer builds the model.
      loss, metrics, loss_weights, optimizer: used where the trainer was given none.
    """

    model: object
    loss: object = None
    metrics: object = None
    optimizer: object = None
    loss_weights: object = None


def is_estimator_model_fn(fn) -> bool:
    """True for `model_fn(features, labels, mode, params)`-style callables."""
    if isinstance(fn, keras.Model) or not callable(fn):
        return False
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) > 0


def call_model_fn(fn) -> ModelSpec:
    """`fn()` as a ModelSpec (a zero-argument model_fn returns a model or a ModelSpec)."""
    return _as_spec(fn(), inputs=None)


def call_estimator_model_fn(fn, element_spec, mode: str, params) -> ModelSpec:
    """Calls `fn(features, labels, mode, params)` on symbolic inputs from `element_spec`.

    `element_spec` is a batched dataset's: `(features, labels)`, `(features, labels,
    sample_weight)` or features alone. Features become `keras.Input`s (dict keys become
    input names); labels are passed as symbolic tensors too, for code that reads their
    shape, but the model's outputs must be computed from the features only.
    """
    features_spec, labels_spec = _split_spec(element_spec)
    features = _symbolic(features_spec, "feature")
    labels = None if labels_spec is None else _symbolic(labels_spec, "label")
    return _as_spec(fn(features, labels, mode, params), inputs=features)


def _split_spec(element_spec):
    if isinstance(element_spec, tuple) and len(element_spec) in (2, 3):
        return element_spec[0], element_spec[1]
    return element_spec, None


def _symbolic(spec, prefix: str):
    """keras.Input for every TensorSpec of a (nested) element spec, batch dim dropped."""
    if isinstance(spec, dict):
        return {name: _input(s, name) for name, s in spec.items()}
    flat = tree.flatten(spec)
    names = [prefix] if len(flat) == 1 else [f"{prefix}_{i}" for i in range(len(flat))]
    return tree.pack_sequence_as(spec, [_input(s, n) for s, n in zip(flat, names)])


def _input(spec: tf.TensorSpec, name: str):
    if not isinstance(spec, tf.TensorSpec):
        raise TypeError(
            "An Estimator-style model_fn needs dense tensor inputs. Received an element "
            f"spec of {type(spec).__name__} for {name!r}"
        )
    return keras.Input(shape=tuple(spec.shape[1:]), dtype=spec.dtype.name, name=name)


def _as_spec(returned, inputs) -> ModelSpec:
    spec = returned if isinstance(returned, ModelSpec) else ModelSpec(model=returned)
    if isinstance(spec.model, keras.Model):
        return spec
    if inputs is None:
        raise TypeError(
            "A model_fn() without arguments must return a keras.Model or an "
            f"epl_trainer.ModelSpec. Received: {type(returned).__name__}"
        )
    try:
        spec.model = keras.Model(inputs, spec.model)
    except (ValueError, TypeError) as e:
        raise TypeError(
            "model_fn(features, labels, mode, params) must return a keras.Model, a "
            "ModelSpec, or output tensors computed from `features`. Could not build a "
            f"model from what it returned ({type(returned).__name__}): {e}"
        ) from e
    return spec
