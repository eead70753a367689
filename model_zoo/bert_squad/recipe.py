"""The recipe of `python -m model_zoo.bert_squad`: its default EPL config and BERT's
optimizer (kept apart from its flags so tests can import them without absl flags)."""

from __future__ import annotations

import os

import keras

from epl_trainer.training.schedules import WarmupDecayLR

# Without --epl_config the run is configs/bert_squad_pipeline.json (a test keeps these
# equal). They are environment defaults, the config's lowest-precedence source, so
# --epl_set and epl-launch's device count still override them; a recipe given with
# --epl_config replaces them, except the 2 simulated devices (as in the quickstart).
DEFAULT_CONFIG = {"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 4}


def environ_with_defaults(epl_config: str | None, environ=None) -> dict[str, str]:
    """`environ` (default `os.environ`) plus the run's defaults where it has none."""
    environ = dict(os.environ if environ is None else environ)
    defaults = DEFAULT_CONFIG if not epl_config else {"cluster.virtual_devices": 2}
    for key, value in defaults.items():
        environ.setdefault("EPL_" + key.replace(".", "_").upper(), str(value))
    return environ


def bert_optimizer(
    model: keras.Model,
    total_steps: int,
    learning_rate: float,
    weight_decay: float = 0.01,
    warmup_proportion: float = 0.1,
) -> keras.optimizers.AdamW:
    """BERT's optimizer (Google's `optimization.py`): AdamW with epsilon 1e-6 and
    `weight_decay` on every weight but LayerNorm parameters and biases; the learning rate
    rises linearly over the first `warmup_proportion` of the steps to `learning_rate`, then
    falls linearly to 0 at the last step; gradients are clipped at global norm 1.0.

    The exclusions are given as variables: Keras matches `var_names` against a
    variable's short name ("gamma", "bias"), which never holds the layer's "LayerNorm".
    """
    schedule = WarmupDecayLR(
        total_num_steps=total_steps,
        warmup_min_lr=0.0,
        warmup_max_lr=learning_rate,
        warmup_num_steps=int(total_steps * warmup_proportion),
        warmup_type="linear",
    )
    optimizer = keras.optimizers.AdamW(
        schedule, weight_decay=weight_decay, epsilon=1e-6, global_clipnorm=1.0
    )
    optimizer.exclude_from_weight_decay(var_list=no_decay_variables(model))
    return optimizer


def no_decay_variables(model: keras.Model) -> list:
    """BERT's exclusions from weight decay: LayerNorm's gamma and beta, and every bias."""
    return [v for v in model.trainable_variables if "LayerNorm" in v.path or v.name == "bias"]
