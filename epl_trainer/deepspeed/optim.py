"""DeepSpeed `optimizer` and `scheduler` sections -> descriptions of a Keras optimizer
and schedule (`OptimizerSpec`, `ScheduleSpec`; `training/deepspeed_run.py` builds them).

Each DeepSpeed optimizer type maps to the Keras optimizer with the same update rule;
`params` use PyTorch's names (`lr`, `betas`, `eps`, `weight_decay`) and DeepSpeed's
defaults. Known differences, all inherent to the Keras optimizers:

- Adam/AdamW/Lamb: Keras adds `epsilon` to sqrt(v) before bias correction
  (the "epsilon hat" of the Adam paper), PyTorch after; they differ by a factor
  sqrt(1 - beta_2**t) on epsilon only.
- Lamb: DeepSpeed's FusedLamb clamps the trust ratio to [min_coeff, max_coeff] and puts
  weight decay inside the trust ratio; Keras's Lamb does neither, so Lamb becomes
  `FusedLamb` (Keras's Lamb with both, `training/update_rules.py`).
- Adagrad: Keras adds epsilon inside the square root, PyTorch outside.
- SGD with momentum: Keras folds the learning rate into the velocity, PyTorch applies it
  after; identical while the learning rate is constant.

PyTorch's coupled (L2) weight decay - `Adam` with `adam_w_mode: false`, `SGD`,
`Adagrad` - adds wd * w to each gradient: the Keras class wrapped by
`update_rules.with_l2`. Keras's own `weight_decay` is decoupled (AdamW-style: w -= lr *
wd * w before the update), which is what DeepSpeed's AdamW, Lion and `Adam` (default
`adam_w_mode: true`) do. Pure Python: "auto" values come from a `TrainerOptimizer`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from epl_trainer.deepspeed.keys import (
    DeepSpeedConfigError,
    as_bool,
    as_float,
    as_int,
    as_str,
    check_keys,
    is_auto,
    unsupported,
)
from epl_trainer.deepspeed.setup import OptimizerSpec, ScheduleSpec, TrainerOptimizer

# type (lower case) -> DeepSpeed's default params (the Keras class: _TYPE_KWARGS).
_ADAM_DEFAULTS = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
_OPTIMIZERS: dict[str, dict[str, Any]] = {
    "adam": _ADAM_DEFAULTS,
    "adamw": _ADAM_DEFAULTS,
    "adagrad": {"lr": 1e-2, "eps": 1e-10, "weight_decay": 0.0},
    "lamb": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8},
    "lion": {"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.0},
    "sgd": {"lr": None, "momentum": 0.0, "nesterov": False, "weight_decay": 0.0},
}
# Extra params each type accepts, beyond its defaults table.
_EXTRA_PARAMS = {
    "adam": {"adam_w_mode", "amsgrad", "bias_correction", "torch_adam"},
    "adamw": {"amsgrad", "bias_correction", "torch_adam"},
    "adagrad": {"lr_decay", "initial_accumulator_value"},
    "lamb": {"bias_correction", "weight_decay", "max_coeff", "min_coeff"},
    "lion": set(),
    "sgd": {"dampening"},
}
_KNOWN_UNSUPPORTED = {
    "onebitadam": "1-bit Adam compresses communication with CUDA kernels",
    "zerooneadam": "0/1 Adam compresses communication with CUDA kernels",
    "onebitlamb": "1-bit LAMB compresses communication with CUDA kernels",
    "muadam": "muP optimizers need mup's parameter shapes",
    "muadamw": "muP optimizers need mup's parameter shapes",
    "musgd": "muP optimizers need mup's parameter shapes",
}

SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


def trainer_value(trainer: TrainerOptimizer, name: str, where: str):
    """A value of the trainer's own optimizer, the source of "auto" (as HF's TrainingArguments)."""
    if name == "lr":
        if trainer.learning_rate is None:
            raise DeepSpeedConfigError(
                f"DeepSpeed config {where}='auto' takes the learning rate of the trainer's "
                "optimizer, which is a schedule; give a number in the config, or an optimizer "
                f"with a constant learning rate. Received: {trainer.schedule}"
            )
        return trainer.learning_rate
    if name == "betas":
        return trainer.betas
    if name == "eps":
        return trainer.epsilon
    if name == "weight_decay":
        return trainer.weight_decay
    if name == "momentum":
        return trainer.momentum
    return None


def build_optimizer(section: Mapping, trainer: TrainerOptimizer) -> tuple[OptimizerSpec, float]:
    """The Keras optimizer for DeepSpeed's `optimizer` section, and its learning rate.

    "auto" params come from `trainer` (the `optimizer=` given to the trainer); params it
    lacks (e.g. betas of an SGD) take DeepSpeed's defaults.
    """
    check_keys(section, {"type", "params"}, "'optimizer'")
    name = as_str(section.get("type"), "optimizer.type")
    kind = name.lower()
    if kind in _KNOWN_UNSUPPORTED:
        raise unsupported("optimizer.type", name, _KNOWN_UNSUPPORTED[kind])
    if kind not in _OPTIMIZERS:
        raise DeepSpeedConfigError(
            "DeepSpeed config optimizer.type must be one of Adam, AdamW, Adagrad, Lamb, Lion, "
            f"SGD (case-insensitive). Received: {name!r}"
        )
    defaults = _OPTIMIZERS[kind]
    given = section.get("params") or {}
    check_keys(given, set(defaults) | _EXTRA_PARAMS[kind], "'optimizer.params'")
    params = dict(defaults)
    for key, value in given.items():
        where = f"optimizer.params.{key}"
        if is_auto(value):
            value = trainer_value(trainer, key, where)
            if value is None:
                value = defaults.get(key)
            if value is None:
                raise DeepSpeedConfigError(
                    f"DeepSpeed config {where}='auto' has no value: the trainer's optimizer "
                    f"({trainer.name}) has none and DeepSpeed has no default."
                )
        params[key] = value
    if params["lr"] is None:
        raise DeepSpeedConfigError(f"DeepSpeed config optimizer.params.lr is required for {name}.")
    lr = as_float(params["lr"], "optimizer.params.lr", minimum=0.0)
    kwargs: dict[str, Any] = {"learning_rate": lr}
    if "betas" in params:
        betas = params["betas"]
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise DeepSpeedConfigError(
                "DeepSpeed config optimizer.params.betas must be [beta1, beta2]. "
                f"Received: {betas!r}"
            )
        kwargs["beta_1"] = as_float(betas[0], "optimizer.params.betas[0]", minimum=0.0)
        kwargs["beta_2"] = as_float(betas[1], "optimizer.params.betas[1]", minimum=0.0)
    if "eps" in params:
        kwargs["epsilon"] = as_float(params["eps"], "optimizer.params.eps", minimum=0.0)
    weight_decay = as_float(
        params.get("weight_decay", 0.0), "optimizer.params.weight_decay", minimum=0.0
    )
    rule, l2_weight_decay = _TYPE_KWARGS[kind](kind, params, weight_decay, kwargs)
    if rule in ("AdamW", "Lion"):
        # Decoupled weight decay; Keras's AdamW defaults to 0.004, DeepSpeed to 0.
        kwargs["weight_decay"] = weight_decay
    return OptimizerSpec(rule, kwargs, l2_weight_decay=l2_weight_decay), lr


def _param(params: Mapping, key: str, convert, default):
    return convert(params.get(key, default), f"optimizer.params.{key}")


def _adam_kwargs(kind: str, params: Mapping, weight_decay: float, kwargs: dict):
    if not _param(params, "bias_correction", as_bool, True):
        raise unsupported("optimizer.params.bias_correction", False, "Keras Adam always corrects")
    _param(params, "torch_adam", as_bool, False)  # picks DeepSpeed's kernel only
    kwargs["amsgrad"] = _param(params, "amsgrad", as_bool, False)
    if kind == "adam" and not _param(params, "adam_w_mode", as_bool, True):
        return "Adam", weight_decay  # coupled (L2)
    return "AdamW", 0.0


def _adagrad_kwargs(kind: str, params: Mapping, weight_decay: float, kwargs: dict):
    if _param(params, "lr_decay", as_float, 0.0):
        raise unsupported("optimizer.params.lr_decay", params["lr_decay"], "use a scheduler")
    kwargs["initial_accumulator_value"] = _param(params, "initial_accumulator_value", as_float, 0.0)
    return "Adagrad", weight_decay  # coupled (L2)


def _lamb_kwargs(kind: str, params: Mapping, weight_decay: float, kwargs: dict):
    min_coeff = _param(params, "min_coeff", as_float, 0.01)
    max_coeff = _param(params, "max_coeff", as_float, 10.0)
    if not 0.0 <= min_coeff <= max_coeff:
        raise DeepSpeedConfigError(
            "DeepSpeed config optimizer.params.max_coeff must be >= min_coeff >= 0. "
            f"Received: min_coeff={min_coeff}, max_coeff={max_coeff}"
        )
    if not _param(params, "bias_correction", as_bool, True):
        raise unsupported("optimizer.params.bias_correction", False, "Keras Lamb always corrects")
    kwargs.update(lamb_weight_decay=weight_decay, min_coeff=min_coeff, max_coeff=max_coeff)
    return "FusedLamb", 0.0


def _lion_kwargs(kind: str, params: Mapping, weight_decay: float, kwargs: dict):
    return "Lion", 0.0


def _sgd_kwargs(kind: str, params: Mapping, weight_decay: float, kwargs: dict):
    if _param(params, "dampening", as_float, 0.0):
        why = "Keras SGD has no dampening"
        raise unsupported("optimizer.params.dampening", params["dampening"], why)
    kwargs["momentum"] = as_float(params["momentum"], "optimizer.params.momentum", minimum=0.0)
    kwargs["nesterov"] = _param(params, "nesterov", as_bool, False)
    return "SGD", weight_decay  # coupled (L2)


# Per-type params -> Keras keyword arguments; each returns (the Keras class's name, the
# coupled L2 weight decay).
_TYPE_KWARGS = {
    "adam": _adam_kwargs,
    "adamw": _adam_kwargs,
    "adagrad": _adagrad_kwargs,
    "lamb": _lamb_kwargs,
    "lion": _lion_kwargs,
    "sgd": _sgd_kwargs,
}


# ---- scheduler ---------------------------------------------------------------------------

_SCHEDULER_PARAMS = {
    "WarmupLR": {
        "warmup_min_lr",
        "warmup_max_lr",
        "warmup_num_steps",
        "warmup_type",
        "last_batch_iteration",
    },
    "WarmupDecayLR": {
        "total_num_steps",
        "warmup_min_lr",
        "warmup_max_lr",
        "warmup_num_steps",
        "warmup_type",
        "last_batch_iteration",
    },
    "WarmupCosineLR": {
        "total_num_steps",
        "warmup_min_ratio",
        "warmup_num_steps",
        "cos_min_ratio",
        "warmup_type",
        "last_batch_iteration",
    },
    "OneCycle": {
        "cycle_min_lr",
        "cycle_max_lr",
        "decay_lr_rate",
        "cycle_first_step_size",
        "cycle_second_step_size",
        "cycle_first_stair_count",
        "cycle_second_stair_count",
        "decay_step_size",
        "cycle_momentum",
        "cycle_min_mom",
        "cycle_max_mom",
        "decay_mom_rate",
        "last_batch_iteration",
    },
    "LRRangeTest": {
        "lr_range_test_min_lr",
        "lr_range_test_step_size",
        "lr_range_test_step_rate",
        "lr_range_test_staircase",
        "last_batch_iteration",
    },
}
# Params without a default in DeepSpeed's schedulers.
_REQUIRED_PARAMS = {
    "WarmupDecayLR": ("total_num_steps",),
    "WarmupCosineLR": ("total_num_steps",),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr"),
}
_INT_PARAMS = {
    "warmup_num_steps",
    "total_num_steps",
    "cycle_first_step_size",
    "cycle_second_step_size",
    "decay_step_size",
    "lr_range_test_step_size",
}


def _auto_scheduler_value(
    key: str, rate: Callable[[], float], warmup_num_steps: int, total_num_steps: int | None
):
    """Hugging Face's fill-ins: warmup from 0 to the optimizer's lr over the warmup steps."""
    if key == "warmup_min_lr":
        return 0.0
    if key == "warmup_max_lr":
        return rate()
    if key == "warmup_num_steps":
        return warmup_num_steps
    if key == "total_num_steps":
        if total_num_steps is None:
            raise DeepSpeedConfigError(
                "DeepSpeed config scheduler.params.total_num_steps='auto' needs the training "
                "length: pass DeepSpeedConfig(..., total_num_steps=N)."
            )
        return total_num_steps
    raise DeepSpeedConfigError(
        f"DeepSpeed config scheduler.params.{key}='auto' is not filled in by the trainer "
        "(only warmup_min_lr, warmup_max_lr, warmup_num_steps, total_num_steps are); give a value."
    )


def build_schedule(
    section: Mapping,
    learning_rate: float | Callable[[], float],
    *,
    warmup_num_steps: int = 0,
    total_num_steps: int | None = None,
) -> ScheduleSpec:
    """The schedule of DeepSpeed's `scheduler` section, for an optimizer at `learning_rate`.

    `learning_rate` may be a function giving it (the trainer's optimizer, which raises
    when its rate is a Keras schedule): it is called only when the section needs the
    rate, an "auto" `warmup_max_lr` or `WarmupCosineLR` (a ratio of it).
    """

    def rate() -> float:
        return learning_rate() if callable(learning_rate) else learning_rate

    check_keys(section, {"type", "params"}, "'scheduler'")
    name = as_str(section.get("type"), "scheduler.type", choices=SCHEDULERS)
    given = section.get("params") or {}
    check_keys(given, _SCHEDULER_PARAMS[name], f"'scheduler.params' ({name})")
    params = {}
    for key, value in given.items():
        if is_auto(value):
            value = _auto_scheduler_value(key, rate, warmup_num_steps, total_num_steps)
        where = f"scheduler.params.{key}"
        if key in _INT_PARAMS or key.endswith("stair_count"):
            value = None if value is None else as_int(value, where)
        elif key in ("warmup_type",):
            value = as_str(value, where)
        elif key in ("cycle_momentum", "lr_range_test_staircase"):
            value = as_bool(value, where)
        elif key == "last_batch_iteration":
            # Resuming a schedule is the optimizer's `iterations` (restored by checkpoints).
            if as_int(value, where) != -1:
                raise unsupported(
                    where, value, "the schedule follows the optimizer's restored step count"
                )
            continue
        else:
            value = as_float(value, where)
        params[key] = value
    for key in _REQUIRED_PARAMS.get(name, ()):
        if key not in params:
            raise DeepSpeedConfigError(f"DeepSpeed config scheduler {name} needs params.{key}.")
    base_rate = rate() if name == "WarmupCosineLR" or not callable(learning_rate) else None
    return ScheduleSpec(name, params, base_rate)
