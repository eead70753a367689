"""The split pass: plugs split layers (split.py) into the step through its hooks.

Split layers run on each lane's shards (`split_stage_call`), split outputs get the
sharded loss (`SplitLoss`), and `SplitLanes` takes the lane hooks' slots: the current
lane while a lane is traced, the reduction of sharded gradients over the lanes that hold
the same shard, their share of the global norm, accuracy from a distributed argmax, and
predictions joined from the lanes' class slices.
"""

from __future__ import annotations

import itertools

import tensorflow as tf
from keras import tree

from epl_trainer.core import comm
from epl_trainer.core.engine.hooks import ReplicatedLanes, StepHooks
from epl_trainer.core.engine.layout import StepLayout
from epl_trainer.core.engine.pipeline import training_kwargs
from epl_trainer.core.engine.split import layers as split
from epl_trainer.core.engine.update import scaled, sum_of_squares


class SplitLanes(ReplicatedLanes):
    """Lane hooks of a program with split layers.

    Args:
      runtime: the split layers and each local lane's collectives.
      layout: the step layout.
      communication: the `communication` config section.
    """

    def __init__(self, runtime: split.SplitRuntime, layout: StepLayout, communication):
        self.runtime = runtime
        self.layout = layout
        self.method = communication.gradients_reduce_method
        self.max_splits = communication.max_splits
        self.wire_fp16_scale = communication.fp16_scale if communication.fp16 else None

    def lane(self, li: int):
        return self.runtime.lane(li)

    def begin_trace(self) -> None:
        self.runtime.begin_trace()

    def reduce_sharded(self, lane_grads: list[list], reduced: list[list]) -> None:
        """Sharded gradients: summed over the lanes holding the same shard (one per
        replica), divided by the job's lane count for "mean" (see split.py). Rows of a
        gathered table (IndexedSlices) are gathered as rows, as data parallelism does."""
        layout, runtime = self.layout, self.runtime
        everyone = layout.everyone
        scale = 1.0 / everyone.size
        mean = self.method == "mean"
        # Laid out over the batch axis too: their gather's gradient summed every lane's.
        job_summed = [i for i, spec in layout.state.sharded.items() if spec.summed_over_job]
        sharded = [i for i in sorted(layout.state.sharded) if i not in job_summed]
        stage_of = layout.state.trainable_stage
        for li, grads in enumerate(lane_grads):
            for i in job_summed:
                with tf.device(layout.lanes[li].devices[stage_of[i]]):
                    reduced[li][i] = scaled(grads[i], scale) if mean else grads[i]
        for rank, k in itertools.product(range(runtime.width), range(layout.num_stages)):
            members = [li for li in range(len(layout.lanes)) if runtime.shard_rank(li) == rank]
            of_stage = [i for i in sharded if stage_of[i] == k]
            if not members or not of_stage:
                continue
            # Stage k's devices of every lane of the job (its group's), rank `rank`'s.
            stage_devices = layout.stage_groups[k].devices
            job_devices = tuple(
                d for position, d in enumerate(stage_devices) if position % runtime.width == rank
            )
            group = comm.CollectiveGroup(
                job_devices, tuple(layout.lanes[li].devices[k] for li in members)
            )
            first = lane_grads[members[0]]
            dense = [i for i in of_stage if not isinstance(first[i], tf.IndexedSlices)]
            per_member = [[lane_grads[li][i] for i in dense] for li in members]
            buckets = comm.plan_buckets(
                [_num_bytes(g) for g in per_member[0]],
                [g.dtype for g in per_member[0]],
                self.max_splits,
            )
            results = comm.fused_all_reduce(
                group, per_member, buckets, "sum", wire_fp16_scale=self.wire_fp16_scale
            )
            for li, grads in zip(members, results):
                for i, g in zip(dense, grads):
                    with tf.device(layout.lanes[li].devices[k]):
                        reduced[li][i] = g * tf.cast(scale, g.dtype) if mean else g
            for i in sorted(set(of_stage) - set(dense)):
                gathered = comm.all_gather_slices(
                    group, [lane_grads[li][i] for li in members], "sum"
                )
                for li, g in zip(members, gathered):
                    with tf.device(layout.lanes[li].devices[k]):
                        reduced[li][i] = scaled(g, scale) if mean else g

    def shard_norm_squares(self, li: int, grads: list) -> list:
        """Lane li's squared norm of every sharded gradient: its replica's slices summed
        over the replica's lanes; blocks laid out over the batch axis too counted once
        (on their lowest holder) and summed over the job."""
        specs = self.layout.state.sharded
        if not specs:
            return []
        lane = self.layout.lanes[li].index
        own = [i for i, spec in specs.items() if not spec.summed_over_job]
        held = [
            i
            for i, spec in specs.items()
            if spec.summed_over_job and spec.holder_of_id(spec.block_id(lane)) == lane
        ]
        # Outside a stage the runtime's collectives are the last stage's (SplitRuntime).
        with self.lane(li), tf.device(self.runtime.active.device):
            total = self.runtime.active.reduce(_sum_of_squares(grads, own), "sum")
            if any(spec.summed_over_job for spec in specs.values()):
                blocks = self.runtime.active.reduce(_sum_of_squares(grads, held), "sum")
                total += self.runtime.active_batch.reduce(blocks, "sum")
            return [total]

    def update_output_metric(self, index: int, metric, y_true, y_pred, sample_weight) -> bool:
        if index not in self.runtime.dense_outputs():
            return False
        split.update_split_accuracy(metric, y_true, y_pred, self.runtime.active, sample_weight)
        return True

    def join_predictions(self, lane_outputs: list, batch):
        """Rows of every lane, in lane order; a split output's class slices are joined
        per replica (each lane holds its classes for all of the replica's rows)."""
        width = self.runtime.width
        split_outputs = self.runtime.dense_outputs()
        flat = [tree.flatten(o) for o in lane_outputs]
        joined = []
        for index in range(len(flat[0])):
            pieces = [f[index] for f in flat]
            if index in split_outputs:
                replicas = [
                    tf.concat(pieces[r : r + width], axis=-1) for r in range(0, len(pieces), width)
                ]
                value = tf.concat(replicas, axis=0)
                if split_outputs[index].softmax:
                    value = tf.nn.softmax(value)
            else:
                value = tf.concat(pieces, axis=0)
            joined.append(value[:batch])
        return tree.pack_sequence_as(lane_outputs[0], joined)


