"""The optimizer's moving average of the weights (`use_ema=True`) in the engine.

Each lane's copy of the user's optimizer keeps the average of the lane's own variables
(Keras updates it in `apply`), so the averages live where the weights live. They are
slots of those copies ("average", made by `add_variable_from_reference`), so the user's
optimizer (the "master", `model.optimizer`) gets them with the rest of the optimizer
state at every write-back and gives them back at every load (update/master_state.py):
Keras's `SwapEMAWeights`, which swaps the model's variables with
`model.optimizer._model_variables_moving_average`, `model.save` and a later Keras `fit`
see the lanes' averages. `to_master` / `from_master` copy the averages alone (the
trainer's callback hooks call them after the write-back and the load, which already
carry them).

Where lanes hold shards of the optimizer state (ZeRO), the averages are sharded too and
the lanes' full weights are gathered from the shards after each update; averaging them
is not built: `rules.check_ema` refuses the combination by name.
"""

from __future__ import annotations


def uses_ema(optimizer) -> bool:
    return bool(getattr(optimizer, "use_ema", False))


def _averages(update, state) -> dict[int, list]:
    """{trainable index: [the EMA variable of each local lane's copy]}."""
    index_of = {id(v): i for lane_vars in state.trainable for i, v in enumerate(lane_vars)}
    averages: dict[int, list] = {}
    for _, optimizer, variables in update.local_optimizers():
        if not uses_ema(optimizer):
            continue
        for variable in variables:
            position = optimizer._get_variable_index(variable)
            average = optimizer._model_variables_moving_average[position]
            averages.setdefault(index_of[id(variable)], []).append(average)
    return averages


def finalize(update) -> None:
    """Every lane's weights become their moving average (Keras's
    `finalize_variable_values`, which `Model.fit` calls after the last epoch)."""
    for _, optimizer, variables in update.local_optimizers():
        if uses_ema(optimizer):
            optimizer.finalize_variable_values(variables)


def _master_averages(master, model_trainable: list) -> list:
    if not master.built:
        master.build(model_trainable)
    return [
        master._model_variables_moving_average[master._get_variable_index(v)]
        for v in model_trainable
    ]


def to_master(update, state, master) -> None:
    """The master optimizer's averages := the first local lane's (built if needed)."""
    targets = _master_averages(master, state.model_trainable)
    for i, averages in _averages(update, state).items():
        targets[i].assign(averages[0].value)


def from_master(update, state, master) -> None:
    """Every lane's averages := the master optimizer's (after a callback swapped them)."""
    sources = _master_averages(master, state.model_trainable)
    for i, averages in _averages(update, state).items():
        for average in averages:
            average.assign(sources[i].value)
