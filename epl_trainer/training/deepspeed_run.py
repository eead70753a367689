"""A DeepSpeed config at work in a trainer: the Keras objects built from what `deepspeed/`
describes, and the batch sizes resolved as the plan and `fit`'s data give them.

`deepspeed/` reads the JSON into data (`DeepSpeedSetup`: config keys and descriptions of
the optimizer, its schedule and the monitors). This module builds the Keras optimizer
(DeepSpeed's own rules from `update_rules`, its schedulers from `schedules`) and the
monitor callbacks (`monitors`), and finishes what needs the trainer: the accumulation
steps once the data-parallel size is known (`resolve_plan`) and the per-worker batch at
`fit` (`fit_batch_size`). Imports run one way: training/ reads deepspeed/, never back.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import keras
import tensorflow as tf

from epl_trainer.config.sections import Config
from epl_trainer.deepspeed.batch import GAS, MICRO, TRAIN, BatchSizes, resolve_batch_sizes
from epl_trainer.deepspeed.keys import DeepSpeedConfigError
from epl_trainer.deepspeed.setup import (
    DeepSpeedSetup,
    OptimizerSpec,
    ScheduleSpec,
    TrainerOptimizer,
)
from epl_trainer.deepspeed.translate import DeepSpeedConfig, is_deepspeed_config
from epl_trainer.runtime.env import Env
from epl_trainer.training import monitors, optimizers, schedules, update_rules

logger = logging.getLogger(__name__)

# OptimizerSpec.rule -> the Keras class.
_RULES = {
    "Adam": keras.optimizers.Adam,
    "AdamW": keras.optimizers.AdamW,
    "Adagrad": keras.optimizers.Adagrad,
    "Lion": keras.optimizers.Lion,
    "SGD": keras.optimizers.SGD,
    "FusedLamb": update_rules.FusedLamb,
}
_MOMENTUM_KEYS = ("cycle_min_mom", "cycle_max_mom", "decay_mom_rate")


def trainer_setup(config: Any, optimizer: Any):
    """For `EPLTrainer.__init__`: (config, optimizer, DeepSpeedRun or None).

    A non-DeepSpeed `config` is returned unchanged. A DeepSpeed one is translated on top
    of `epl.init()`'s config (unless it carries its own `base`), with "auto" values from
    the trainer's `optimizer`.
    """
    if not is_deepspeed_config(config):
        return config, optimizer, None
    run = translate(config, keras.optimizers.get(optimizer), base=Env.get().config)
    return run.config, run.optimizer, run


def translate(config: Any, trainer_optimizer, base: Config | None = None) -> DeepSpeedRun:
    """`config` (a DeepSpeedConfig, dict or `.json` path) translated on top of `base` (its
    own `base` first), with the optimizer built; "auto" values come from
    `trainer_optimizer`, a Keras optimizer.

    Raises:
      DeepSpeedConfigError: an unknown, unsupported or invalid key or value.
    """
    setup = DeepSpeedConfig.load(config).translate(read_optimizer(trainer_optimizer), base)
    return DeepSpeedRun(setup, build_optimizer(setup.optimizer, trainer_optimizer))


def _number(optimizer, name: str) -> float | None:
    """A hyperparameter as a float; None when the optimizer has none, or a callable."""
    value = getattr(optimizer, name, None)
    return None if value is None or callable(value) else float(value)


def read_optimizer(optimizer) -> TrainerOptimizer:
    """What the translator needs of the trainer's Keras optimizer: its "auto" values."""
    rate = optimizer._learning_rate
    scheduled = isinstance(rate, keras.optimizers.schedules.LearningRateSchedule)
    constant = None if scheduled else float(keras.ops.convert_to_numpy(optimizer.learning_rate))
    betas = [_number(optimizer, "beta_1"), _number(optimizer, "beta_2")]
    return TrainerOptimizer(
        name=type(optimizer).__name__,
        learning_rate=constant,
        schedule=repr(rate) if scheduled else None,
        betas=None if None in betas else betas,
        epsilon=_number(optimizer, "epsilon"),
        weight_decay=float(optimizer.weight_decay or 0.0),
        momentum=_number(optimizer, "momentum"),
        global_clipnorm=optimizer.global_clipnorm,
    )


