"""Point-to-point transfers between two devices of different workers (pipeline stages).

A pipeline replica whose stages live in different worker processes passes activations
forward and their gradients backward across the process boundary. Both sides build the
same transfer at the same point of the schedule: a two-member collective group (the
sender's and the receiver's device), its keys counted per group (keys.py), ordered on
each device by its ordering token, like every other collective of the engine.

TensorFlow's `CollectiveBcastSendV2/RecvV2` take no ordering token, and V2 collectives
without one deadlock inside a `tf.function` (docs/architecture.md); so a transfer is a
`CollectiveGatherV2` of two equal-shaped members, the receiver contributing zeros and
keeping the sender's half. That moves the tensor's bytes once in each direction (the
zeros travel back): the price of ordering, paid only across workers.

A gather completes on neither side before both have started it, so a transfer is a
meeting of the two workers. Transfers therefore have chains of their own on each
device (`keys.TRANSFER_CHAINS`), one for what it sends and one for what it receives,
apart from each other and from the group collectives' chains: a receive starts as soon
as the one before it on its chain is done, usually long before its tensor is sent, and
the sender's side completes as soon as it starts. On one chain for everything, each
transfer waited for the other worker to reach the same point of the schedule, and the
pipeline's bubble grew (docs/benchmarks.md#pipeline-stages-in-separate-processes).
Every chain is a subsequence of the one order of the schedule that both sides walk, so
splitting the order cannot make a cycle of waits.
"""

from __future__ import annotations

import tensorflow as tf

from epl_trainer.core.comm.keys import (
    TRANSFER_CHAINS,
    collective_rank_order,
    group_key,
    length_keyed_instance,
    next_instance_key,
    ordering_token,
)


class PairTransfer:
    """Transfers from `source` to `destination` (device names; one of them local).

    Args:
      source, destination: the two member devices.
      local: the member that lives in this process.
    """

    def __init__(self, source: str, destination: str, local: str):
        if local not in (source, destination):
            raise ValueError(
                f"local must be the source or the destination. Received: local={local!r}, "
                f"source={source!r}, destination={destination!r}"
            )
        if source == destination:
            raise ValueError(f"A transfer needs two devices. Received: {source!r} twice")
        self.source, self.destination, self.local = source, destination, local
        self.key = group_key((source, destination))
        sends, receives = TRANSFER_CHAINS
        self._chain = sends if local == source else receives

    def _gather(self, value: tf.Tensor, unit: int | None) -> tf.Tensor:
        """Both members' `value`s, flat, concatenated in rank order.

        Args:
          unit: None for a tensor of the same size at every step (a shape); else the
            payload's size changes with the batch and is a multiple of `unit` (elements
            per row): its key then follows its length, since TensorFlow fixes a
            collective instance's shape by key (`keys.length_keyed_instance`).
        """
        with tf.device(self.local):
            wire = value if value.dtype != tf.bfloat16 else tf.bitcast(value, tf.float16)
            if wire.dtype == tf.bool:
                wire = tf.cast(wire, tf.int8)
            wire = tf.reshape(wire, [-1])
            if unit is None:
                instance_key = next_instance_key(self.key)
            else:
                instance_key = length_keyed_instance(tf.size(wire), self.key, unit)
            gathered = tf.raw_ops.CollectiveGatherV2(
                input=wire,
                group_size=2,
                group_key=self.key,
                instance_key=instance_key,
                ordering_token=[ordering_token(self.local, self._chain)],
                communication_hint="auto",
            )
            return gathered

    def _source_half(self, gathered: tf.Tensor) -> tf.Tensor:
        # TF ranks the members of a group by task name, then device (keys.py); the
        # sender's half is the first one when it ranks first.
        first = collective_rank_order((self.source, self.destination))[0]
        halves = tf.split(gathered, 2)
        return halves[0] if first == self.source else halves[1]

    def send(self, value: tf.Tensor, unit: int, send_shape: bool = False) -> tf.Tensor:
        """Sends `value` (on the source); returns the op's output, to order later work on.

        Args:
          unit: elements per row of `value` (the receiver uses the same number).
          send_shape: first send the value's shape, for a receiver that cannot know it
            (a dimension other than the batch is dynamic).
        """
        self._check_side(self.source, "send")
        with tf.device(self.source):
            if send_shape:
                self._gather(tf.shape(value, out_type=tf.int32), unit=None)
            return self._gather(value, unit)

    def receive(self, shape, dtype, unit: int, shape_rank: int | None = None) -> tf.Tensor:
        """Receives the source's tensor (on the destination).

        Args:
          shape: the tensor's shape (a list of ints and scalar tensors), or None when the
            source sends it first (`send(..., send_shape=True)`), then `shape_rank` is
            its rank.
          dtype: the tensor's dtype.
          unit: as in `send`.
        """
        self._check_side(self.destination, "receive")
        dtype = tf.as_dtype(dtype)
        with tf.device(self.destination):
            if shape is None:
                shape = self._source_half(self._gather(tf.zeros([shape_rank], tf.int32), None))
            else:
                shape = (
                    tf.stack([tf.cast(d, tf.int32) for d in shape])
                    if shape
                    else tf.zeros([0], tf.int32)
                )
            wire_dtype = {tf.bfloat16: tf.float16, tf.bool: tf.int8}.get(dtype, dtype)
            gathered = self._gather(tf.zeros(shape, wire_dtype), unit)
            value = tf.reshape(self._source_half(gathered), shape)
            if dtype == tf.bfloat16:
                value = tf.bitcast(value, tf.bfloat16)
            elif dtype == tf.bool:
                value = tf.cast(value, tf.bool)
            return value

    def _check_side(self, expected: str, what: str) -> None:
        if self.local != expected:
            raise ValueError(f"{what} runs on {expected!r}, but this process holds {self.local!r}.")
