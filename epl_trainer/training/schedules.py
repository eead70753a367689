"""DeepSpeed's learning-rate schedules as Keras `LearningRateSchedule`s.

Each schedule is DeepSpeed's formula (`deepspeed/runtime/lr_schedules.py`) as a function
of `step`, DeepSpeed's `last_batch_iteration`: `schedule(step)` is the learning rate
DeepSpeed's `get_lr()` returns once its scheduler has been stepped to `step`. A Keras
optimizer evaluates its schedule at `optimizer.iterations`, the number of updates applied
so far, so update `k` (0-based) uses `schedule(k)`. DeepSpeed steps its scheduler after
each update, so its update `k` uses `schedule(k - 1)`: our schedules run one update ahead
of DeepSpeed's (the values are the same, shifted by one step). Like DeepSpeed's scheduler,
which is not stepped on an fp16 overflow, the optimizer's `iterations` does not count
skipped steps.

The formulas are computed with `keras.ops` on the step tensor, so they run inside the
compiled training step. `OneCycleMomentum` and `with_momentum_schedule` add OneCycle's
momentum cycling: `beta_1` of Adam-family optimizers follows the schedule.
"""

from __future__ import annotations

import math

import keras
from keras import ops

_WARMUP_TYPES = ("log", "linear")
_PACKAGE = "epl_trainer"


def _check_positive(name: str, value, *, allow_zero: bool = False) -> None:
    bad = value < 0 if allow_zero else value <= 0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or bad:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a number {bound}. Received: {name}={value!r}")


def _check_warmup_type(warmup_type: str) -> str:
    # DeepSpeed logs a warning and falls back to "log"; a typo should not change the
    # schedule silently.
    if warmup_type not in _WARMUP_TYPES:
        raise ValueError(
            f"warmup_type must be one of {list(_WARMUP_TYPES)}. Received: {warmup_type!r}"
        )
    return warmup_type


def _warmup_gamma(step, warmup_num_steps: int, warmup_type: str):
    """Fraction of the warmup done at `step` (< warmup_num_steps), DeepSpeed's `_get_gamma`."""
    if warmup_type == "log":
        return ops.log(step + 1.0) / math.log(warmup_num_steps)
    return step / float(warmup_num_steps)


def _float_step(step):
    return ops.cast(step, "float32")


