"""Gradient reduction across lanes and global-norm clipping (`communication.*`).

Each stage's gradients are all-reduced over every lane of the job holding that stage, in
fused buckets (`communication.max_splits`, spread over `num_communicators` ordering
chains, optionally on a float16 wire); sparse gradients (an Embedding's IndexedSlices)
are all-gathered as rows unless `sparse_as_dense`. Split layers' sharded gradients are
reduced by the lane hooks. Clipping by the optimizer's `global_clipnorm` spans all
stages, before the reduction (EPL's default) or after it (`clip_after_allreduce`).
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from epl_trainer.core import comm
from epl_trainer.core.engine.hooks import ReplicatedLanes
from epl_trainer.core.engine.layout import StepLayout


class GradientReduction:
    """Reduces and clips one step's gradients.

    Args:
      layout: the step layout.
      communication: the `communication` config section.
      lane_hooks: the program's lane hooks (split layers reduce their shards there).
      clip_global_norm: the optimizer's `global_clipnorm`, or None.
    """

    def __init__(
        self,
        layout: StepLayout,
        communication,
        lane_hooks: ReplicatedLanes,
        clip_global_norm: float | None = None,
    ):
        self.layout = layout
        self.method = communication.gradients_reduce_method  # "mean" | "sum"
        self.max_splits = communication.max_splits
        self.num_communicators = communication.num_communicators
        # communication.fp16: float32 gradients cross as float16, scaled by this.
        self.wire_fp16_scale = communication.fp16_scale if communication.fp16 else None
        self.lane_hooks = lane_hooks
        self.clip_global_norm = clip_global_norm
        clipping = clip_global_norm is not None
        self.clip_before = clipping and not communication.clip_after_allreduce
        self.clip_after = clipping and communication.clip_after_allreduce

    def plan_buckets(self, indices: Sequence[int]) -> list[list[int]]:
        """Buckets (positions into `indices`) of at most max_splits per dtype."""
        variables = [self.layout.state.model_trainable[i] for i in indices]
        sizes = [int(v.value.shape.num_elements()) * v.value.dtype.size for v in variables]
        return comm.plan_buckets(sizes, [v.dtype for v in variables], self.max_splits)

    def all_reduce(self, lane_grads: list[list]) -> list[list]:
        """All-reduces each stage's gradients over every lane of the job.

        Launched in the order backward produces the gradients: the last stage first,
        and in each stage the bucket of its last layers first, so each collective can
        start while backward is still computing the earlier layers. Sparse gradients
        (usually the first layer's embedding, whose gradient comes last) follow.
        """
        layout = self.layout
        reduced = [list(grads) for grads in lane_grads]
        self.lane_hooks.reduce_sharded(lane_grads, reduced)
        for k in reversed(range(layout.num_stages)):
            group, members = layout.stage_groups[k], layout.stage_lanes[k]
            if not members:  # the stage runs on other workers only
                continue
            first = lane_grads[members[0]]
            idx = [i for i in layout.reduced_idx[k] if not _is_slices(first[i])]
            per_member = [[lane_grads[li][i] for i in idx] for li in members]
            buckets = sorted(self.plan_buckets(idx), key=max, reverse=True)  # last layers first
            results = comm.fused_all_reduce(
                group,
                per_member,
                buckets,
                self.method,
                num_chains=self.num_communicators,
                wire_fp16_scale=self.wire_fp16_scale,
            )
            for li, stage_grads in zip(members, results):
                for i, g in zip(idx, stage_grads):
                    reduced[li][i] = g
            for i in reversed(layout.reduced_idx[k]):
                if _is_slices(first[i]):
                    gathered = comm.all_gather_slices(
                        group, [lane_grads[li][i] for li in members], self.method
                    )
                    for li, g in zip(members, gathered):
                        reduced[li][i] = g
        return reduced

    def clip(self, li: int, grads: list) -> list:
        """Global-norm clipping over all stages of a lane (the optimizer's global_clipnorm).

        With split layers the norm adds every shard's squares (a sum over the replica's
        lanes), so it is the norm of the whole model's gradient.
        """
        layout = self.layout
        lane = layout.lanes[li]
        squares = []
        local_stages = layout.local_stages(li)
        for k in local_stages:
            with tf.device(lane.devices[k]):
                stage_grads = [grads[i] for i in layout.reduced_idx[k]]
                if stage_grads:
                    squares.append(tf.add_n([sum_of_squares(g) for g in stage_grads]))
        squares += self.lane_hooks.shard_norm_squares(li, grads)
        first = lane.devices[local_stages[0]]
        with tf.device(first):
            total = tf.add_n(squares) if squares else tf.constant(0.0)
        total = sum_over_lane(layout, li, total)  # the other workers' stages add theirs
        with tf.device(first):
            norm = tf.sqrt(total)
            factor = self.clip_global_norm / tf.maximum(norm, self.clip_global_norm)
        clipped = []
        for g, stage in zip(grads, layout.state.trainable_stage):
            if g is None:  # a stage on another worker
                clipped.append(None)
                continue
            with tf.device(lane.devices[stage]):
                clipped.append(clipped_by(g, factor))
        return clipped

    def clip_each(self, lane_grads: list[list]) -> list[list]:
        return [self.clip(li, grads) for li, grads in enumerate(lane_grads)]


def sum_over_lane(layout: StepLayout, li: int, value):
    """`value` (a scalar on the lane's first local stage device) summed over the workers
    that hold the lane's stages; `value` itself when the lane is on one worker."""
    lane = layout.lanes[li]
    if not lane.spans_workers:
        return value
    # A device hosting several stages (interleaved 1F1B) is one member.
    local = tuple(dict.fromkeys(lane.devices[k] for k in layout.local_stages(li)))
    group = comm.CollectiveGroup(tuple(dict.fromkeys(lane.devices[: layout.num_stages])), local)
    with tf.device(local[0]):
        shares = [value] + [tf.zeros_like(value) for _ in local[1:]]
    return group.all_reduce(shares, "sum")[0]


def _is_slices(gradient) -> bool:
    return isinstance(gradient, tf.IndexedSlices)


def sum_of_squares(gradient):
    """Squared norm of a gradient. Slices count row by row (repeated indices are not
    summed first), as Keras's `global_norm` does, so clipping matches `Model.fit`."""
    values = gradient.values if _is_slices(gradient) else gradient
    return tf.reduce_sum(tf.square(values))


def scaled(gradient, factor):
    """`gradient * factor`, keeping IndexedSlices sparse (a mean over replicas, a
    divisor's correction: Keras's own step hands the optimizer an Embedding's gradient as
    slices there too)."""
    if _is_slices(gradient):
        values = gradient.values * tf.cast(factor, gradient.values.dtype)
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return gradient * tf.cast(factor, gradient.dtype)


def clipped_by(gradient, factor):
    """`gradient * factor` as global-norm clipping gives it: IndexedSlices come out dense.

    Keras's `clip_by_global_norm` multiplies each gradient by the scale, which turns an
    Embedding's IndexedSlices into a dense tensor (repeated rows summed), so under
    `global_clipnorm` `Model.fit`'s optimizer always updates from a dense gradient. Kept as
    slices, Keras's Adam squares each repeated row's slice separately (its `square` of
    IndexedSlices), so the second moment and the embedding update differed from
    `Model.fit`: 1.3e-2 on the table after one Adam step of 16 rows of 5 tokens.
    """
    if _is_slices(gradient):
        gradient = tf.convert_to_tensor(gradient)
    return gradient * tf.cast(factor, gradient.dtype)
