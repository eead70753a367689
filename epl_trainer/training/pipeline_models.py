"""A KerasHub task's preprocessing, applied to fit / evaluate / predict data as Keras does.

KerasHub's tasks (`BertTextClassifier`, `GPT2CausalLM`, ...) subclass KerasHub's
`PipelineModel`, whose `fit`, `evaluate` and `predict` turn `x, y, sample_weight` into a
`tf.data` dataset of batches and then map the model's `preprocess_samples(x, y,
sample_weight)` over each batch (keras_hub `pipeline_model._build_dataset`): the task's
`preprocessor` turns raw strings into the model's real inputs (token ids, padding masks)
and may make labels and sample weights (a causal LM's next tokens, weighted by the padding
mask). EPLTrainer never calls `Model.fit`, so its data paths do the same, through this
module only: `data.as_dataset` and `data.ReshuffledArrays` batch the raw rows (and deal
them to the workers, in a new order each epoch with `shuffle`), then map
`Preprocessing.apply` over the batches, as Keras batches before it preprocesses. Each raw
row becomes one row of model input, so shuffling and dealing raw rows is shuffling and
dealing the preprocessed ones; the batch the engine fills up to split evenly
(`objective.pad_to_multiple`) is the preprocessed one. Mapping per batch, as Keras does,
also keeps random preprocessing (a masked-LM's masks) fresh every epoch.

keras_hub is not imported: any model with a callable `preprocess_samples` preprocesses
its data this way (KerasHub's contract: it "must be free of side effects"), except a
task whose `preprocessor` is None, whose `preprocess_samples` returns its inputs as they
are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import tensorflow as tf


class Preprocessing:
    """A model's `preprocess_samples`, applied to raw inputs and to batched datasets."""

    def __init__(self, preprocess_samples: Callable, model_name: str):
        self.preprocess_samples = preprocess_samples
        self.model_name = model_name

    def raw_arrays(self, inputs):
        """`inputs` with every list made one array, as KerasHub's `tf.data` path slices
        them (`tf.data.Dataset.from_tensor_slices`: tuples and dicts are structure, a list
        of strings is one tensor, not one input per string)."""
        if inputs is None:
            return None
        if isinstance(inputs, tuple):
            return tuple(self.raw_arrays(part) for part in inputs)
        if isinstance(inputs, Mapping):
            return {key: self.raw_arrays(value) for key, value in inputs.items()}
        if isinstance(inputs, (str, bytes)) or np.ndim(inputs) == 0:
            raise ValueError(
                f"Model {self.model_name!r} preprocesses batches of samples: x, y and "
                "sample_weight need a batch dimension (wrap a single sample in a list). "
                f"Received: {inputs!r}"
            )
        return inputs if isinstance(inputs, np.ndarray) else np.asarray(inputs)

    def apply(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """Maps `preprocess_samples` over a dataset of batches: an element `(x, y)` or
        `(x, y, sample_weight)` is passed as those arguments, anything else as `x`
        (tf.data unpacks a tuple element into arguments, as in Keras's `ds.map`)."""
        return dataset.map(self.preprocess_samples, num_parallel_calls=tf.data.AUTOTUNE)


def preprocessing(model) -> Preprocessing | None:
    """The model's preprocessing as KerasHub's `PipelineModel` applies it, or None for a
    model that takes its data as it is."""
    preprocess_samples = getattr(model, "preprocess_samples", None)
    if not callable(preprocess_samples):
        return None
    if hasattr(model, "preprocessor") and model.preprocessor is None:
        return None  # a task without a preprocessor passes its data through unchanged
    return Preprocessing(preprocess_samples, getattr(model, "name", type(model).__name__))
