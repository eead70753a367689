"""Which model variable and slot name each optimizer slot was made for.

Keras optimizers make their per-variable state through `add_variable_from_reference`
(directly or via `add_optimizer_variables`). The engine's replica optimizers are
instances of `recording_class(type(user_optimizer))`, which records each call, so a
checkpoint finds the momentum of a variable for any optimizer without knowing its
attribute names, and saves it under the variable (checkpoint_content.py).
"""

from __future__ import annotations

_SLOTS = "_epl_slots"  # set with object.__setattr__: Keras must not track the list
_recording_classes: dict[type, type] = {}


def recording_class(cls: type) -> type:
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