def build_optimizer(spec: OptimizerSpec, trainer_optimizer) -> keras.optimizers.Optimizer:
    """The Keras optimizer `spec` describes: its class (or `trainer_optimizer` when the
    config has no optimizer section), schedule, momentum cycling and global-norm clipping.
    """
    optimizer = trainer_optimizer if spec.rule is None else _new_optimizer(spec)
    own = {k: getattr(optimizer, k, None) for k in ("clipnorm", "clipvalue")}
    own = {k: v for k, v in own.items() if v}
    if spec.global_clipnorm and own:
        # Keras optimizers take one kind of clipping; rebuilding with both failed inside
        # Keras ("Only one of `clipnorm`, `clipvalue` and `global_clipnorm`"), naming
        # neither the DeepSpeed key nor the trainer's optimizer.
        terms = ", ".join(f"{k}={v}" for k, v in own.items())
        raise DeepSpeedConfigError(
            "DeepSpeed config gradient_clipping clips by the global norm, and the trainer's "
            f"optimizer already clips ({terms}); a Keras optimizer takes one kind of "
            "clipping: drop gradient_clipping (or set it to 0) or the optimizer's. "
            f"Received: gradient_clipping={spec.global_clipnorm}, {terms}"
        )
    schedule = momentum = None
    if spec.schedule is not None:
        schedule, momentum = build_schedule(spec.schedule)
    overrides = {"global_clipnorm": spec.global_clipnorm}
    if schedule is not None:
        overrides["learning_rate"] = schedule
    rebuilt = optimizers.rebuild(optimizer, **overrides)
    if momentum is None:
        return rebuilt
    if not schedules.supports_momentum_schedule(rebuilt):
        # DeepSpeed's OneCycle also turns momentum cycling off (with a warning) for
        # optimizers without betas.
        logger.warning(
            "OneCycle cycle_momentum is off: %s has no beta_1 (as in DeepSpeed, which needs "
            "betas). Set scheduler.params.cycle_momentum to false to silence this.",
            type(rebuilt).__name__,
        )
        return rebuilt
    return schedules.with_momentum_schedule(rebuilt, momentum)


def _new_optimizer(spec: OptimizerSpec) -> keras.optimizers.Optimizer:
    cls = _RULES[spec.rule]
    if not spec.l2_weight_decay:
        return cls(**spec.arguments)
    return update_rules.with_l2(cls)(**spec.arguments, l2_weight_decay=spec.l2_weight_decay)


def build_schedule(spec: ScheduleSpec):
    """(learning-rate schedule, momentum schedule or None) of DeepSpeed's `scheduler`.

    Raises:
      DeepSpeedConfigError: the schedule refuses a param (the message names it).
    """
    try:
        return _make_schedule(spec.type, dict(spec.params), spec.learning_rate)
    except (TypeError, ValueError) as err:
        raise DeepSpeedConfigError(f"DeepSpeed config scheduler {spec.type}: {err}") from err


def _make_schedule(name: str, params: dict, learning_rate: float):
    if name == "WarmupLR":
        return schedules.WarmupLR(**params), None
    if name == "WarmupDecayLR":
        return schedules.WarmupDecayLR(**params), None
    if name == "WarmupCosineLR":
        return schedules.WarmupCosineLR(learning_rate, **params), None
    if name == "LRRangeTest":
        return schedules.LRRangeTest(**params), None
    # OneCycle: the learning rate, and beta_1 cycling over the same shape.
    cycle_momentum = params.pop("cycle_momentum", True)
    shape = {k: params[k] for k in schedules.CYCLE_KEYS if k in params}
    momentum = {k: params.pop(k) for k in _MOMENTUM_KEYS if k in params}
    lr_schedule = schedules.OneCycle(**params)
    return lr_schedule, schedules.OneCycleMomentum(**momentum, **shape) if cycle_momentum else None


