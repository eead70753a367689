"""Collectives issued lane by lane, by split layers inside one lane's forward.

Data-parallel reductions (fusion.py) see every local member at once. A split layer
instead runs inside one lane's forward: each lane's ops are traced separately, so the
members of one collective are created at different points of the program. They still
meet because every lane of a group issues the same sequence of collectives: the t-th one
of each lane uses instance key `first_key + t`.
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
    on statistics whose gradient the caller defines).
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
                    received = self._exchange(upstream)  # chunk m: member m's upstream rows
                    chunks = tf.reshape(received, [self.size, -1, *upstream.shape[1:]])
                    return tf.reduce_sum(chunks, axis=0)

            return out, grad

        return gather(x)

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
            return tf.raw_ops.CollectiveReduceV2(
                input=tf.stop_gradient(x),
                merge_op="Add" if op == "sum" else "Max",
                final_op="Id",
                **self._common(),
            )