def apply_split(
    hooks: StepHooks, layout: StepLayout, split_layers, lanes_in_job, width: int, communication
) -> None:
    """Split layers run on the lane's shards; split outputs get the sharded loss."""
    runtime = split.SplitRuntime(
        split_layers, layout.lanes, lanes_in_job, width, num_stages=layout.num_stages
    )
    hooks.lanes = SplitLanes(runtime, layout, communication)
    # A split layer's collectives get their instance keys while tracing (split.py), one
    # per traced call: a loop over micro-batches would reuse them on every iteration.
    hooks.micro_batch_loop = False
    hooks.fixed_batch_shape = True  # the lanes gather rows: one shape per collective key
    # A subclassed model has no `outputs` (and no split output: those need its graph).
    outputs = getattr(layout.staged.model, "outputs", None)
    num_outputs = len(tree.flatten(outputs)) if outputs is not None else 0
    hooks.loss_fn = split.SplitLoss(hooks.loss_fn, runtime, num_outputs)
    for k, stage in enumerate(layout.staged.stages):
        call = split.split_stage_call(
            stage.model, runtime, training_kwargs, stage=k, indices=layout.read_idx[k]
        )
        hooks.stage_calls[k] = call
        hooks.eval_stage_calls[k] = call


def _sum_of_squares(grads: list, indices: list[int]):
    """The float32 sum of the squares of `grads[i]` for i in `indices` (0 for none)."""
    return tf.add_n(
        [tf.cast(sum_of_squares(grads[i]), tf.float32) for i in indices] or [tf.zeros([])]
    )


def _num_bytes(tensor) -> int:
    return int(tensor.shape.num_elements()) * tensor.dtype.size
