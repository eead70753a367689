"""What `model.compile(...)` gave a model (optimizer, loss, loss_weights, metrics,
steps_per_execution), and the precedence of the trainer's arguments.

`EPLTrainer` takes the optimizer, loss, loss_weights and metrics from `compile` unless
the same argument is passed to it (passed arguments win, then a model_fn's
`ModelSpec`, then compile).
"""

from __future__ import annotations

import math

import keras

from epl_trainer.core.graph import partition


def first_given(*values):
    """The first value that is not None (passed arguments, then model_fn, then compile)."""
    return next((v for v in values if v is not None), None)


def settings(model: keras.Model) -> dict:
    """What `model.compile(...)` was given: optimizer, loss, loss_weights, metrics,
    weighted_metrics, steps_per_execution, jit_compile.

    Empty for a model that was never compiled. Keras keeps the arguments as given in
    `_compile_config` (what `get_compile_config` serialises); `optimizer` and `loss`
    are also public attributes, used when that record is missing. Its `jit_compile` is
    not always the user's: Keras records its "auto" resolved (`user_jit_intent`).
    """
    if not getattr(model, "compiled", False):
        return {}
    record = _compile_record(model)
    settings = {
        "optimizer": record.get("optimizer", getattr(model, "optimizer", None)),
        "loss": record.get("loss", getattr(model, "loss", None)),
        "loss_weights": record.get("loss_weights"),
        "metrics": record.get("metrics"),
        "weighted_metrics": record.get("weighted_metrics"),
        "steps_per_execution": record.get("steps_per_execution"),
        "jit_compile": record.get("jit_compile"),  # as recorded: see user_jit_intent
    }
    settings["optimizer"] = unwrapped_optimizer(settings["optimizer"])
    return {k: v for k, v in settings.items() if v is not None}


def _compile_record(model) -> dict:
    return getattr(getattr(model, "_compile_config", None), "config", None) or {}


def user_jit_intent(model) -> bool | str:
    """The XLA choice the user made in `model.compile`: True or False when they made one,
    "auto" when the model was not compiled or its value is only Keras's "auto" resolved.

    Keras resolves `compile(jit_compile="auto")` (its default) before recording it: False
    with `run_eagerly` or on a CPU-only machine, else True when every layer supports XLA
    (`Trainer._resolve_auto_jit_compile`). `_compile_config` keeps that value, or the
    user's own True/False as passed; `model.jit_compile` holds what Keras runs (a True
    the model cannot compile turned False), so the record is read. Taken at face value,
    the resolved True on a GPU would count as asked for, and split layers, synchronized
    BatchNorm and gradient checkpointing be refused to a user who never asked for XLA.
    So a value equal to what "auto" gives for this model on this machine is "auto"; only
    one it would not give (True on a CPU, False on a GPU) is the user's. On a GPU an
    explicit `compile(jit_compile=True)` reads as "auto" too (Keras keeps nothing that
    tells them apart): `EPLTrainer(jit_compile=True)` insists.
    """
    if not getattr(model, "compiled", False):
        return "auto"
    record = _compile_record(model)
    recorded = record.get("jit_compile")
    if recorded not in (True, False):  # no record (or an unresolved "auto")
        return "auto"
    keras_auto = False if record.get("run_eagerly") else model._resolve_auto_jit_compile()
    return "auto" if recorded == keras_auto else recorded


def compile_for_own_steps(model, optimizer, objectives: dict, passed: tuple) -> None:
    """A model running its own steps (core/engine/user_steps.py) reads `compile()`'s
    settings itself (Keras's `compute_loss`, `compute_metrics`, `self.optimizer`): the
    optimizer, loss and metrics the trainer was given become its `compile()`, as the user
    compiling it with them would. A model compiled by its user, with nothing passed to the
    trainer, keeps its own (a GAN's `compile` may take other arguments).

    Args:
      optimizer: the trainer's; another than the model's counts as given.
      objectives: the resolved loss, metrics, loss_weights and weighted_metrics.
      passed: the trainer's loss, metrics, loss_weights and weighted_metrics arguments
        (None: not given).
    """
    own = unwrapped_optimizer(getattr(model, "optimizer", None)) is optimizer
    if getattr(model, "compiled", False) and own and all(v is None for v in passed):
        return
    model.compile(optimizer=optimizer, **objectives)


