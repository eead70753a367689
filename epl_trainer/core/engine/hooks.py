"""The step's extension points: what the builder's passes fill before the first trace.

`Program` (program.py) and the lane executors (pipeline.py) read only these slots; a
pass never reaches into a built object. The builder (builder.py) fills them in a stated
order: split, gradient checkpointing, the update, then AMP or the non-finite guard.

`LocalBatchStatistics` is where a lane's forward and backward of one (stage,
micro-batch) run: by default BatchNormalization normalises over the lane's own rows;
sync_batch_norm.py's `SyncBatchNorm` makes it normalise over every replica.

`LaneHooks` is the part of the step that differs when layers are split over the lanes
of a replica: which lane is current while a lane's ops are traced, how sharded
gradients are reduced and counted in the global norm, how split outputs feed metrics
and predictions. `ReplicatedLanes` is the default (every lane holds whole variables);
split.py's `SplitLanes` replaces it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import tensorflow as tf
from keras import tree

from epl_trainer.core.engine.lane_order import traced_as_lane


def identity(x):
    return x


class ReplicatedLanes:
    """Lane hooks of a program without split layers: nothing is sharded."""

    def lane(self, li: int):
        """A context in which lane li's ops are traced (lane_order.py)."""
        return traced_as_lane(li)

    def begin_trace(self) -> None:
        """Called once at the start of every traced step."""
        return

    def reduce_sharded(self, lane_grads: list[list], reduced: list[list]) -> None:
        """Writes the reduced gradients of sharded variables into `reduced`."""
        return

    def shard_norm_squares(self, li: int, grads: list) -> list:
        """Lane li's share of the squared global norm held in sharded gradients."""
        return []

    def update_output_metric(self, index: int, metric, y_true, y_pred, sample_weight) -> bool:
        """Updates `metric` of flat output `index` if that output is split; returns
        whether it did (False: the caller updates it as a plain Keras metric)."""
        return False

    def join_predictions(self, lane_outputs: list, batch):
        """The lanes' predictions, rows in lane order, cut to `batch` rows."""
        joined = tree.map_structure(lambda *xs: tf.concat(xs, axis=0), *lane_outputs)
        return tree.map_structure(lambda x: x[:batch], joined)


class LocalBatchStatistics:
    """Batch statistics of a program without synchronized BatchNorm: each lane's layers
    compute them on the rows they see (no context needed)."""

    def begin_trace(self) -> None:
        """Called once at the start of every traced training step."""
        return

    def forward(self, li: int, stage: int, micro_batch, mask):
        """A context around lane li's forward of (stage, micro_batch); `mask`: 1 on the
        micro-batch's real rows, 0 on rows added to fill the batch (None: all real)."""
        return contextlib.nullcontext()

    def backward(self, li: int, stage: int, micro_batch, mask):
        """A context around the matching backward (a recomputed forward runs in it)."""
        return contextlib.nullcontext()

    def traced_mask(self, stage: int):
        """The row mask that the open forward context of `stage` makes its layers read
        (None: they read none). An XLA-compiled stage (`compiled_stage_call`) takes it as
        an argument and installs it again inside its function (`installed_mask`): the
        function's traces are shared by every micro-batch and lane, so a mask its first
        trace captured would stand for all of them."""
        return None

    def installed_mask(self, stage: int, mask):
        """A context in which `stage`'s layers read `mask` (see `traced_mask`)."""
        return contextlib.nullcontext()


@dataclasses.dataclass
class StepHooks:
    """Named slots of the training, evaluation and prediction steps.

    Attributes:
      stage_calls: per stage, how its training forward runs: `(variables,
        non_trainable, args, training) -> (outputs, new non-trainable, aux losses)`
        (a plain stateless call, recomputed segments, or split layers on shards).
      eval_stage_calls: per stage, the forward of evaluate / predict (never recomputed).
      loss_fn: the loss of one micro-batch: `(labels, y_pred, sample_weight) -> scalar`,
        and `.terms(labels, y_pred, sample_weight) -> [objective.LossTerm]`, each
        output's weighted sum and divisor, which the step divides once for the global
        batch (objective.py).
      update: `(lane_grads) -> None`: reduces and applies the gradients (the update
        pass: replicated, ZeRO, wrapped by the finiteness check).
      update_metrics: `(labels, y_pred, loss, mask, rows) -> None` for one
        micro-batch's running metrics (`mask`: real rows, `rows`: their count); the
        non-finite guard filters it.
      lanes: the lane hooks (`ReplicatedLanes`, or split's `SplitLanes`).
      output_cast: applied to outputs and auxiliary losses before the loss and metrics
        (AMP: float32).
      loss_scale: None, or a callable giving the loss scale (AMP).
      extra_logs: name -> callable giving a tensor, added to every step's logs.
      recomputed: stage -> RecomputedStage (gradient checkpointing), for the summary and
        the gradient check.
      gradient_sink: None, or where the lane executors hand each micro-batch's dense
        gradients instead of accumulating them (ZeRO v1: `zero.MicroBatchGradients`).
      gather_per_segment: stage -> a factory `(parameters, watch) -> gathers` for the
        stages whose forward gets its parameters as gathers instead of values (ZeRO v2
        with gradient checkpointing: `zero.SegmentGathers`, gathered segment by segment,
        again in backward). The gathers' `sources` are the (position, value) pairs the
        tape watched, whose gradients the lane reduces.
      micro_batch_loop: whether a lane of one stage may run its micro-batches as a loop
        in the graph (program.py); False when a pass emits collectives per micro-batch
        inside the forward (split layers).
      fixed_batch_shape: whether a shorter batch must be filled up to the widest one
        seen (split layers: their collectives gather activations, and TF fixes a
        collective's shape by its key, which one trace reuses).
      lanes_in_lockstep: emit every lane's task t before any lane's task t+1
        (program.py), also without a gradient sink: synchronized BatchNorm joins the same
        task of every lane inside it.
      batch_statistics: contexts around each lane's forward and backward of a (stage,
        micro-batch): `LocalBatchStatistics`, or synchronized BatchNorm's
        (sync_batch_norm.py).
      stopping_steps: None, or a callable giving the count of steps that stop training
        (non-finite steps the trainer raises on); a call of several steps
        (`steps_per_execution`) leaves its loop once the count grows, so the weights
        are those before that step and the trainer names it.
      task_clock: None, or a `pipeline.TaskClock` that times each local task of the
        training step (the executed schedule: bench/pipeline_procs.py); set before the
        first trace.
    """

    stage_calls: list
    eval_stage_calls: list
    loss_fn: Callable
    update: Callable | None = None
    update_metrics: Callable | None = None
    lanes: ReplicatedLanes = dataclasses.field(default_factory=ReplicatedLanes)
    output_cast: Callable = identity
    loss_scale: Callable | None = None
    extra_logs: dict = dataclasses.field(default_factory=dict)
    recomputed: dict = dataclasses.field(default_factory=dict)
    gradient_sink: object = None
    gather_per_segment: dict = dataclasses.field(default_factory=dict)
    micro_batch_loop: bool = True
    fixed_batch_shape: bool = False
    lanes_in_lockstep: bool = False
    batch_statistics: LocalBatchStatistics = dataclasses.field(default_factory=LocalBatchStatistics)
    stopping_steps: Callable | None = None
    task_clock: object = None
