"""The optimizer's moving average of the weights (`use_ema=True`) in the engine.

Each lane's copy of the user's optimizer keeps the average of the lane's own variables
(Keras updates it in `apply`), so the averages live where the weights live. They are
slots of those copies ("average", made by `add_variable_from_reference`), so the user's
optimizer (the "master", `model.optimizer`) gets them with the rest of the optimizer
state at every write-back and gives them back at every load (update/master_state.py):
Keras's `SwapEMAWeights`, which swaps the model's variables with
`model.optimizer._model_variables_moving_average`, `model.save` and a later Keras `fit`
see the lanes' averages.

Where lanes hold shards of the optimizer state (ZeRO), the averages are sharded too and
the lanes' full weights are gathered from the shards after each update; averaging them
is not built: `rules.check_ema` refuses the combination by name.
"""

from __future__ import annotations


def uses_ema(optimizer) -> bool:
    return bool(getattr(optimizer, "use_ema", False))


def finalize(update) -> None:
    """Every lane's weights become their moving average (Keras's
    `finalize_variable_values`, which `Model.fit` calls after the last epoch)."""
    for _, optimizer, variables in update.local_optimizers():
        if uses_ema(optimizer):
            optimizer.finalize_variable_values(variables)
