"""What `model.compile(...)` gave a model (optimizer, loss, loss_weights, metrics,
steps_per_execution), and the precedence of the trainer's arguments.

`EPLTrainer` takes the optimizer, loss, loss_weights and metrics from `compile` unless
the same argument is passed to it (passed arguments win, then a model_fn's
`ModelSpec`, then compile).
"""

from __future__ import annotations

import keras


def first_given(*values):
    """The first value that is not None (passed arguments, then model_fn, then compile)."""
    return next((v for v in values if v is not None), None)


def settings(model: keras.Model) -> dict:
    """What `model.compile(...)` was given: optimizer, loss, loss_weights, metrics,
    weighted_metrics.

    Empty for a model that was never compiled. Keras keeps the arguments as given in
    `_compile_config` (what `get_compile_config` serialises); `optimizer` and `loss`
    are also public attributes, used when that record is missing.
    """
    if not getattr(model, "compiled", False):
        return {}
    record = getattr(getattr(model, "_compile_config", None), "config", None) or {}
    settings = {
        "optimizer": record.get("optimizer", getattr(model, "optimizer", None)),
        "loss": record.get("loss", getattr(model, "loss", None)),
        "loss_weights": record.get("loss_weights"),
        "metrics": record.get("metrics"),
        "weighted_metrics": record.get("weighted_metrics"),
        "steps_per_execution": record.get("steps_per_execution"),
        "jit_compile": record.get("jit_compile"),
    }
    inner = getattr(settings["optimizer"], "inner_optimizer", None)
    if inner is not None:
        # compile() wraps the optimizer in a LossScaleOptimizer under mixed_float16; the
        # engine scales the loss itself (amp.*), so it drives the inner optimizer.
        settings["optimizer"] = inner
    return {k: v for k, v in settings.items() if v is not None}


def output_names(model) -> list[str]:
    names = getattr(model, "output_names", None)
    return list(names) if names else ["output"]