class _DeepSpeedSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Shared `get_config`: every constructor argument is an attribute of the same name."""

    _config_keys: tuple[str, ...] = ()

    def get_config(self) -> dict:
        return {key: getattr(self, key) for key in self._config_keys}


@keras.saving.register_keras_serializable(_PACKAGE)
class WarmupLR(_DeepSpeedSchedule):
    """DeepSpeed `WarmupLR`: min -> max over `warmup_num_steps` (log or linear), then max.

    lr(step) = min + (max - min) * gamma, gamma = log(step + 1) / log(W) ("log") or
    step / W ("linear") while step < W, else 1, with W = max(2, warmup_num_steps).
    """

    _config_keys = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type")

    def __init__(
        self,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
    ):
        _check_positive("warmup_min_lr", warmup_min_lr, allow_zero=True)
        _check_positive("warmup_max_lr", warmup_max_lr, allow_zero=True)
        _check_positive("warmup_num_steps", warmup_num_steps, allow_zero=True)
        self.warmup_min_lr = float(warmup_min_lr)
        self.warmup_max_lr = float(warmup_max_lr)
        self.warmup_num_steps = int(warmup_num_steps)
        self.warmup_type = _check_warmup_type(warmup_type)
        # DeepSpeed clamps to 2 so that log(W) is not 0.
        self._warmup = max(2, self.warmup_num_steps)

    def _gamma_after_warmup(self, step):
        return ops.ones_like(step)

    def __call__(self, step):
        step = _float_step(step)
        warming = _warmup_gamma(
            ops.minimum(step, self._warmup - 1.0), self._warmup, self.warmup_type
        )
        gamma = ops.where(step < self._warmup, warming, self._gamma_after_warmup(step))
        return self.warmup_min_lr + (self.warmup_max_lr - self.warmup_min_lr) * gamma


@keras.saving.register_keras_serializable(_PACKAGE)
class WarmupDecayLR(WarmupLR):
    """DeepSpeed `WarmupDecayLR`: `WarmupLR`'s warmup, then linear decay to 0.

    After the warmup, gamma = max(0, (T - step) / max(1, T - W)), T = total_num_steps.
    """

    _config_keys = ("total_num_steps", *WarmupLR._config_keys)

    def __init__(
        self,
        total_num_steps: int,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
    ):
        super().__init__(warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)
        _check_positive("total_num_steps", total_num_steps)
        self.total_num_steps = int(total_num_steps)

    def _gamma_after_warmup(self, step):
        remaining = (self.total_num_steps - step) / float(
            max(1, self.total_num_steps - self._warmup)
        )
        return ops.maximum(0.0, remaining)


@keras.saving.register_keras_serializable(_PACKAGE)
class WarmupCosineLR(_DeepSpeedSchedule):
    """DeepSpeed `WarmupCosineLR`: a ratio of the optimizer's `learning_rate`.

    While step < W: ratio = warmup_min_ratio + (1 - warmup_min_ratio) * gamma (gamma as
    in `WarmupLR`). After: ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) *
    (1 + cos(pi * (step - W + 1) / (T - W))) / 2). lr = learning_rate * ratio.
    """

    _config_keys = (
        "learning_rate",
        "total_num_steps",
        "warmup_min_ratio",
        "warmup_num_steps",
        "cos_min_ratio",
        "warmup_type",
    )

    def __init__(
        self,
        learning_rate: float,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
    ):
        _check_positive("learning_rate", learning_rate, allow_zero=True)
        _check_positive("total_num_steps", total_num_steps)
        _check_positive("warmup_min_ratio", warmup_min_ratio, allow_zero=True)
        _check_positive("warmup_num_steps", warmup_num_steps, allow_zero=True)
        _check_positive("cos_min_ratio", cos_min_ratio, allow_zero=True)
        self.learning_rate = float(learning_rate)
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = int(warmup_num_steps)
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = _check_warmup_type(warmup_type)
        self._warmup = max(2, self.warmup_num_steps)
        if self.total_num_steps <= self._warmup:
            # DeepSpeed only warns, then divides by T - W <= 0 after the warmup.
            raise ValueError(
                "WarmupCosineLR needs total_num_steps > warmup_num_steps (at least 2). "
                f"Received: total_num_steps={total_num_steps}, warmup_num_steps={warmup_num_steps}"
            )

    def __call__(self, step):
        step = _float_step(step)
        gamma = _warmup_gamma(ops.minimum(step, self._warmup - 1.0), self._warmup, self.warmup_type)
        warming = self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * gamma
        progress = (step - self._warmup + 1.0) / float(self.total_num_steps - self._warmup)
        cosine = (1.0 + ops.cos(math.pi * progress)) / 2.0
        decaying = ops.maximum(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)
        return self.learning_rate * ops.where(step < self._warmup, warming, decaying)


class _OneCycleShape(_DeepSpeedSchedule):
    """The cycle of DeepSpeed's `OneCycle`, shared by its learning rate and momentum."""

    def _init_cycle(self, first, second, first_stairs, second_stairs, decay_step_size):
        _check_positive("cycle_first_step_size", first)
        if second is not None:
            _check_positive("cycle_second_step_size", second)
        _check_positive("decay_step_size", decay_step_size, allow_zero=True)
        # DeepSpeed stores the stair counts but never uses them in its formulas.
        for name, stairs in (
            ("cycle_first_stair_count", first_stairs),
            ("cycle_second_stair_count", second_stairs),
        ):
            if stairs not in (None, 0):
                raise ValueError(
                    f"{name} (staircase cycles) is not implemented by DeepSpeed's OneCycle "
                    f"either; use 0. Received: {name}={stairs!r}"
                )
        self.cycle_first_step_size = int(first)
        self.cycle_second_step_size = None if second is None else int(second)
        self.cycle_first_stair_count = first_stairs
        self.cycle_second_stair_count = second_stairs
        self.decay_step_size = int(decay_step_size)
        self._total = float(first + (first if second is None else second))
        self._step_ratio = first / self._total

    def _scale_factor(self, step):
        """0 -> 1 over the first half-cycle, 1 -> 0 over the second (DeepSpeed's)."""
        iteration = step + 1.0
        cycle = ops.floor(1.0 + iteration / self._total)
        x = 1.0 + iteration / self._total - cycle
        rising = x / self._step_ratio
        falling = (x - 1.0) / (self._step_ratio - 1.0)
        return ops.where(x <= self._step_ratio, rising, falling)

    def _decay_interval(self, step):
        return (step - self._total + 1.0) / float(max(self.decay_step_size, 1))


CYCLE_KEYS = (
    "cycle_first_step_size",
    "cycle_second_step_size",
    "cycle_first_stair_count",
    "cycle_second_stair_count",
    "decay_step_size",
)


