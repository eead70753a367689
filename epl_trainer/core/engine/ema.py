"""The optimizer's moving average of the weights (`use_ema=True`) in the engine.

Each lane's copy of the user's optimizer keeps the average of the lane's own variables
(Keras updates it in `apply`), so the averages live where the weights live. The user's
optimizer (the "master", `model.optimizer`) holds none until the trainer asks for it:
Keras's `SwapEMAWeights` swaps the model's variables with
`model.optimizer._model_variables_moving_average`, so the trainer copies the lanes'
averages there before such a callback runs and takes them back after it
(`to_master` / `from_master`), as it does with the weights themselves.

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
