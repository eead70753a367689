"""The engine's per-lane, per-stage and per-shard optimizers keep every user setting.

Copies were rebuilt from `get_config()`, which drops `exclude_from_weight_decay`: AdamW
then decayed the LayerNorm and bias weights (0.015 off Keras after 3 steps).
"""

import keras
import pytest
from _models import LOSS, keras_reference, max_weight_difference, parity_data, parity_model

import epl_trainer as epl

ATOL = 1e-5
DECAY = 0.5  # large, so a wrongly decayed weight is far off after 3 steps


def _adamw(model, form):
    optimizer = keras.optimizers.AdamW(0.01, weight_decay=DECAY)
    if form == "var_names":
        optimizer.exclude_from_weight_decay(var_names=["bias", "gamma", "beta"])
    else:
        excluded = [v for v in model.trainable_variables if "norm" in v.path or "bias" in v.path]
        optimizer.exclude_from_weight_decay(var_list=excluded)
    return optimizer


@pytest.mark.parametrize(
    "form, config",
    [
        ("var_names", {"cluster.virtual_devices": 2}),
        ("var_list", {"cluster.virtual_devices": 2}),
        pytest.param(
            "var_list",
            {"cluster.virtual_devices": 2, "zero.level": "v1"},
            marks=pytest.mark.combines("zero_v1+data_parallel"),
        ),
        pytest.param(
            "var_names",
            {"cluster.virtual_devices": 1, "offload.level": "v0"},
            marks=pytest.mark.combines("offload+one_device"),
        ),
    ],
)
def test_adamw_exclusions_reach_every_engine_optimizer(form, config):
    x, y = parity_data()
    reference = parity_model()
    keras_reference(reference, x, y, _adamw(reference, form), batch_size=16, steps=3)
    model = parity_model()
    trainer = epl.EPLTrainer(model, LOSS, _adamw(model, form), config=config)
    trainer.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=3, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < ATOL


def test_adamw_exclusions_in_a_two_stage_pipeline():
    x, y = parity_data()
    reference = parity_model()
    keras_reference(reference, x, y, _adamw(reference, "var_list"), batch_size=16, steps=3)
    model = parity_model()
    trainer = epl.EPLTrainer(
        model,
        LOSS,
        _adamw(model, "var_list"),
        stages={"conv|pool_image|embed|pool_tokens|concat": 0, "hidden|norm|logits": 1},
        config={"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2},
    )
    trainer.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=3, verbose=0, shuffle=False)
    assert trainer.plan.num_taskgraphs == 2
    assert max_weight_difference(reference, model) < ATOL
