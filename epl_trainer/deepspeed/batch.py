"""DeepSpeed's batch arithmetic: train_batch_size = micro-batch x accumulation x replicas.

Pure Python. Given any of the three values and the data-parallel size, the missing ones
are derived as DeepSpeed's `_set_batch_related_parameters` does, then all of them are
checked, with every term in the message when they disagree.
"""

from __future__ import annotations

import dataclasses

from epl_trainer.deepspeed.keys import DeepSpeedConfigError

TRAIN = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
GAS = "gradient_accumulation_steps"


@dataclasses.dataclass(frozen=True)
class BatchSizes:
    """The resolved batch sizes of a DeepSpeed config.

    Attributes:
      train_batch_size: samples per optimizer step over the whole job.
      micro_batch_size: samples per data-parallel replica and micro-batch
        (`train_micro_batch_size_per_gpu`).
      gradient_accumulation_steps: micro-batches per step (`pipeline.num_micro_batch`).
      data_parallel_size: model replicas of the job (the plan's data-parallel degree).
    """

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    data_parallel_size: int

    def per_worker_batch(self, local_replicas: int) -> int:
        """The batch one worker's `fit` step consumes: its replicas' micro-batches."""
        return self.micro_batch_size * self.gradient_accumulation_steps * local_replicas


def _check_given(name: str, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise DeepSpeedConfigError(
            f"DeepSpeed config {name} must be a positive integer. Received: {name}={value!r}"
        )


def resolve_batch_sizes(
    train_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    gradient_accumulation_steps: int | None = None,
    *,
    data_parallel_size: int,
) -> BatchSizes:
    """Derives the missing batch values (None) as DeepSpeed does, then checks the equation.

    Derivation (DeepSpeed's): train and micro -> accumulation = train // micro // dp;
    train and accumulation -> micro = train // dp // accumulation; micro (and
    accumulation, default 1) -> train = micro x accumulation x dp; train alone ->
    accumulation 1, micro = train // dp.

    Raises:
      DeepSpeedConfigError: a value is not a positive integer, neither train_batch_size
        nor the micro-batch size is given, or train != micro x accumulation x dp (the
        message shows every term).
    """
    for name, value in (
        (TRAIN, train_batch_size),
        (MICRO, micro_batch_size),
        (GAS, gradient_accumulation_steps),
    ):
        _check_given(name, value)
    if (
        isinstance(data_parallel_size, bool)
        or not isinstance(data_parallel_size, int)
        or data_parallel_size < 1
    ):
        raise ValueError(
            f"data_parallel_size must be a positive int. Received: {data_parallel_size!r}"
        )
    train, micro, gas, dp = (
        train_batch_size,
        micro_batch_size,
        gradient_accumulation_steps,
        data_parallel_size,
    )
    if train is not None and micro is not None and gas is None:
        gas = train // micro // dp
    elif train is not None and gas is not None and micro is None:
        micro = train // dp // gas
    elif train is None and micro is not None:
        gas = 1 if gas is None else gas
        train = micro * gas * dp
    elif train is not None and micro is None:
        gas = 1
        micro = train // dp
    elif train is None:
        raise DeepSpeedConfigError(
            f"DeepSpeed config needs {TRAIN} or {MICRO} (or 'auto' with a batch_size given "
            f"to fit). Received: {TRAIN}=None, {MICRO}=None, {GAS}={gradient_accumulation_steps}"
        )
    if micro <= 0 or gas <= 0 or train != micro * gas * dp:
        raise DeepSpeedConfigError(
            f"DeepSpeed batch sizes disagree: {TRAIN} must equal {MICRO} x {GAS} x "
            f"data-parallel size, all positive. Received: {TRAIN}={train_batch_size}, "
            f"{MICRO}={micro_batch_size}, {GAS}={gradient_accumulation_steps}, "
            f"data_parallel_size={dp} (derived: {train} vs {micro} x {gas} x {dp} = "
            f"{micro * gas * dp})"
        )
    return BatchSizes(train, micro, gas, dp)