class DeepSpeedRun:
    """A translated DeepSpeed config in one trainer.

    Attributes:
      setup: the translation (config keys and descriptions).
      config: the native Config; `resolve_plan` sets its accumulation steps.
      optimizer: the Keras optimizer built from `setup.optimizer`.
      batch: the resolved batch sizes, once known.
      data_parallel_size: the job's lanes, once the plan is known.
    """

    def __init__(self, setup: DeepSpeedSetup, optimizer: keras.optimizers.Optimizer):
        self.setup = setup
        self.config = setup.config
        self.optimizer = optimizer
        self.batch: BatchSizes | None = None
        self.data_parallel_size: int | None = None
        self._callbacks: list | None = None

    def resolve_plan(self, config: Config, plan, data_parallel_size: int):
        """(config, plan) with `num_micro_batch` = the accumulation steps for this plan.

        `data_parallel_size` counts what DeepSpeed calls GPUs: the job's lanes, each taking
        one micro-batch per accumulation step (a replica's device, or a pipeline). If
        neither train_batch_size nor the micro-batch is given, the micro-batch waits for
        `fit`'s batch size.
        """
        train, micro, gas = self.setup.requested
        self.data_parallel_size = data_parallel_size
        if train is not None or micro is not None:
            self.batch = resolve_batch_sizes(
                train, micro, gas, data_parallel_size=data_parallel_size
            )
            gas = self.batch.gradient_accumulation_steps
        gas = 1 if gas is None else gas  # Hugging Face's default gradient_accumulation_steps
        if self.setup.prescale_wire_scale is not None:
            scale = self.setup.prescale_wire_scale / data_parallel_size
            config = config.replace({"communication.fp16_scale": scale})
        if gas != plan.num_micro_batch:
            config = config.replace({"pipeline.num_micro_batch": gas})
            plan = dataclasses.replace(plan, num_micro_batch=gas)
        self.config = config
        return config, plan

    def fit_batch_size(self, x, batch_size, plan, local_replicas: int):
        """The `batch_size` to give the data pipeline for `fit(x, batch_size=...)`.

        Numpy inputs get the config's per-worker batch (micro-batch x accumulation x local
        replicas); with "auto" sizes, `batch_size` sets them. A dataset is already batched:
        its first batch is checked (or sets the "auto" sizes) and None is returned.

        Raises:
          DeepSpeedConfigError: the batch disagrees with the config's batch sizes.
        """
        gas = plan.num_micro_batch
        given = batch_size
        if isinstance(x, tf.data.Dataset):
            given = _first_batch_size(x)
        if self.batch is None:
            if given is None:
                raise DeepSpeedConfigError(
                    f"DeepSpeed config leaves {TRAIN} and {MICRO} to the trainer ('auto' or "
                    "absent): pass batch_size to fit (per worker)."
                )
            parts = local_replicas * gas
            if given % parts:
                raise DeepSpeedConfigError(
                    f"fit's batch (per worker) must split into local replicas x {GAS}. "
                    f"Received: batch_size={given}, local_replicas={local_replicas}, {GAS}={gas}"
                )
            self.batch = resolve_batch_sizes(
                None, given // parts, gas, data_parallel_size=self.data_parallel_size
            )
        expected = self.batch.per_worker_batch(local_replicas)
        if given is not None and given != expected:
            raise DeepSpeedConfigError(
                f"fit's batch (per worker) must be {MICRO} x {GAS} x local replicas. "
                f"Received: batch_size={given}, {MICRO}={self.batch.micro_batch_size}, "
                f"{GAS}={gas}, local_replicas={local_replicas}"
            )
        return None if isinstance(x, tf.data.Dataset) else expected

    def callbacks(self, loss_tracker, is_chief: bool, stats=None) -> list:
        """steps_per_print and the monitors, on worker 0 only (as DeepSpeed's rank 0);
        `stats`: the trainer's `step_stats` (loss scale, skipped steps).

        Built once per trainer, so later `fit` calls continue the same files.
        """
        if not is_chief:
            return []
        if self._callbacks is not None:
            return self._callbacks
        result = [monitors.StepsPerPrint(self.setup.steps_per_print, stats)]
        writers = [
            (monitors.TensorBoardWriter if spec.kind == "tensorboard" else monitors.CsvWriter)(
                spec.output_path, spec.job_name
            )
            for spec in self.setup.monitors
        ]
        if writers:
            if self.batch is None:
                raise ValueError("DeepSpeed monitors need the batch size; call fit first.")
            result.append(
                monitors.DeepSpeedMonitor(
                    writers,
                    self.batch.train_batch_size,
                    loss_tracker=loss_tracker,
                    log_loss_scale=self.setup.fp16,
                    stats=stats,
                )
            )
        self._callbacks = result
        return result


def _first_batch_size(dataset) -> int | None:
    """The leading dimension of the dataset's first batch (static when known)."""
    first = tf.nest.flatten(dataset.element_spec)[0]
    if first.shape.rank and first.shape[0] is not None:
        return int(first.shape[0])
    element = next(iter(dataset.take(1)), None)
    return None if element is None else int(tf.nest.flatten(element)[0].shape[0])