@keras.saving.register_keras_serializable(_PACKAGE)
class OneCycle(_OneCycleShape):
    """DeepSpeed `OneCycle` learning rate: min -> max -> min over one cycle, then decay.

    In the cycle (step < first + second): lr = min + (max - min) * scale_factor. After:
    lr = min / (1 + decay_lr_rate * (step - cycle + 1) / decay_step_size), or min when
    `decay_step_size` or `decay_lr_rate` is 0.
    """

    _config_keys = ("cycle_min_lr", "cycle_max_lr", "decay_lr_rate", *CYCLE_KEYS)

    def __init__(
        self,
        cycle_min_lr: float,
        cycle_max_lr: float,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int | None = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
    ):
        _check_positive("cycle_min_lr", cycle_min_lr, allow_zero=True)
        _check_positive("cycle_max_lr", cycle_max_lr, allow_zero=True)
        _check_positive("decay_lr_rate", decay_lr_rate, allow_zero=True)
        self.cycle_min_lr = float(cycle_min_lr)
        self.cycle_max_lr = float(cycle_max_lr)
        self.decay_lr_rate = float(decay_lr_rate)
        self._init_cycle(
            cycle_first_step_size,
            cycle_second_step_size,
            cycle_first_stair_count,
            cycle_second_stair_count,
            decay_step_size,
        )

    def __call__(self, step):
        step = _float_step(step)
        cycling = self.cycle_min_lr + (self.cycle_max_lr - self.cycle_min_lr) * self._scale_factor(
            step
        )
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            decayed = ops.full_like(step, self.cycle_min_lr)
        else:
            decayed = self.cycle_min_lr / (1.0 + self.decay_lr_rate * self._decay_interval(step))
        return ops.where(step < self._total, cycling, decayed)


@keras.saving.register_keras_serializable(_PACKAGE)
class OneCycleMomentum(_OneCycleShape):
    """DeepSpeed `OneCycle` momentum (Adam's beta_1): max -> min -> max, inversely to the LR.

    In the cycle: mom = max - (max - min) * scale_factor. After: max * (1 + decay_mom_rate *
    (step - cycle + 1) / decay_step_size), or max when either is 0.
    """

    _config_keys = ("cycle_min_mom", "cycle_max_mom", "decay_mom_rate", *CYCLE_KEYS)

    def __init__(
        self,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int | None = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
    ):
        for name, value in (("cycle_min_mom", cycle_min_mom), ("cycle_max_mom", cycle_max_mom)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"{name} must be in [0, 1). Received: {name}={value!r}")
        _check_positive("decay_mom_rate", decay_mom_rate, allow_zero=True)
        self.cycle_min_mom = float(cycle_min_mom)
        self.cycle_max_mom = float(cycle_max_mom)
        self.decay_mom_rate = float(decay_mom_rate)
        self._init_cycle(
            cycle_first_step_size,
            cycle_second_step_size,
            cycle_first_stair_count,
            cycle_second_stair_count,
            decay_step_size,
        )

    def __call__(self, step):
        step = _float_step(step)
        height = (self.cycle_max_mom - self.cycle_min_mom) * self._scale_factor(step)
        cycling = self.cycle_max_mom - height
        if self.decay_step_size == 0 or self.decay_mom_rate == 0:
            decayed = ops.full_like(step, self.cycle_max_mom)
        else:
            decayed = self.cycle_max_mom * (1.0 + self.decay_mom_rate * self._decay_interval(step))
        return ops.where(step < self._total, cycling, decayed)


@keras.saving.register_keras_serializable(_PACKAGE)
class LRRangeTest(_DeepSpeedSchedule):
    """DeepSpeed `LRRangeTest`: lr = min_lr * (1 + step_rate * interval).

    interval = step / step_size, or floor(step / step_size) with `staircase`.
    """

    _config_keys = (
        "lr_range_test_min_lr",
        "lr_range_test_step_size",
        "lr_range_test_step_rate",
        "lr_range_test_staircase",
    )

    def __init__(
        self,
        lr_range_test_min_lr: float = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
    ):
        _check_positive("lr_range_test_min_lr", lr_range_test_min_lr, allow_zero=True)
        _check_positive("lr_range_test_step_size", lr_range_test_step_size)
        _check_positive("lr_range_test_step_rate", lr_range_test_step_rate, allow_zero=True)
        if not isinstance(lr_range_test_staircase, bool):
            raise ValueError(
                "lr_range_test_staircase must be a bool. "
                f"Received: lr_range_test_staircase={lr_range_test_staircase!r}"
            )
        self.lr_range_test_min_lr = float(lr_range_test_min_lr)
        self.lr_range_test_step_size = int(lr_range_test_step_size)
        self.lr_range_test_step_rate = float(lr_range_test_step_rate)
        self.lr_range_test_staircase = lr_range_test_staircase

    def __call__(self, step):
        interval = _float_step(step) / float(self.lr_range_test_step_size)
        if self.lr_range_test_staircase:
            interval = ops.floor(interval)
        return self.lr_range_test_min_lr * (1.0 + self.lr_range_test_step_rate * interval)


