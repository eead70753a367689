"""How a sharded trainable variable is held over the lanes: which block each lane holds,
how blocks join into the whole, and (for variables gathered on use) the gather.

Lanes are batch-major: global lane l is rank `l % width` of replica `l // width`, the
replica being a Keras mesh's batch coordinate and the rank its model coordinate.

- `ShardedVariable`: `num_shards` slices along one dimension over each replica's lanes
  (split layers' shards, and a Keras layout's model-axis sharding gathered on use); the
  replicas hold the same slices.
- `LaidOutVariable`: a Keras layout that also shards over the batch axis: a block per
  (replica, rank) coordinate along up to two dimensions, `dim / size(axis)` on each, as
  KerasHub's maps lay out `("model", "batch", None)`; gathered whole on use.

Both answer the same questions (the engine state, checkpoints and the optimizer state's
write-back ask them): `block_id(lane)`, `block_count`, `holder_of_id(k, lane)` (the
lowest lane holding block k among the lanes `lane` joins with; `holders(lane)` all of
them), `block_of_id(value, k)` and `join(blocks)` (blocks in id order).
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from epl_trainer.core import comm


def _slice(value, axis: int, parts: int, position: int):
    size = value.shape[axis] // parts
    begin = [0] * len(value.shape)
    begin[axis] = position * size
    shape = [-1 if d is None else d for d in value.shape]  # -1: the rest of a dimension
    shape[axis] = size
    return tf.slice(value, begin, shape)


class _Blocks:
    """What both specs derive from the protocol."""

    def holders(self, lane_index: int) -> list[int]:
        """The lanes `lane_index` joins with to make the whole, by block id."""
        return [self.holder_of_id(k, lane_index) for k in range(self.block_count)]


@dataclasses.dataclass(frozen=True)
class ShardedVariable(_Blocks):
    """A trainable variable held as `num_shards` slices along `axis`, one per rank."""

    index: int  # position in model.trainable_variables
    axis: int
    num_shards: int
    # The gradient arrives summed over the replica's lanes only; the replicas' sums are
    # added by the lane hooks (split/lanes.py `reduce_sharded`).
    summed_over_job = False

    def slice(self, value, rank: int):
        return _slice(value, self.axis, self.num_shards, rank)

    @property
    def block_count(self) -> int:
        return self.num_shards

    def block_id(self, lane_index: int) -> int:
        return lane_index % self.num_shards

    def holder_of_id(self, block: int, lane_index: int) -> int:
        """The lane of `lane_index`'s replica holding slice `block`."""
        return lane_index - lane_index % self.num_shards + block

    def block_of_id(self, value, block: int):
        return self.slice(value, block)

    def join(self, blocks):
        return tf.concat(list(blocks), axis=self.axis)


@dataclasses.dataclass(frozen=True)
class LaidOutVariable(_Blocks):
    """A trainable variable held in blocks over the (replica, rank) grid: dimension
    `model_axis` (or None) sliced over a replica's `width` lanes, dimension `batch_axis`
    over the `replicas`. Lanes whose coordinates agree on the sharded axes hold the same
    block. Gathered whole on use (`gather`); its gradient arrives summed over every lane
    of the job."""

    index: int
    model_axis: int | None
    batch_axis: int
    width: int
    replicas: int
    summed_over_job = True

    @property
    def _model_parts(self) -> int:
        return self.width if self.model_axis is not None else 1

    @property
    def block_count(self) -> int:
        return self._model_parts * self.replicas

    def block_id(self, lane_index: int) -> int:
        replica, rank = divmod(lane_index, self.width)
        return replica * self._model_parts + (rank if self.model_axis is not None else 0)

    def holder_of_id(self, block: int, lane_index: int = 0) -> int:
        """The lowest lane holding block `block` (every lane joins with the same ones)."""
        replica, rank = divmod(block, self._model_parts)
        return replica * self.width + rank

    def block_of_id(self, value, block: int):
        replica, rank = divmod(block, self._model_parts)
        if self.model_axis is not None:
            value = _slice(value, self.model_axis, self.width, rank)
        return _slice(value, self.batch_axis, self.replicas, replica)

    def join(self, blocks):
        blocks = list(blocks)
        parts = self._model_parts
        rows = [blocks[r * parts : (r + 1) * parts] for r in range(self.replicas)]
        if self.model_axis is not None:
            rows = [[tf.concat(row, axis=self.model_axis)] for row in rows]
        return tf.concat([row[0] for row in rows], axis=self.batch_axis)

    def gather(self, value, model_comm, batch_comm):
        """The whole variable from this lane's block: gathered over the replica's lanes
        along `model_axis`, then over the replicas along `batch_axis`.

        Gradient: its adjoint, this lane's block of the upstream summed over every lane
        of the job (reduce-scatters along the sharded dimensions; an all-reduce over the
        replica's lanes where the block repeats across them). Rows of a table read by
        lookups (IndexedSlices) stay rows: every lane's (index, row) pairs, this block's
        part of them (`LaneCollectives.gather_along`'s rule).
        """

        @tf.custom_gradient
        def gather(block):
            with tf.device(model_comm.device):
                whole = block
                if self.model_axis is not None:
                    whole = model_comm.join_blocks(whole, self.model_axis)
                whole = batch_comm.join_blocks(whole, self.batch_axis)

            def grad(upstream):
                with tf.device(model_comm.device):
                    if isinstance(upstream, tf.IndexedSlices):
                        return self._rows_of_block(upstream, block.shape, model_comm, batch_comm)
                    upstream = tf.ensure_shape(upstream, whole.shape)
                    summed = batch_comm.sum_own_block(upstream, self.batch_axis)
                    if self.model_axis is not None:
                        return model_comm.sum_own_block(summed, self.model_axis)
                    return model_comm.reduce(summed, "sum")

            return whole, grad

        return gather(value)

    def gather_batch(self, value, batch_comm):
        """This lane's model-axis block, whole over the batch axis: what a layer computed
        on the lane's share reads (split/decoder_blocks.py).

        Gradient: this lane's block of the upstream summed over the replicas (the
        all-gather's adjoint). The lanes of a replica hold different model-axis blocks,
        so that is the sum over every lane of the job that `summed_over_job` promises.
        """

        @tf.custom_gradient
        def gather(block):
            with tf.device(batch_comm.device):
                whole = batch_comm.join_blocks(block, self.batch_axis)

            def grad(upstream):
                with tf.device(batch_comm.device):
                    upstream = tf.ensure_shape(upstream, whole.shape)
                    return batch_comm.sum_own_block(upstream, self.batch_axis)

            return whole, grad

        return gather(value)

    def _rows_of_block(self, slices, block_shape, model_comm, batch_comm):
        indices, values = slices.indices, slices.values
        for group in (model_comm, batch_comm):  # every lane's pairs
            indices, values = group.gather_rows(indices), group.gather_rows(values)
        positions = {self.batch_axis: batch_comm.rank}
        if self.model_axis is not None:
            positions[self.model_axis] = model_comm.rank
        return comm.rows_in_block(indices, values, slices, block_shape, positions)
