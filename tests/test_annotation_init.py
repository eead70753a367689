"""Annotating a model does not change its initial weights.

Reported: the same model built with `epl.replicate` / `epl.split` scopes started from
different weights (max difference 0.47). Layers take their initializer seeds from
Python's random state when they are constructed, so anything in the annotation path
that drew a random number, or built layers in another order, would shift every seed.
"""

import keras
import numpy as np
import pytest

import epl_trainer as epl

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _layers():
    """Constructed in one fixed order (a, b, c), whatever the annotation."""
    return (
        keras.layers.Dense(16, activation="relu", name="a"),
        keras.layers.Dense(16, activation="relu", name="b"),
        keras.layers.Dense(8, name="c"),
    )


def plain(seed=3):
    keras.utils.set_random_seed(seed)
    a, b, c = _layers()
    inputs = keras.Input((6,), name="x")
    return keras.Model(inputs, c(b(a(inputs))))


def replicate_scopes(seed=3):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,), name="x")
    with epl.replicate(1, name="stage_0"):
        a = keras.layers.Dense(16, activation="relu", name="a")
        h = a(inputs)
    with epl.replicate(1, name="stage_1"):
        b = keras.layers.Dense(16, activation="relu", name="b")
        c = keras.layers.Dense(8, name="c")
        outputs = c(b(h))
    return keras.Model(inputs, outputs)


def split_scope(seed=3):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,), name="x")
    with epl.replicate(2, name="features"):
        a = keras.layers.Dense(16, activation="relu", name="a")
        b = keras.layers.Dense(16, activation="relu", name="b")
        h = b(a(inputs))
    with epl.split(2, name="head"):
        outputs = keras.layers.Dense(8, name="c")(h)
    return keras.Model(inputs, outputs)


def _max_difference(a: keras.Model, b: keras.Model) -> float:
    assert [v.path for v in a.weights] == [v.path for v in b.weights]
    return max(float(np.abs(u - v).max()) for u, v in zip(a.get_weights(), b.get_weights()))


@pytest.mark.parametrize("annotated", [replicate_scopes, split_scope])
def test_scopes_leave_the_initial_weights_unchanged(annotated):
    assert _max_difference(plain(), annotated()) == 0.0


@pytest.mark.parametrize(
    "annotated, config",
    [
        (replicate_scopes, {"cluster.virtual_devices": 2}),
        (split_scope, {"cluster.virtual_devices": 2, "cluster.colocate_split_and_replicate": True}),
    ],
)
def test_the_trainer_starts_from_the_unannotated_weights(annotated, config):
    """Through a model_fn (called after the config is resolved) and in the engine's copies."""
    reference = plain()
    keras.utils.set_random_seed(3)
    trainer = epl.EPLTrainer(lambda: annotated(seed=3), LOSS, config=config)
    assert _max_difference(reference, trainer.model) == 0.0
    x = np.zeros((8, 6), "float32")
    trainer.evaluate(x, np.zeros(8, "int32"), batch_size=8)  # builds the engine state
    trainer.engine.state.write_back()
    assert _max_difference(reference, trainer.model) == 0.0
