"""Checkpoint marks for gradient checkpointing: EPL's `add_to_collection(x, "checkpoints")`.

The user marks tensors (or layer-name regexes) while building the model; the trainer
reads the marks (`get_collection`) and hands them to the engine, which cuts each stage
into segments ending at them (`core/graph/segments.py`).
"""

from __future__ import annotations

import re

import keras

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
    return list(_COLLECTIONS[name])


def clear_collections() -> None:
    """Forgets every checkpoint mark (`epl.init` calls it)."""
    for marks in _COLLECTIONS.values():
        marks.clear()
