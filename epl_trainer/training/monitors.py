"""DeepSpeed's training monitors as Keras callbacks: TensorBoard and CSV output, one layout.

DeepSpeed's engine writes, on rank 0 and once per optimizer step, the events
`Train/Samples/train_loss` (this step's loss, at x = samples seen before the step),
`Train/Samples/lr` and, with fp16, `Train/Samples/loss_scale` (both at x = samples seen
after the step), where samples grow by `train_batch_size` per step, skipped steps
included. `DeepSpeedMonitor` produces the same events from the trainer's logs and hands
them to writers with DeepSpeed's file layout:

- `TensorBoardWriter`: event files in `<output_path>/<job_name>/` (scalars with those tags);
- `CsvWriter`: one file per tag in `<output_path>/<job_name>/`, named after the tag with
  `/` and spaces replaced by `_` (`Train_Samples_train_loss.csv`), header `step,<last tag
  part>` written once per run, then one `samples,value` row per step; files are appended
  to, as DeepSpeed's `csv_monitor` does.

Only worker 0 should get these callbacks (the trainer adds them there only).
"""

from __future__ import annotations

import csv
import logging
import os

import keras
import numpy as np

logger = logging.getLogger(__name__)

TRAIN_LOSS = "Train/Samples/train_loss"
LEARNING_RATE = "Train/Samples/lr"
LOSS_SCALE = "Train/Samples/loss_scale"


def log_dir(output_path: str, job_name: str) -> str:
    """DeepSpeed's monitor directory: `output_path/job_name` (relative to the working dir)."""
    return os.path.join(output_path, job_name)


class CsvWriter:
    """DeepSpeed `csv_monitor` files: one CSV per tag under `output_path/job_name`."""

    def __init__(self, output_path: str, job_name: str):
        self.log_dir = log_dir(output_path, job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self._headed: set[str] = set()

    @staticmethod
    def file_name(tag: str) -> str:
        return tag.replace("/", "_").replace(" ", "_") + ".csv"

    def write_events(self, events) -> None:
        for tag, value, step in events:
            name = self.file_name(tag)
            # Append, with the header once per run, as DeepSpeed does.
            with open(os.path.join(self.log_dir, name), "a+", newline="") as f:
                writer = csv.writer(f)
                if name not in self._headed:
                    self._headed.add(name)
                    writer.writerow(["step", tag.split("/")[-1]])
                writer.writerow([step, value])

    def close(self) -> None:
        pass


class TensorBoardWriter:
    """DeepSpeed `tensorboard` output: scalar events under `output_path/job_name`."""

    def __init__(self, output_path: str, job_name: str):
        import tensorflow as tf

        self._tf = tf
        self.log_dir = log_dir(output_path, job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self._writer = tf.summary.create_file_writer(self.log_dir)

    def write_events(self, events) -> None:
        tf = self._tf
        with self._writer.as_default():
            for tag, value, step in events:
                tf.summary.scalar(tag, value, step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def current_learning_rate(optimizer, applied_updates: int) -> float:
    """The learning rate the last applied update used (DeepSpeed logs the same value).

    A Keras schedule is evaluated at the update's index; `applied_updates` excludes
    skipped (overflowed) steps, which advance neither DeepSpeed's scheduler nor ours.
    """
    rate = optimizer._learning_rate
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        return float(keras.ops.convert_to_numpy(rate(max(applied_updates - 1, 0))))
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


class _StepLoss:
    """This step's mean loss, from the running sums of the trainer's loss tracker.

    Keras logs `loss` as the epoch's running mean; DeepSpeed logs each step's own loss.
    The tracker (a `keras.metrics.Mean`) holds a running total and count, so the step's
    loss is the change of the total over the change of the count.
    """

    def __init__(self, tracker):
        self.tracker = tracker
        self.reset()

    def reset(self) -> None:
        self._total, self._count = 0.0, 0.0

    def __call__(self, logs) -> float:
        if self.tracker is None:
            return float(logs["loss"])
        total = float(np.asarray(self.tracker.total))
        count = float(np.asarray(self.tracker.count))
        if count < self._count:  # reset since (a new epoch)
            self.reset()
        delta_total, delta_count = total - self._total, count - self._count
        self._total, self._count = total, count
        return delta_total / delta_count if delta_count else float(logs["loss"])


class DeepSpeedMonitor(keras.callbacks.Callback):
    """Writes DeepSpeed's `Train/Samples/*` events after every step.

    Args:
      writers: objects with `write_events([(tag, value, samples), ...])`, e.g.
        `CsvWriter`, `TensorBoardWriter` (they stay open across `fit` calls and flush
        after every step).
      train_batch_size: samples per step over the whole job (the x-axis unit).
      loss_tracker: the trainer's loss `keras.metrics.Mean` (its running sums give each
        step's loss); None logs Keras's running-mean `loss` instead.
      log_loss_scale: write `Train/Samples/loss_scale` (DeepSpeed does with fp16 only).
      stats: the trainer's `step_stats` (the loss scale and skipped steps, which are not
        in Keras's logs); None reads them from the logs.
    """

    reads_logs_only = True  # the trainer need not write the weights back every step

    def __init__(
        self,
        writers,
        train_batch_size: int,
        *,
        loss_tracker=None,
        log_loss_scale=False,
        stats=None,
    ):
        super().__init__()
        self.stats = stats
        self.writers = list(writers)
        self.train_batch_size = int(train_batch_size)
        self.log_loss_scale = log_loss_scale
        self._step_loss = _StepLoss(loss_tracker)
        self._steps = 0

    def on_train_begin(self, logs=None):
        # Resumed training continues the x-axis where the restored step count left it.
        self._steps = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

    def on_epoch_begin(self, epoch, logs=None):
        self._step_loss.reset()

    def on_train_batch_end(self, batch, logs=None):
        logs = logs or {}
        samples_before = self._steps * self.train_batch_size
        self._steps += 1
        samples = self._steps * self.train_batch_size
        stats = logs if self.stats is None else self.stats
        applied = self._steps - int(stats.get("skipped_steps", 0))
        events = [
            (TRAIN_LOSS, self._step_loss(logs), samples_before),
            (LEARNING_RATE, current_learning_rate(self.model.optimizer, applied), samples),
        ]
        if self.log_loss_scale and "loss_scale" in stats:
            events.append((LOSS_SCALE, float(stats["loss_scale"]), samples))
        for writer in self.writers:
            writer.write_events(events)


class StepsPerPrint(keras.callbacks.Callback):
    """DeepSpeed's `steps_per_print`: logs step, skipped steps, lr and loss every N steps."""

    reads_logs_only = True

    def __init__(self, steps_per_print: int, stats=None):
        super().__init__()
        self.stats = stats  # the trainer's step_stats (skipped steps); None: the logs
        if isinstance(steps_per_print, bool) or not isinstance(steps_per_print, int):
            raise TypeError(f"steps_per_print must be an int. Received: {steps_per_print!r}")
        if steps_per_print < 1:
            raise ValueError(f"steps_per_print must be >= 1. Received: {steps_per_print}")
        self.steps_per_print = steps_per_print
        self._steps = 0

    def on_train_begin(self, logs=None):
        self._steps = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

    def on_train_batch_end(self, batch, logs=None):
        logs = logs or {}
        self._steps += 1
        if self._steps % self.steps_per_print:
            return
        skipped = int((logs if self.stats is None else self.stats).get("skipped_steps", 0))
        lr = current_learning_rate(self.model.optimizer, self._steps - skipped)
        logger.info(
            "step=%d, skipped=%d, lr=[%s], loss=%s", self._steps, skipped, lr, logs.get("loss")
        )
