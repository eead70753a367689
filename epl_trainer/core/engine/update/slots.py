"""Which model variable and slot name each optimizer slot was made for.

Keras optimizers make their per-variable state through `add_variable_from_reference`
(directly or via `add_optimizer_variables`). The engine's replica optimizers are
instances of `recording_class(type(user_optimizer))`, which records each call, so a
checkpoint finds the momentum of a variable for any optimizer without knowing its
attribute names, and saves it under the variable (checkpoint_content.py). State made
otherwise is recorded only for the Keras optimizers FACTORED_STATE lists (Adafactor);
any other is refused by `unrecorded_state`'s caller rather than guessed.
"""

from __future__ import annotations

_SLOTS = "_epl_slots"  # set with object.__setattr__: Keras must not track the list
_PLACEHOLDERS = "_epl_placeholders"
_recording_classes: dict[type, type] = {}

# Keras optimizers that also make per-variable state with `add_variable`, in lists
# aligned with the variables `build` gets: {class: {attribute: slot name}}. Adafactor's
# factored second moments: the row moment (the variable's shape without its last axis)
# and the column moment (without its second last). Keras makes int32 scalar
# placeholders there for variables of fewer than 2 dimensions, which it never reads.
FACTORED_STATE = {"Adafactor": {"_r": "velocity_row", "_c": "velocity_col"}}


def slot_shape(name: str, shape) -> list[int]:
    """The whole shape of slot `name` of a variable of `shape` (factored slots drop an axis)."""
    shape = list(shape)
    if name == "velocity_row":
        return shape[:-1]
    if name == "velocity_col":
        return shape[:-2] + shape[-1:]
    return shape


def is_factored(name: str) -> bool:
    return name in ("velocity_row", "velocity_col")


def _factored_attributes(cls: type) -> dict[str, str]:
    """FACTORED_STATE's entry for `cls` when Keras's class defines its `build` (a subclass
    that changes `build` is not taken on trust: its state is refused, not guessed)."""
    owner = next((c for c in cls.__mro__ if "build" in vars(c)), object)
    if not owner.__module__.startswith("keras"):
        return {}
    return FACTORED_STATE.get(owner.__name__, {})


def factored_attribute(cls: type, name: str) -> str | None:
    """The attribute of `cls` listing factored slot `name` per variable (Adafactor's
    `_r` for "velocity_row"), or None for a slot made per variable by
    `add_variable_from_reference`."""
    if not is_factored(name):
        return None
    found = [a for a, slot in _factored_attributes(cls).items() if slot == name]
    return found[0] if found else None


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

    factored = _factored_attributes(cls)

    def build(self, var_list):
        was_built = self.built
        cls.build(self, var_list)
        if was_built or not factored:
            return
        if not hasattr(self, _SLOTS):
            object.__setattr__(self, _SLOTS, [])
        if not hasattr(self, _PLACEHOLDERS):
            object.__setattr__(self, _PLACEHOLDERS, [])
        for attribute, name in factored.items():
            for variable, slot in zip(var_list, getattr(self, attribute)):
                if slot is None:  # a variable the gradient overwrites: no state
                    continue
                if len(variable.shape) < 2:
                    getattr(self, _PLACEHOLDERS).append(slot)
                else:
                    getattr(self, _SLOTS).append((slot, variable, name))

    methods = {"add_variable_from_reference": add_variable_from_reference}
    if factored:
        methods["build"] = build
    recording = type(cls.__name__, (cls,), methods)
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
    known |= {id(v) for v in getattr(optimizer, _PLACEHOLDERS, [])}
    known |= {id(optimizer.iterations), id(optimizer._learning_rate)}
    return [v for v in optimizer.variables if id(v) not in known and v.name != "learning_rate"]
