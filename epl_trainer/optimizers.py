"""Copies of a user's Keras optimizer that keep every setting, not only `get_config()`.

The engine runs one optimizer per lane, stage and shard, built from the user's
optimizer. `get_config()` does not hold `exclude_from_weight_decay` (kept in private
attributes by Keras 3), so a copy rebuilt from the config alone decayed the LayerNorm
and bias weights that AdamW was told to leave alone.

Each copy also records, as its slots are made, which variable and slot name every slot
belongs to (`slots_of`): Keras optimizers make their per-variable state through
`add_variable_from_reference` (directly or via `add_optimizer_variables`), so recording
there finds the momentum of a variable for any optimizer without knowing its attribute
names. Checkpoints save each slot under its model variable and slot name, which is what
lets them restore into another grouping, sharding or split (checkpoint_content.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import keras


def rebuild(optimizer: keras.optimizers.Optimizer, **overrides) -> keras.optimizers.Optimizer:
    """`optimizer` rebuilt from its config with `overrides`, for the same variables.

    Weight-decay exclusions carry over as they are (by variable and by name pattern), so
    the copy must be used on the same variables as the original.
    """
    config = {**optimizer.get_config(), **overrides}
    rebuilt = type(optimizer).from_config(config)
    for attribute in ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern"):
        if hasattr(optimizer, attribute):
            setattr(rebuilt, attribute, getattr(optimizer, attribute))
    return rebuilt


def replica(
    optimizer: keras.optimizers.Optimizer,
    variables: Sequence[keras.Variable],
    originals: Sequence[keras.Variable],
    **overrides,
) -> keras.optimizers.Optimizer:
    """An unbuilt copy of `optimizer` for engine-owned `variables`.

    `originals[i]` is the user's variable that `variables[i]` copies (or shards): the
    user's optimizer decides, on the original, whether weight decay applies, and the copy
    excludes exactly those copies.
    """
    rebuilt = _recording(type(optimizer)).from_config({**optimizer.get_config(), **overrides})
    excluded = [v for v, o in zip(variables, originals) if not optimizer._use_weight_decay(o)]
    rebuilt.exclude_from_weight_decay(var_list=excluded)
    return rebuilt


_SLOTS = "_epl_slots"  # set with object.__setattr__: Keras must not track the list
_recording_classes: dict[type, type] = {}


def _recording(cls: type) -> type:
    """`cls` with an `add_variable_from_reference` that records (slot, reference, name)."""
    recording = _recording_classes.get(cls)
    if recording is not None:
        return recording

    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        slot = cls.add_variable_from_reference(
            self, reference_variable, name=name, initializer=initializer
        )
        if not hasattr(self, _SLOTS):
            object.__setattr__(self, _SLOTS, [])
        getattr(self, _SLOTS).append((slot, reference_variable, name or "var"))
        return slot

    recording = type(
        cls.__name__, (cls,), {"add_variable_from_reference": add_variable_from_reference}
    )
    recording.__qualname__ = cls.__qualname__
    recording.__module__ = cls.__module__
    _recording_classes[cls] = recording
    return recording


def slots_of(optimizer) -> list[tuple]:
    """[(slot variable, the variable it was made for, slot name)] of an engine replica."""
    return list(getattr(optimizer, _SLOTS, []))


def unrecorded_state(optimizer) -> list:
    """The optimizer's variables that are neither a recorded slot, nor its step counter,
    nor a learning rate: per-variable state a checkpoint could not key by variable."""
    known = {id(slot) for slot, _, _ in slots_of(optimizer)}
    known |= {id(optimizer.iterations), id(optimizer._learning_rate)}
    return [v for v in optimizer.variables if id(v) not in known and v.name != "learning_rate"]
