"""Every recipe in configs/ loads and is trained for two steps by a named test.

The generic recipes are trained here; each zoo recipe is trained by its zoo's test, which
this file names explicitly (and checks that the test exists and reads that recipe), so a
new recipe without a training test fails `test_every_recipe_has_one_training_test`.
"""

import importlib
import inspect
import json
import pathlib

import keras
import numpy as np
import pytest
from _models import LOSS, mlp, mlp_data

import epl_trainer as epl
from epl_trainer.deepspeed import is_deepspeed_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "configs").glob("*.json"))

TRAINED_HERE = ("dp.json", "ds_zero1_warmup_decay.json", "ds_zero2_offload.json")
# recipe -> (test module, test function, the path or glob the test reads it by)
TRAINED_BY_ZOO_TESTS = {
    "bert_squad_pipeline.json": (
        "test_bert_squad_model",
        "test_recipe_builds_a_two_stage_pipeline_and_trains_two_steps",
        'glob("configs/bert_squad_*.json")',
    ),
    "bert_squad_auto.json": (
        "test_bert_squad_model",
        "test_recipe_builds_a_two_stage_pipeline_and_trains_two_steps",
        'glob("configs/bert_squad_*.json")',
    ),
    "resnet50_dp.json": (
        "test_resnet50",
        "test_every_recipe_runs_two_steps",
        'glob("resnet50_*.json")',
    ),
    "resnet50_split.json": (
        "test_resnet50",
        "test_every_recipe_runs_two_steps",
        'glob("resnet50_*.json")',
    ),
    "moe_t5_split.json": (
        "test_moe_t5",
        "test_recipe_config_runs_two_steps_from_files",
        '"moe_t5_split.json"',
    ),
    "text_classifier_zero1.json": (
        "test_text_classifier",
        "test_recipe_trains_on_tsv_files_end_to_end",
        '"configs/text_classifier_zero1.json"',
    ),
}


def test_every_recipe_has_one_training_test():
    names = {p.name for p in RECIPES}
    registered = set(TRAINED_HERE) | set(TRAINED_BY_ZOO_TESTS)
    assert names == registered, (
        f"recipes without a training test: {sorted(names - registered)}; "
        f"registered but missing: {sorted(registered - names)}"
    )


@pytest.mark.parametrize("recipe", sorted(TRAINED_BY_ZOO_TESTS))
def test_the_zoo_test_named_for_a_recipe_exists_and_reads_it(recipe):
    module_name, function, reference = TRAINED_BY_ZOO_TESTS[recipe]
    module = importlib.import_module(module_name)
    test = getattr(module, function)  # AttributeError: the test was renamed or removed
    source = inspect.getsource(module)
    assert reference in source, f"{module_name} no longer reads {recipe} by {reference}"
    parametrized = [m.args for m in getattr(test, "pytestmark", []) if m.name == "parametrize"]
    if "glob" in reference:  # parametrized over the glob's files
        assert parametrized, f"{function} is not parametrized over the recipes"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_loads(path):
    raw = json.loads(path.read_text())
    if is_deepspeed_config(raw):
        epl.DeepSpeedConfig(str(path))
    else:
        epl.Config.load(str(path))


def _deepspeed_recipe(name, tmp_path) -> dict:
    """The recipe as a dict, its monitors writing under tmp_path."""
    raw = json.loads((ROOT / "configs" / name).read_text())
    for monitor in ("tensorboard", "csv_monitor"):
        if monitor in raw:
            raw[monitor]["output_path"] = str(tmp_path)
    return raw


@pytest.mark.parametrize("name", TRAINED_HERE)
def test_generic_recipe_trains_two_steps(name, tmp_path):
    x, y = mlp_data()
    model = mlp()
    if name.startswith("ds_"):
        config = _deepspeed_recipe(name, tmp_path)
        optimizer = keras.optimizers.AdamW(1e-3)  # the "auto" values come from it
    else:
        config, optimizer = str(ROOT / "configs" / name), keras.optimizers.SGD(0.1)
    trainer = epl.EPLTrainer(model, LOSS, optimizer, config=config)
    before = [w.copy() for w in model.get_weights()]
    # ds_zero1 fixes its micro-batch (32 on one device); the others leave it to fit.
    batch = None if name == "ds_zero1_warmup_decay.json" else 16
    history = trainer.fit(
        x, y, batch_size=batch, steps_per_epoch=2, epochs=1, verbose=0, shuffle=False
    )
    assert int(trainer.optimizer.iterations.numpy()) == 2
    assert np.isfinite(history.history["loss"][0])
    assert all(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    expected = {
        "dp.json": ("communication.max_splits", 5),
        "ds_zero1_warmup_decay.json": ("zero.level", "v0"),  # stage 1: optimizer states
        "ds_zero2_offload.json": ("offload.level", "v0"),
    }[name]
    assert trainer.config.to_dict()[expected[0]] == expected[1]
