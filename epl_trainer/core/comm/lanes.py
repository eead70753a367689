"""Collectives issued lane by lane, by split layers inside one lane's forward.

Data-parallel reductions (fusion.py) see every local member at once. A split layer
instead runs inside one lane's forward: each lane's ops are traced separately, so the
members of one collective are created at different points of the program. They still
meet because every lane of a group issues the same sequence of collectives: the t-th one
of each lane uses instance key `first_key + t`.

The tensor-parallel operators are Megatron-LM's (megatron/core/tensor_parallel/mappings.py):
`copy_to_group` (f), `reduce_from_group` (g), `scatter_to_group` and `gather_from_group`. A
column-parallel layer reads its replicated input through f, a row-parallel one returns its
partial product through g, so a column/row pair costs one all-reduce forward (g's) and one
backward (f's).
"""

from __future__ import annotations

import tensorflow as tf

from epl_trainer.core.comm.group import CollectiveGroup
from epl_trainer.core.comm.keys import KEYS_PER_LANE_GROUP, ordering_token


class LaneCollectives:
    """One lane's side of the collectives among a fixed group of lanes.

    Args:
      group: the member devices (each lane's device, one per lane); `local_devices` is
        this lane's device alone.
      first_key: the instance key of this lane's first collective (shared by the group).
      limit: how many collectives the group may issue from `first_key`.
      chain: the ordering-token chain to use.

    `gather_rows` and `all_to_all` are differentiable (an all-gather's adjoint is a
    reduce-scatter, an all-to-all's is the all-to-all back); `reduce` is not (it is used
    on statistics whose gradient the caller defines). The tensor-parallel operators
    `copy_to_group`, `reduce_from_group`, `scatter_to_group` and `gather_from_group` are
    differentiable as Megatron defines them: what is replicated over the members (an
    operator's replicated input, or the value a gather or reduce returns) stands for one
    tensor, computed alike by every member, and each member's gradient of it is its share of
    the one loss.

    Keys and the order of calls: a collective takes its instance key from a per-lane
    counter when it is traced, and a backward collective when its gradient is traced
    (`tape.gradient`). Members pair their t-th collectives, so every member must trace the
    same collectives in the same order, in the forward and in the backward:
    - the same operators on the same shapes, in the same order, in its forward;
    - the same gradients (the same `tape.gradient` calls, in the same order, over the
      same sources): a member that differentiates a path another does not, or twice
      (a persistent tape asked again), shifts its keys, and the members then wait on
      different instances, which hangs the step;
    - every member's computation in one program (one `tf.function`): a collective only
      completes when all its members run;
    - new `LaneCollectives` for each trace (as `SplitRuntime.begin_trace` makes): the
      counter is Python state, so a function traced again (its first trace creating the
      ordering-token variables is one such) would go on from the keys the last trace took.
    Floating inputs are differentiated, integer ones are not (their operators are the
    forward alone). bfloat16 is reduced natively: CollectiveReduceV2 has a CPU kernel for
    it (TF 2.21); gathers carry it bit-cast as float16 (no bfloat16 gather kernel).
    """

    def __init__(self, group: CollectiveGroup, first_key: int, limit: int = KEYS_PER_LANE_GROUP):
        if len(group.local_devices) != 1:
            raise ValueError(
                f"LaneCollectives needs exactly one local member. Received: {group.local_devices}"
            )
        self.group = group
        self.device = group.local_devices[0]
        self.rank = group.rank_of(self.device)
        self._first_key, self._limit, self._issued = first_key, limit, 0

    @property
    def size(self) -> int:
        return self.group.size

    def _next_key(self) -> int:
        if self._issued >= self._limit:
            raise RuntimeError(
                f"A lane issued more than {self._limit} split collectives in one program."
            )
        self._issued += 1
        return self._first_key + self._issued - 1

    def _common(self) -> dict:
        return dict(
            group_size=self.size,
            group_key=self.group.key,
            instance_key=self._next_key(),
            ordering_token=[ordering_token(self.device, 0)],
            communication_hint="auto",
        )

    def _gather(self, x):
        wire = tf.bitcast(x, tf.float16) if x.dtype == tf.bfloat16 else x
        out = tf.raw_ops.CollectiveGatherV2(input=wire, **self._common())
        out = tf.bitcast(out, tf.bfloat16) if x.dtype == tf.bfloat16 else out
        if x.shape[0] is not None:
            out = tf.ensure_shape(out, [x.shape[0] * self.size, *x.shape[1:]])
        return out

    def _exchange(self, x):
        wire = tf.bitcast(x, tf.float16) if x.dtype == tf.bfloat16 else x
        # The op exchanges element r of axis 0 with member r: one flat row per member.
        rows = tf.reshape(wire, [self.size, -1])
        out = tf.raw_ops.CollectiveAllToAllV2(input=rows, **self._common())
        out = tf.reshape(out, tf.shape(wire))
        out = tf.bitcast(out, tf.bfloat16) if x.dtype == tf.bfloat16 else out
        return tf.ensure_shape(out, x.shape)

    def gather_rows(self, x):
        """Every member's `x` stacked on axis 0 in rank order (same shape on every member).

        Gradient: the upstream rows of this member, summed over the members
        (a reduce-scatter), which is exactly the all-gather's adjoint.
        """
        if self.size == 1:
            return x
        if not x.dtype.is_floating:
            with tf.device(self.device):
                return self._gather(x)

        @tf.custom_gradient
        def gather(value):
            with tf.device(self.device):
                out = self._gather(value)

            def grad(upstream):
                with tf.device(self.device):
                    return self._sum_own_rows(upstream)

            return out, grad

        return gather(x)

    def gather_along(self, x, axis: int):
        """Every member's block `x` joined along `axis` in rank order: a variable held
        sliced over the group, whole for one use (split/layers.py `gather_whole`).

        Gradient: this member's block of the upstream, summed over the members (the
        all-gather's adjoint). An upstream of rows (IndexedSlices: a table read by
        lookups) stays rows: every member's (index, row) pairs are gathered and this
        member's block of them kept, rows outside it zeroed, so a Keras optimizer applies
        them as on one device (Adam squares each row before repeated indices are summed,
        as `communication.sparse_as_dense=False` keeps it under data parallelism).
        """
        if self.size == 1:
            return x

        @tf.custom_gradient
        def gather(value):
            with tf.device(self.device):
                out = self.join_blocks(value, axis)

            def grad(upstream):
                with tf.device(self.device):
                    if isinstance(upstream, tf.IndexedSlices):
                        return self._own_rows_of_slices(upstream, value.shape, axis)
                    return self.sum_own_block(tf.ensure_shape(upstream, out.shape), axis)

            return out, grad

        return gather(x)

    def join_blocks(self, x, axis: int):
        """The members' blocks `x` joined along `axis` in rank order (no gradient of its
        own: `gather_along`'s forward). The blocks arrive stacked on axis 0; one transpose
        puts the members' axis just before `axis`."""
        if self.size == 1:
            return x
        stacked = self._gather(x)
        if axis == 0:
            return stacked
        shape = [int(d) for d in x.shape]
        blocks = tf.reshape(stacked, [self.size, *shape])
        to_axis = [*range(1, axis + 1), 0, *range(axis + 1, len(shape) + 1)]
        whole = [*shape[:axis], shape[axis] * self.size, *shape[axis + 1 :]]
        return tf.reshape(tf.transpose(blocks, to_axis), whole)

    def sum_own_block(self, x, axis: int):
        """This member's block along `axis` of the members' `x`, summed (a reduce-scatter
        along `axis`: `join_blocks`' adjoint; no gradient of its own)."""
        if self.size == 1:
            return x
        if axis == 0:
            return self._sum_own_rows(x)
        shape = [int(d) for d in x.shape]
        block = shape[axis] // self.size
        split = tf.reshape(x, [*shape[:axis], self.size, block, *shape[axis + 1 :]])
        to_front = [axis, *range(axis), *range(axis + 1, len(shape) + 1)]
        stacked = tf.transpose(split, to_front)
        block_shape = [*shape[:axis], block, *shape[axis + 1 :]]
        return self._sum_own_rows(
            tf.reshape(stacked, [self.size * block_shape[0], *block_shape[1:]])
        )

    def _own_rows_of_slices(self, slices: tf.IndexedSlices, block_shape, axis: int):
        """Every member's (index, row) pairs of a table's gradient, this member's block of
        them (`rows_in_block`)."""
        indices, values = self._gather(slices.indices), self._gather(slices.values)
        return rows_in_block(indices, values, slices, block_shape, {axis: self.rank})

    def _sum_own_rows(self, x):
        """Chunk m of axis 0 sent to member m; the chunks received summed (a
        reduce-scatter of rows)."""
        received = self._exchange(x)  # chunk m: member m's chunk of my rows
        chunks = tf.reshape(received, [self.size, -1, *x.shape[1:]])
        return tf.reduce_sum(chunks, axis=0)

    def reduce_scatter_rows(self, x):
        """The members' `x` (the same shape, axis 0 = every member's rows in rank order)
        summed, and this member's rows of the sum: `gather_rows`'s adjoint.

        Gradient: every member's upstream rows stacked in rank order (an all-gather).
        """
        if self.size == 1:
            return x
        if x.shape[0] is not None and x.shape[0] % self.size:
            raise ValueError(
                f"reduce_scatter_rows needs axis 0 divisible by the group size. Received: "
                f"shape {x.shape}, group_size={self.size}"
            )

        @tf.custom_gradient
        def reduce_scatter(value):
            with tf.device(self.device):
                out = self._sum_own_rows(value)

            def grad(upstream):
                with tf.device(self.device):
                    return self._gather(upstream)

            return out, grad

        return reduce_scatter(x)

    def all_to_all(self, x):
        """Chunk r of axis 0 goes to the member of rank r; received chunks are stacked by
        the sender's rank. Its own adjoint."""
        if self.size == 1:
            return x
        if x.shape[0] is not None and x.shape[0] % self.size:
            raise ValueError(
                f"all_to_all needs axis 0 divisible by the group size. Received: shape "
                f"{x.shape}, group_size={self.size}"
            )
        if not x.dtype.is_floating:
            with tf.device(self.device):
                return self._exchange(x)

        @tf.custom_gradient
        def exchange(value):
            with tf.device(self.device):
                out = self._exchange(value)

            def grad(upstream):
                with tf.device(self.device):
                    return self._exchange(upstream)

            return out, grad

        return exchange(x)

    def reduce(self, x, op: str = "sum"):
        """Element-wise "sum" or "max" over the members (no gradient)."""
        if op not in ("sum", "max"):
            raise ValueError(f"op must be 'sum' or 'max'. Received: {op!r}")
        if self.size == 1:
            return x
        with tf.device(self.device):
            return self._all_reduce(tf.stop_gradient(x), "Add" if op == "sum" else "Max")

    # ---- Megatron's tensor-parallel operators ----------------------------------------------

    def copy_to_group(self, x):
        """Megatron's f: `x` itself; its gradient is the upstream summed over the members.

        For a replicated `x` read by each member's shard of a column-parallel layer: each
        member's upstream is its shard's part of d loss / d x. Call it once per tensor and
        reuse the result: consumers of one result (query, key and value of one input) have
        their gradients summed by the tape before f's, so they share one all-reduce.
        """
        if self.size == 1 or not x.dtype.is_floating:
            return x

        @tf.custom_gradient
        def copy(value):
            with tf.device(self.device):
                out = tf.identity(value)
            return out, lambda upstream: self._all_reduce(upstream)

        return copy(x)

    def reduce_from_group(self, x):
        """Megatron's g: `x` summed over the members; its gradient is the upstream itself.

        For the partial products of a row-parallel layer: the sum is replicated, so every
        member's upstream is the whole gradient of each partial product.
        """
        if self.size == 1:
            return x
        if not x.dtype.is_floating:
            return self._all_reduce(x)

        @tf.custom_gradient
        def reduce(value):
            def grad(upstream):
                with tf.device(self.device):
                    return tf.identity(upstream)

            return self._all_reduce(value), grad

        return reduce(x)

    def scatter_to_group(self, x, axis: int):
        """This member's slice of `axis` (rank r keeps chunk r of `size` equal chunks).

        Gradient: the members' upstream slices gathered along `axis` in rank order, i.e.
        d loss / d x of a replicated `x` of which each member used its own slice.

        Raises:
          ValueError: `x`'s rank is unknown, `axis` is out of its range, or its length does
            not divide by the group size (a length unknown until run time is checked then).
        """
        axis = self._dimension("scatter_to_group", x, axis)
        length = x.shape[axis]
        if length is not None and length % self.size:
            raise ValueError(
                f"scatter_to_group needs the length of axis {axis} to divide by the group "
                f"size. Received: shape {x.shape}, axis={axis}, group_size={self.size}"
            )
        if self.size == 1:
            return x
        if length is None:
            x = self._check_divides(x, axis)
        if not x.dtype.is_floating:
            return self._own_slice(x, axis, self._length(x, axis) // self.size)

        @tf.custom_gradient
        def scatter(value):
            out = self._own_slice(value, axis, self._length(value, axis) // self.size)
            return out, lambda upstream: self._gather_along(upstream, axis)

        return scatter(x)

    def gather_from_group(self, x, axis: int):
        """Every member's `x` concatenated along `axis` in rank order.

        Gradient: this member's slice of the upstream along `axis`: the gathered value is
        replicated, so each member's upstream is the whole gradient of it.

        Raises:
          ValueError: `x`'s rank is unknown or `axis` is out of its range.
        """
        axis = self._dimension("gather_from_group", x, axis)
        if self.size == 1:
            return x
        if not x.dtype.is_floating:
            return self._gather_along(x, axis)

        @tf.custom_gradient
        def gather(value):
            def grad(upstream):
                return self._own_slice(upstream, axis, self._length(value, axis))

            return self._gather_along(value, axis), grad

        return gather(x)

    def _all_reduce(self, x, merge_op: str = "Add"):
        with tf.device(self.device):
            return tf.raw_ops.CollectiveReduceV2(
                input=x, merge_op=merge_op, final_op="Id", **self._common()
            )

    def _gather_along(self, x, axis: int):
        with tf.device(self.device):
            # CollectiveGatherV2 concatenates on axis 0: stack the members on a new leading
            # axis, move it just before `axis` and merge the two.
            stacked = self._gather(x[tf.newaxis])
            rank = x.shape.rank
            if axis:
                order = [*range(1, axis + 1), 0, *range(axis + 1, rank + 1)]
                stacked = tf.transpose(stacked, order)
            lengths = [self._length(x, dim) for dim in range(rank)]
            lengths[axis] = lengths[axis] * self.size
            return tf.reshape(stacked, lengths)

    def _own_slice(self, x, axis: int, chunk):
        rank = x.shape.rank
        begin, lengths = [0] * rank, [-1] * rank
        begin[axis], lengths[axis] = self.rank * chunk, chunk
        with tf.device(self.device):
            return tf.slice(x, begin, lengths)

    def _check_divides(self, x, axis: int):
        with tf.device(self.device):
            check = tf.debugging.assert_equal(
                tf.shape(x)[axis] % self.size,
                0,
                message=f"scatter_to_group needs the length of axis {axis} to divide by the "
                f"group size. Received: shape {x.shape}, axis={axis}, group_size={self.size}",
            )
            with tf.control_dependencies([check]):
                return tf.identity(x)

    @staticmethod
    def _length(x, dim: int):
        """The static length of `dim` if known, else the run-time one."""
        return x.shape[dim] if x.shape[dim] is not None else tf.shape(x)[dim]

    @staticmethod
    def _dimension(name: str, x, axis: int) -> int:
        rank = x.shape.rank
        if rank is None:
            raise ValueError(f"{name} needs a tensor of known rank. Received: shape {x.shape}")
        if not -rank <= axis < rank:
            raise ValueError(
                f"{name}: axis {axis} is out of range for a tensor of rank {rank}. "
                f"Received: shape {x.shape}, axis={axis}"
            )
        return axis % rank


def rows_in_block(indices, values, slices: tf.IndexedSlices, block_shape, positions):
    """The part of a table's (index, row) gradient pairs that falls in one block.

    Args:
      indices, values: every holder's pairs, gathered.
      slices: the local gradient (for its index dtype).
      block_shape: the block's shape.
      positions: {table dimension: the block's position along it}. Along dimension 0 the
        rows the block holds are kept and re-indexed (the others zeroed, at index 0);
        along another its slice of every row.
    """
    keep = tf.ones_like(indices, dtype=tf.bool)
    for axis, position in positions.items():
        size = int(block_shape[axis])
        if axis == 0:
            local = indices - tf.cast(position * size, indices.dtype)
            keep = tf.logical_and(keep, tf.logical_and(local >= 0, local < size))
            indices = tf.where(keep, local, tf.zeros_like(local))
        else:
            begin = [0] * values.shape.rank
            begin[axis] = position * size
            lengths = [-1] * values.shape.rank
            lengths[axis] = size
            values = tf.slice(values, begin, lengths)
    mask = tf.reshape(tf.cast(keep, values.dtype), [-1] + [1] * (values.shape.rank - 1))
    dense_shape = tf.constant([int(d) for d in block_shape], slices.dense_shape.dtype)
    return tf.IndexedSlices(values * mask, indices, dense_shape)
