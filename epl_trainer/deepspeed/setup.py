"""What a translated DeepSpeed config hands the trainer: plain data, no Keras.

The translator (translate.py) reads the JSON into a `DeepSpeedSetup`: the native Config's
keys, and descriptions of the optimizer, its schedule and the monitors. The trainer's
side (`training/deepspeed_run.py`) builds the Keras objects from these descriptions and
resolves the batch sizes once the plan and `fit`'s data give them. Keeping this side
data is what lets `deepspeed/` import nothing above `config/`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from epl_trainer.config.sections import Config


@dataclasses.dataclass(frozen=True)
class TrainerOptimizer:
    """The trainer's own optimizer as the translator reads it: the source of "auto"
    values (as Hugging Face's TrainingArguments fills them in), and its name for messages.

    Attributes:
      name: its class name.
      learning_rate: its constant learning rate; None when the learning rate is a schedule.
      schedule: the schedule's repr when the learning rate is one ("auto" cannot take it).
      betas: [beta_1, beta_2] when it has both.
      epsilon, momentum: its values when it has them.
      weight_decay: its (decoupled) weight decay, 0 for none.
      global_clipnorm: its global-norm clipping, None for none.
    """

    name: str
    learning_rate: float | None
    schedule: str | None = None
    betas: list[float] | None = None
    epsilon: float | None = None
    weight_decay: float = 0.0
    momentum: float | None = None
    global_clipnorm: float | None = None


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
    """DeepSpeed's `scheduler` section, checked.

    Attributes:
      type: DeepSpeed's scheduler type (`optim.SCHEDULERS`); `training/schedules.py` has
        the schedule of each name (OneCycle's momentum cycling is `OneCycleMomentum`).
      params: its params typed, "auto" filled in, `last_batch_iteration` left out (the
        optimizer's restored step count resumes a schedule).
      learning_rate: the optimizer's learning rate (WarmupCosineLR is a ratio of it);
        None when the schedule does not read it and the trainer's optimizer has a Keras
        schedule instead of a number.
    """

    type: str
    params: Mapping[str, Any]
    learning_rate: float | None


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer a DeepSpeed config asks for, in Keras's terms.

    Attributes:
      rule: the Keras optimizer class: "Adam", "AdamW", "Adagrad", "Lion" or "SGD" of
        `keras.optimizers`, or "FusedLamb" (DeepSpeed's Lamb, `training/update_rules.py`);
        None keeps the trainer's own optimizer (the config has no `optimizer` section).
      arguments: the class's keyword arguments (learning_rate, beta_1, epsilon, ...).
      l2_weight_decay: PyTorch's coupled weight decay (gradient += l2_weight_decay * w,
        `update_rules.with_l2`), 0 for none.
      schedule: the learning-rate schedule that replaces the learning rate, or None.
      global_clipnorm: the global-norm clipping, None for none.
    """

    rule: str | None
    arguments: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    l2_weight_decay: float = 0.0
    schedule: ScheduleSpec | None = None
    global_clipnorm: float | None = None


@dataclasses.dataclass(frozen=True)
class MonitorSpec:
    """An enabled `tensorboard` or `csv_monitor` section: where its files go."""

    kind: str  # "tensorboard" or "csv_monitor"
    output_path: str
    job_name: str


@dataclasses.dataclass(frozen=True)
class DeepSpeedSetup:
    """What a DeepSpeed config gives the trainer.

    Attributes:
      config: the native Config (amp, zero, offload, recompute, clipping placement).
      optimizer: the optimizer, its schedule and momentum cycling, its global_clipnorm.
      requested: (train_batch_size, micro-batch, accumulation) as given; None = derive.
      monitors: the enabled monitors.
      steps_per_print: how often a step's line is logged.
      fp16: whether float16 AMP is on (the monitors then log the loss scale).
      prescale_wire_scale: with DeepSpeed's prescale_gradients on the float16 wire, the
        wire's scale, divided by the data-parallel size once that is known (translate.py).
    """

    config: Config
    optimizer: OptimizerSpec
    requested: tuple[int | None, int | None, int | None]
    monitors: tuple[MonitorSpec, ...]
    steps_per_print: int
    fp16: bool
    prescale_wire_scale: float | None = None
