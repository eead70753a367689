"""Checkpoint marks for gradient checkpointing: EPL's `add_to_collection(x, "checkpoints")`.

The user marks tensors (or layer-name regexes) while building the model; the trainer
reads the marks (`get_collection`) and hands them to the engine, which cuts each stage
into segments ending at them (`core/graph/segments.py`).

EPL's documentation marks them with TF1's `tf.add_to_collection("checkpoints", tensor)`
(the name first). Both forms are read: `epl.add_to_collection("checkpoints", x)`, and
`tf.compat.v1.add_to_collection("checkpoints", x)`, whose marks land in TensorFlow's
default graph (before, the first was refused naming the KerasTensor as a collection, and
the second was ignored: every stage trained as one recomputed segment).
"""

from __future__ import annotations

import re

import keras
import tensorflow as tf

COLLECTION = "checkpoints"
_COLLECTIONS: dict[str, list] = {COLLECTION: []}


def add_to_collection(value, name: str = COLLECTION) -> None:
    """Marks a checkpoint for `gradient_checkpoint.type="collection"`.

    Args:
      value: a KerasTensor made while building a functional model (kept for backward;
        the nodes after it up to the next checkpoint are recomputed), or a str regex
        matched with `re.fullmatch` against layer names (each call's output of a
        matching layer becomes a checkpoint).
      name: the collection; only "checkpoints" has a meaning.

    Raises:
      ValueError: another collection name, or an invalid regex.
      TypeError: a value that is neither a KerasTensor nor a str.
    """
    if isinstance(value, str) and value == COLLECTION and not isinstance(name, str):
        value, name = name, value  # TF1's order, as EPL documents: ("checkpoints", tensor)
    if name != COLLECTION:
        raise ValueError(
            f"Only the {COLLECTION!r} collection is used (gradient_checkpoint.type="
            f"'collection'). Received: name={name!r}"
        )
    if isinstance(value, str):
        try:
            re.compile(value)
        except re.error as e:
            raise ValueError(f"Invalid layer-name regex for a checkpoint: {value!r} ({e})") from e
    elif not (isinstance(value, keras.KerasTensor) and hasattr(value, "_keras_history")):
        raise TypeError(
            "add_to_collection takes a KerasTensor (the output of a layer while building a "
            "functional model) or a layer-name regex str. Eager tensors have no place in "
            f"the model graph. Received: {type(value).__name__}"
        )
    if not any(v is value for v in _COLLECTIONS[name]):
        _COLLECTIONS[name].append(value)


def get_collection(name: str = COLLECTION) -> list:
    """The KerasTensors and regexes added to `name` so far (a copy)."""
    if name != COLLECTION:
        raise ValueError(f"Only the {COLLECTION!r} collection exists. Received: name={name!r}")
    marks = list(_COLLECTIONS[name])
    for value in _tf1_collection():
        if not any(v is value for v in marks):
            marks.append(value)
    return marks


def _tf1_collection() -> list:
    """Marks added with `tf.compat.v1.add_to_collection("checkpoints", x)` (EPL's form):
    the KerasTensors and regexes in TensorFlow's default graph collection."""
    values = tf.compat.v1.get_collection(COLLECTION)
    return [v for v in values if isinstance(v, str | keras.KerasTensor)]


def clear_collections() -> None:
    """Forgets every checkpoint mark (`epl.init` calls it), TF1-style ones too."""
    for marks in _COLLECTIONS.values():
        marks.clear()
    tf.compat.v1.get_default_graph().clear_collection(COLLECTION)
