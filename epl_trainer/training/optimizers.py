"""Copies of a user's Keras optimizer that keep every setting, not only `get_config()`.

The engine runs one optimizer per lane, stage and shard, built from the user's
optimizer. `get_config()` does not hold `exclude_from_weight_decay` (kept in private
attributes by Keras 3), so a copy rebuilt from the config alone decayed the LayerNorm
and bias weights that AdamW was told to leave alone.

Each copy also records, as its slots are made, which variable and slot name every slot
belongs to (core/engine/update/slots.py): Keras optimizers make their per-variable state through
`add_variable_from_reference` (directly or via `add_optimizer_variables`), so recording
there finds the momentum of a variable for any optimizer without knowing its attribute
names. Checkpoints save each slot under its model variable and slot name, which is what
lets them restore into another grouping, sharding or split (checkpoint_content.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import keras

from epl_trainer.core.engine.update import recording_class


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
    rebuilt = recording_class(type(optimizer)).from_config({**optimizer.get_config(), **overrides})
    excluded = [v for v, o in zip(variables, originals) if not optimizer._use_weight_decay(o)]
    rebuilt.exclude_from_weight_decay(var_list=excluded)
    return rebuilt
