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

`FlopsProfiler` (config `profiler.flops`, DeepSpeed's `flops_profiler`) adds the achieved
`tflops` and `mfu` to Keras's logs (so the progress bar, History and Keras's TensorBoard
callback show them), writes them as `Train/Samples/tflops` and `Train/Samples/mfu` to the
DeepSpeed monitors' writers, and prints DeepSpeed's profile table at one step.
"""

from __future__ import annotations

import csv
import logging
import os
import re
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

from epl_trainer.core.graph.flops_profile import format_profile, train_step_flops
from epl_trainer.core.graph.peak import UtilizationError, matmul_peak, model_flops_utilization

logger = logging.getLogger(__name__)

TRAIN_LOSS = "Train/Samples/train_loss"
LEARNING_RATE = "Train/Samples/lr"
LOSS_SCALE = "Train/Samples/loss_scale"
TFLOPS = "Train/Samples/tflops"
MFU = "Train/Samples/mfu"


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
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
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


class FlopsProfiler(keras.callbacks.Callback):
    """Achieved TFLOP/s and MFU in the logs (`tflops`, `mfu`) and, at one step, DeepSpeed's
    flops profiler table (per op type, layer and pipeline stage).

    The FLOPs are model FLOPs: those of one plain Keras training step on the job's global
    batch (`core/graph/flops_profile.py`), whatever the parallel layout adds (a recomputed
    forward costs time, not model FLOPs). MFU = FLOPs / time / (peak x workers), the peak
    being one worker's machine's. A batch's and an epoch's logs carry the epoch's values so
    far, without the first call of each `fit` (it traces the step) unless it is the only
    one. An MFU above 1 is never logged: the count or the peak is wrong, and a warning
    (once per callback) gives every term.

    Args:
      count_step: global rows of a step -> the `FlopCount` of one step on that batch.
      peak: the peak of one worker's machine (`core/graph/peak.matmul_peak`).
      stats: the trainer's `step_stats` (`samples_per_sec`, `call_steps`, `call_seconds`
        of the last call); None (Keras's fit): the callback times each batch callback
        itself and counts `batch_size` rows per optimizer step.
      batch_size: rows per step without `stats`.
      workers: the machines the job runs on.
      profile_step: the step whose table is printed, numbered as DeepSpeed's global steps
        (the steps done before it: 1 is the second); -1: none.
      module_depth, top_modules, detailed: the table's layers (`format_profile`).
      output_file: the table's file (overwritten, as DeepSpeed does); None: stdout.
      stage_of: top-level layer -> pipeline stage, for the table.
      writers: monitor writers (`TensorBoardWriter`, `CsvWriter`) that get
        `Train/Samples/tflops` and `Train/Samples/mfu` after every call.
    """

    reads_logs_only = True

    def __init__(
        self,
        count_step,
        peak,
        *,
        stats=None,
        batch_size: int | None = None,
        workers: int = 1,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
        stage_of=None,
        writers=(),
    ):
        super().__init__()
        if stats is None and not batch_size:
            raise ValueError(
                "FlopsProfiler needs the trainer's step_stats or Keras's batch_size. "
                f"Received: stats=None, batch_size={batch_size!r}"
            )
        self.count_step, self.peak, self.stats = count_step, peak, stats
        self.batch_size, self.workers = batch_size, workers
        self.profile_step, self.output_file = profile_step, output_file
        self.table = dict(
            module_depth=module_depth, top_modules=top_modules, detailed=detailed, stage_of=stage_of
        )
        self.writers = list(writers)
        self._counts: dict = {}
        self._warned = False
        self._samples = 0

    def step_count(self, rows: int):
        """The `FlopCount` of one step on `rows` global rows (traced once per size)."""
        if rows not in self._counts:
            self._counts[rows] = self.count_step(rows)
        return self._counts[rows]

    def on_train_begin(self, logs=None):
        self._steps = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        self._first_call = True

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = (0, 0.0)  # FLOPs and seconds of the calls counted
        self._first = None  # the fit's first call, used while it is the only one

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        steps, rows, seconds = self._call()
        step = self._steps
        self._steps += steps
        if steps <= 0:
            return
        count = self.step_count(rows // steps)
        flops = count.flops * steps
        if self._first_call:
            self._first_call, self._first = False, (flops, seconds)
        else:
            self._epoch = (self._epoch[0] + flops, self._epoch[1] + seconds)
        if step <= self.profile_step < self._steps:
            self._print_profile(count, rows // steps, seconds / steps, self.profile_step)
        values = self._values()
        if logs is not None:
            logs.update(values)
        self._samples += rows
        tags = {"tflops": TFLOPS, "mfu": MFU}
        events = [(tags[key], value, self._samples) for key, value in values.items()]
        for writer in self.writers:
            writer.write_events(events)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None and (self._epoch[1] or self._first):
            logs.update(self._values())

    def _call(self) -> tuple[int, int, float]:
        """(steps, global rows, seconds) of the call that just ended."""
        if self.stats is not None:
            seconds = float(self.stats["call_seconds"])
            rows = round(float(self.stats["samples_per_sec"]) * seconds)
            return int(self.stats["call_steps"]), rows, seconds
        seconds = time.perf_counter() - self._start
        steps = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations)) - self._steps
        return steps, steps * self.batch_size, seconds

    def _values(self) -> dict:
        flops, seconds = self._epoch if self._epoch[1] else self._first
        values = {"tflops": flops / seconds / 1e12}
        try:
            values["mfu"] = model_flops_utilization(flops, seconds, self.peak, self.workers)
        except UtilizationError as error:
            if not self._warned:  # every later call would say the same
                self._warned = True
                logger.error("%s", error)
                warnings.warn(str(error), RuntimeWarning, stacklevel=2)
        return values

    def _print_profile(self, count, rows: int, seconds: float, step: int) -> None:
        try:
            mfu = model_flops_utilization(count.flops, seconds, self.peak, self.workers)
            mfu_text = f"{mfu:.1%}"
        except UtilizationError:
            mfu_text = "above 100%: the FLOP count or the peak is wrong"
        summary = [
            ("profile step", str(step)),
            ("global batch (rows)", str(rows)),
            ("workers", str(self.workers)),
            ("step time", f"{seconds * 1e3:.2f} ms"),
            ("achieved", f"{count.flops / seconds / 1e12:.4g} TFLOP/s"),
            ("peak per worker", self.peak.describe()),
            ("MFU", mfu_text),
        ]
        text = format_profile(count, summary=summary, **self.table)
        if not self.output_file:
            print(text)
            return
        with open(self.output_file, "w", encoding="utf-8") as f:
            f.write(text + "\n")


def with_flops_profiler(
    callbacks, dataset, *, config, model, loss, optimizer, stages, step_stats, cluster
) -> list:
    """`callbacks` led by a `FlopsProfiler` when `config` sets `profiler.flops` (first, so
    Keras's TensorBoard and History record its logs), unless they hold one. `dataset`:
    fit's batches (their specs give the traced step's); `loss` and `optimizer` the
    trainer's, `stages` its model's stages, `step_stats` its per-step values (which the
    profiler reads the step time from)."""
    callbacks = list(callbacks or [])
    section = config.profiler
    if not section.flops or any(isinstance(c, FlopsProfiler) for c in callbacks):
        return callbacks
    element = dataset.element_spec
    element = (*element, None, None)[:3] if isinstance(element, tuple) else (element, None, None)

    def count_step(rows: int):
        def spec(s):
            return None if s is None else tf.TensorSpec((rows, *s.shape[1:]), s.dtype)

        x, y, weights = (tf.nest.map_structure(spec, part) for part in element)
        counted = loss if loss.entries else (lambda *_: tf.zeros(()))  # add_loss only
        return train_step_flops(model, x, y, weights, loss=counted, optimizer=optimizer)

    profiler = FlopsProfiler(
        count_step,
        matmul_peak(section.peak_tflops or None),
        stats=step_stats,
        workers=cluster.worker_num,
        profile_step=section.profile_step if cluster.is_chief else -1,
        module_depth=section.module_depth,
        top_modules=section.top_modules,
        detailed=section.detailed,
        output_file=section.output_file or None,
        stage_of={re.escape(name): s.index for s in stages for name in s.layer_names}
        if len(stages) > 1
        else None,
        writers=[w for c in callbacks if isinstance(c, DeepSpeedMonitor) for w in c.writers],
    )
    return [profiler, *callbacks]
