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
