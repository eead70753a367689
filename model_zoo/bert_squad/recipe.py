"""The recipe of `python -m model_zoo.bert_squad`: its default EPL config and BERT's
optimizer (kept apart from its flags so tests can import them without absl flags)."""

from __future__ import annotations

import os

import keras

from epl_trainer.training.schedules import WarmupDecayLR

# Without --epl_config a pipeline's run is configs/bert_squad_pipeline.json (a test keeps
# these equal); without stages, micro-batches would only cut each lane's step into parts.
# They are environment defaults, the config's lowest-precedence source, so --epl_set and
# epl-launch's device count still override them; a recipe given with --epl_config
# replaces them, except the 2 simulated devices (as in the quickstart).
DEFAULT_CONFIG = {"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 4}
DATA_PARALLEL_CONFIG = {"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 1}


def default_num_stages(
    onednn: bool, one_process: bool, recipe_given: bool = False
) -> tuple[int, str]:
    """The stage count when `--num_stages` is not given, and why (printed by the run).
    A recipe given with `--epl_config` (micro-batches, a pipeline strategy) keeps the
    scopes' 2 stages it was written for.

    Measured with `python bench/threads.py` (the main job's model on 2 simulated devices
    and 2 cores; ms per step inside the step's calls, medians of 2-3 rounds; the tables
    in docs/benchmarks.md):

    | | oneDNN on | oneDNN off |
    |---|---|---|
    | 2-stage pipeline, 4 micro-batches, plain ops | 12.5 | 16.7 |
    | data parallelism, each lane in XLA, compiled updates | 15.1 | 13.6-14.5 |
    | the same with the default update (plain ops here) | | 14.7 |
    | Keras `fit`, one device, XLA | 13.3 | 13.3-13.4 |

    Without oneDNN, TensorFlow's own kernels make the pipeline's plain ops slow, and
    "auto" compiles each data-parallel lane whole. Lanes compile whole only in one process
    (jit_choice.py), so several workers keep the pipeline.
    """
    if recipe_given:
        return 2, "--epl_config given: the 2 stages of the scopes it was written for"
    if onednn:
        return 2, "oneDNN's kernels are on: a 2-stage pipeline is fastest here"
    if not one_process:
        return 2, "oneDNN is off, but with several workers a lane does not compile whole"
    return 1, "oneDNN is off: data parallelism with each lane in XLA is fastest here"


def environ_with_defaults(epl_config: str | None, environ=None, num_stages: int = 2) -> dict:
    """`environ` (default `os.environ`) plus the run's defaults where it has none: a
    pipeline's (`num_stages` > 1) or data parallelism's."""
    environ = dict(os.environ if environ is None else environ)
    recipe = DEFAULT_CONFIG if num_stages > 1 else DATA_PARALLEL_CONFIG
    defaults = recipe if not epl_config else {"cluster.virtual_devices": 2}
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