def unwrapped_optimizer(optimizer):
    """The optimizer inside a `LossScaleOptimizer` (which compile() wraps around it under
    mixed_float16): the engine scales the loss itself (`mixed_precision_keys`)."""
    inner = getattr(optimizer, "inner_optimizer", None)
    return optimizer if inner is None else inner


def mixed_precision_keys(model, optimizer) -> dict:
    """The `amp.*` keys for a model Keras set up for mixed precision, or {}.

    A model built under `keras.config.set_dtype_policy("mixed_float16")` (or
    "mixed_bfloat16") computes in the low dtype, and `compile` wraps its optimizer in a
    `LossScaleOptimizer` for float16. The engine scales the loss itself (amp.py), so it
    takes over Keras's schedule: start at `initial_scale`, halve on every overflow (the
    step skipped and counted), double after `dynamic_growth_steps` clean steps.
    """
    policy = getattr(getattr(model, "dtype_policy", None), "name", "")
    scaler = optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else None
    if policy not in ("mixed_float16", "mixed_bfloat16") and scaler is None:
        return {}
    dtype = "bfloat16" if policy == "mixed_bfloat16" else "float16"
    keys = {"amp.level": "O1", "amp.dtype": dtype}
    if dtype == "float16":
        initial = scaler.initial_scale if scaler is not None else 2.0**15
        keys.update({
            "amp.loss_scale": "dynamic",
            "amp.initial_scale_power": round(math.log2(initial)),
            "amp.loss_scale_window": scaler.dynamic_growth_steps if scaler is not None else 2000,
            "amp.hysteresis": 1,  # Keras halves at the first overflow
            "amp.min_loss_scale": 2.0**-24,  # Keras has no minimum
        })  # fmt: skip
    return keys


def output_names(model) -> list[str] | None:
    """The output names Keras's `compile` gives `CompileLoss` / `CompileMetrics`: the
    model's `output_names` if it has them, else None."""
    names = getattr(model, "output_names", None)
    return list(names) if names else None


def symbolic_batch(model, element_spec) -> tuple:
    """(x, y, y_pred, sample_weight) as KerasTensors for a batch of `element_spec`, as
    Keras's first `fit` makes them (`Trainer._symbolic_build`): the model's outputs are
    computed symbolically, so nothing runs and no state changes."""
    from keras.src.trainers import data_adapters

    def symbolic(spec):
        if spec is None:
            return None
        return keras.KerasTensor(spec.shape, dtype=spec.dtype.name)

    element = keras.tree.map_structure(symbolic, element_spec)
    x, y, sample_weight = data_adapters.data_adapter_utils.unpack_x_y_sample_weight(element)
    x = partition.with_absent_inputs(partition.optional_input_names(model), x)
    y_pred = keras.src.backend.compute_output_spec(model, x, training=False)
    return x, y, y_pred, sample_weight


def build_keras_compile_metrics(model, batch) -> None:
    """Builds a compiled model's own `CompileMetrics` from the data's symbolic `batch`
    (`symbolic_batch`), as Keras's first `fit` does, without running or training
    anything.

    The trainer computes the metrics with its own objects; Keras's callbacks that pick
    a direction for a monitored metric (`EarlyStopping`, `ReduceLROnPlateau`,
    `ModelCheckpoint`, mode "auto") look it up in `model.metrics`, which lists Keras's
    compiled metrics only once they are built.
    """
    compile_metrics = getattr(model, "_compile_metrics", None)
    if not getattr(model, "compiled", False) or compile_metrics is None:
        return
    if compile_metrics.built or not model.built:
        return
    x, y, y_pred, sample_weight = batch
    keras.src.backend.compute_output_spec(
        model.compute_metrics, x, y, y_pred, sample_weight=sample_weight
    )
