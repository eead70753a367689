"""Every recipe in configs/ loads, and has a test that trains with it."""

import json
import pathlib

import pytest

import epl_trainer as epl
from epl_trainer.deepspeed import is_deepspeed_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "configs").glob("*.json"))
TESTS = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))


def test_the_recipes_are_found():
    assert len(RECIPES) >= 7


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_loads_and_is_trained_by_a_test(path):
    raw = json.loads(path.read_text())
    if is_deepspeed_config(raw):
        epl.DeepSpeedConfig(str(path))
    else:
        epl.Config.load(str(path))
    # Every recipe is used by a test that runs two steps with it (zoo and DeepSpeed
    # tests refer to it by name or by its prefix glob, e.g. resnet50_*.json).
    prefix = path.name.split("_")[0]
    assert path.name in TESTS or f'"{prefix}_' in TESTS or f"{prefix}_*" in TESTS, path.name


def test_dp_recipe_trains_two_steps():
    """dp.json has no zoo script of its own (the quickstart takes it by flag)."""
    import keras
    import numpy as np
    from _models import LOSS, mlp, mlp_data

    x, y = mlp_data()
    model = mlp()
    trainer = epl.EPLTrainer(model, LOSS, "sgd", config=str(ROOT / "configs" / "dp.json"))
    before = [w.copy() for w in model.get_weights()]
    history = trainer.fit(x, y, batch_size=16, steps_per_epoch=2, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert trainer.config.communication.max_splits == 5
    assert any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assert isinstance(trainer.optimizer, keras.optimizers.SGD)