# ---- momentum cycling -------------------------------------------------------------------


class _ScheduledBeta1:
    """Mixin: `beta_1` is `beta_1_schedule(iterations)` inside every update step.

    Keras reads `self.beta_1` in `update_step` (moment update and bias correction), as
    PyTorch reads `betas[0]` at each step, so swapping in the scheduled value for the
    duration of the step is all momentum cycling needs. The float `beta_1` stays the
    configured value, so `get_config` keeps serialising.
    """

    def __init__(self, *args, beta_1_schedule=None, **kwargs):
        super().__init__(*args, **kwargs)
        if beta_1_schedule is None:
            raise ValueError(f"{type(self).__name__} needs a beta_1_schedule.")
        self.beta_1_schedule = beta_1_schedule

    def update_step(self, gradient, variable, learning_rate):
        fixed = self.beta_1
        self.beta_1 = ops.cast(self.beta_1_schedule(self.iterations), variable.dtype)
        try:
            super().update_step(gradient, variable, learning_rate)
        finally:
            self.beta_1 = fixed

    def get_config(self) -> dict:
        config = super().get_config()
        config["beta_1_schedule"] = keras.saving.serialize_keras_object(self.beta_1_schedule)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        if isinstance(config.get("beta_1_schedule"), dict):
            config["beta_1_schedule"] = keras.saving.deserialize_keras_object(
                config["beta_1_schedule"], custom_objects=custom_objects
            )
        return super().from_config(config, custom_objects=custom_objects)


@keras.saving.register_keras_serializable(_PACKAGE)
class ScheduledBeta1Adam(_ScheduledBeta1, keras.optimizers.Adam):
    """Adam whose beta_1 follows `beta_1_schedule` (OneCycle momentum cycling)."""


@keras.saving.register_keras_serializable(_PACKAGE)
class ScheduledBeta1AdamW(_ScheduledBeta1, keras.optimizers.AdamW):
    """AdamW whose beta_1 follows `beta_1_schedule` (OneCycle momentum cycling)."""


@keras.saving.register_keras_serializable(_PACKAGE)
class ScheduledBeta1Lamb(_ScheduledBeta1, keras.optimizers.Lamb):
    """Lamb whose beta_1 follows `beta_1_schedule` (OneCycle momentum cycling)."""


@keras.saving.register_keras_serializable(_PACKAGE)
class ScheduledBeta1Lion(_ScheduledBeta1, keras.optimizers.Lion):
    """Lion whose beta_1 follows `beta_1_schedule` (OneCycle momentum cycling)."""


_SCHEDULED_BETA_1 = {
    keras.optimizers.Adam: ScheduledBeta1Adam,
    keras.optimizers.AdamW: ScheduledBeta1AdamW,
    keras.optimizers.Lamb: ScheduledBeta1Lamb,
    keras.optimizers.Lion: ScheduledBeta1Lion,
}


def supports_momentum_schedule(optimizer: keras.optimizers.Optimizer) -> bool:
    """Whether `with_momentum_schedule` applies (optimizers with a beta_1, as DeepSpeed's
    OneCycle requires `betas`)."""
    return type(optimizer) in _SCHEDULED_BETA_1 or isinstance(optimizer, _ScheduledBeta1)


def with_momentum_schedule(optimizer: keras.optimizers.Optimizer, schedule):
    """A copy of `optimizer` (Adam, AdamW, Lamb or Lion) whose beta_1 follows `schedule`.

    Raises:
      TypeError: the optimizer has no beta_1 to cycle.
    """
    cls = _SCHEDULED_BETA_1.get(type(optimizer))
    if cls is None:
        raise TypeError(
            "Momentum cycling changes beta_1, which only Adam, AdamW, Lamb and Lion have. "
            f"Received: {type(optimizer).__name__}"
        )
    return cls.from_config({**optimizer.get_config(), "beta_1_schedule": schedule})
