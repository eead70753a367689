"""What a translated DeepSpeed config hands the trainer, and the batch checks at `fit`.

`DeepSpeedSetup` holds the native Config and Keras optimizer, and finishes what needs the
trainer: the accumulation steps once the data-parallel size is known (`resolve_plan`),
the per-worker batch at `fit` (`fit_batch_size`), and the monitor callbacks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from epl_trainer.config.sections import Config
from epl_trainer.deepspeed.batch import GAS, MICRO, TRAIN, BatchSizes, resolve_batch_sizes
from epl_trainer.deepspeed.keys import DeepSpeedConfigError


@dataclasses.dataclass(frozen=True)
class MonitorSpec:
    """An enabled `tensorboard` or `csv_monitor` section: where its files go."""

    kind: str  # "tensorboard" or "csv_monitor"
    output_path: str
    job_name: str


@dataclasses.dataclass
class DeepSpeedSetup:
    """What a DeepSpeed config gives the trainer, plus the batch resolution still to do.

    Attributes:
      config: the native Config (amp, zero, offload, recompute, clipping placement).
      optimizer: the Keras optimizer (schedule, momentum cycling, global_clipnorm).
      requested: (train_batch_size, micro-batch, accumulation) as given; None = derive.
      batch: the resolved sizes, once known.
      prescale_wire_scale: with DeepSpeed's prescale_gradients on the float16 wire, the
        wire's scale, divided by the data-parallel size once that is known (translate.py).
    """

    config: Config
    optimizer: Any
    requested: tuple[int | None, int | None, int | None]
    monitors: tuple[MonitorSpec, ...]
    steps_per_print: int
    fp16: bool
    prescale_wire_scale: float | None = None
    batch: BatchSizes | None = None
    data_parallel_size: int | None = None
    _callbacks: list | None = dataclasses.field(default=None, repr=False)

    def resolve_plan(self, config: Config, plan, data_parallel_size: int):
        """(config, plan) with `num_micro_batch` = the accumulation steps for this plan.

        `data_parallel_size` counts what DeepSpeed calls GPUs: the job's lanes, each taking
        one micro-batch per accumulation step (a replica's device, or a pipeline). If
        neither train_batch_size nor the micro-batch is given, the micro-batch waits for
        `fit`'s batch size.
        """
        train, micro, gas = self.requested
        self.data_parallel_size = data_parallel_size
        if train is not None or micro is not None:
            self.batch = resolve_batch_sizes(
                train, micro, gas, data_parallel_size=data_parallel_size
            )
            gas = self.batch.gradient_accumulation_steps
        gas = 1 if gas is None else gas  # Hugging Face's default gradient_accumulation_steps
        if self.prescale_wire_scale is not None:
            scale = self.prescale_wire_scale / data_parallel_size
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
        if _is_dataset(x):
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
        return None if _is_dataset(x) else expected

    def callbacks(self, loss_tracker, is_chief: bool, stats=None) -> list:
        """steps_per_print and the monitors, on worker 0 only (as DeepSpeed's rank 0);
        `stats`: the trainer's `step_stats` (loss scale, skipped steps).

        Built once per trainer, so later `fit` calls continue the same files.
        """
        from epl_trainer.training import monitors

        if not is_chief:
            return []
        if self._callbacks is not None:
            return self._callbacks
        result = [monitors.StepsPerPrint(self.steps_per_print, stats)]
        writers = [
            (monitors.TensorBoardWriter if spec.kind == "tensorboard" else monitors.CsvWriter)(
                spec.output_path, spec.job_name
            )
            for spec in self.monitors
        ]
        if writers:
            if self.batch is None:
                raise ValueError("DeepSpeed monitors need the batch size; call fit first.")
            result.append(
                monitors.DeepSpeedMonitor(
                    writers,
                    self.batch.train_batch_size,
                    loss_tracker=loss_tracker,
                    log_loss_scale=self.fp16,
                    stats=stats,
                )
            )
        self._callbacks = result
        return result


def _is_dataset(x) -> bool:
    import tensorflow as tf

    return isinstance(x, tf.data.Dataset)


def _first_batch_size(dataset) -> int | None:
    """The leading dimension of the dataset's first batch (static when known)."""
    import tensorflow as tf

    first = tf.nest.flatten(dataset.element_spec)[0]
    if first.shape.rank and first.shape[0] is not None:
        return int(first.shape[0])
    element = next(iter(dataset.take(1)), None)
    return None if element is None else int(tf.nest.flatten(element)[0].shape[0])
