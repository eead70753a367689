"""ZeRO v2 with a stage group that spans workers: parameters read by all-gathers.

Within one worker, v2 reads a parameter by concatenating every member's pieces directly
(`GatheredParameter`). Across workers the other members' pieces are in other processes,
so each lane reads its stage's parameters with its own half of an all-gather over the
stage group (`CollectiveGroup.all_gather_member`): one per layout (fused buffer) of the
stage, issued where the lane's forward reads them. Every member issues the same reads in
the same order (the step is the same program on every worker), and the local members of
one read share its instance keys, so the halves meet.

* `StageGather`: a stage's reads for its local members. A read gathers every layout of
  the stage once and serves the stage's variables from it; a variable read twice in one
  function starts a new read (a later step of a loop unrolled in the same graph).
* `MemberParameter`: a lane's stand-in for one variable (`state.trainable[l][i]`): its
  `value` is the lane's read, `assign` writes the lane's own pieces.
* Eager reads (the write-back to the Keras model, checkpoint saves) run in a
  `tf.function` issuing every local member's half at once; every worker makes them at
  the same points. Inside `eager_reads()` each stage is gathered once for all of them.

Gradient checkpointing re-gathers per segment inside the backward
(`zero_params.SegmentGathers`); across workers that is refused (`rules.check_zero_v2_recompute`).
"""

from __future__ import annotations

import contextlib
import math
import weakref

import tensorflow as tf

from epl_trainer.core.comm.keys import next_instance_key

_EAGER_CACHE: dict | None = None  # id(StageGather) -> values, inside eager_reads()


@contextlib.contextmanager
def eager_reads():
    """Eager reads of cross-worker v2 parameters gather each stage once in this block."""
    global _EAGER_CACHE
    outer, _EAGER_CACHE = _EAGER_CACHE, {} if _EAGER_CACHE is None else _EAGER_CACHE
    try:
        yield
    finally:
        _EAGER_CACHE = outer


class _Read:
    def __init__(self, ordinal: int, values: dict):
        self.ordinal, self.values, self.served = ordinal, values, set()


class StageGather:
    """One stage's parameter reads over a group with members on other workers.

    Args:
      group: the stage group (`CollectiveGroup`); `group.local_devices[m]` is member m.
      layouts: the stage's `FlatLayout`s (zero_layout.py).
      shards: each local member's shard (its rank in the group).
      pieces: per local member, its `(layout number, Piece)`s, layout by layout.
      piece_variables: per local member, the variable holding each of its pieces.
      num_chains: ordering-token chains (communication.num_communicators).
    """

    def __init__(self, group, layouts, shards, pieces, piece_variables, num_chains: int = 1):
        self.group, self.layouts, self.shards = group, list(layouts), list(shards)
        self.pieces, self.piece_variables = pieces, piece_variables
        self.num_chains = max(1, num_chains)
        self._reads = weakref.WeakKeyDictionary()  # graph -> {member: _Read}
        self._keys = weakref.WeakKeyDictionary()  # graph -> {(ordinal, layout): key}
        self._eager = None

    def value(self, member: int, index: int) -> tf.Tensor:
        """Variable `index` as local member `member` reads it here."""
        if tf.executing_eagerly():
            return self._eager_values()[member][index]
        graph = tf.compat.v1.get_default_graph()
        reads = self._reads.setdefault(graph, {})
        read = reads.get(member)
        if read is None or index in read.served:
            ordinal = 0 if read is None else read.ordinal + 1
            read = reads[member] = _Read(ordinal, self._gather(graph, member, ordinal))
        read.served.add(index)
        return read.values[index]

    def _gather(self, graph, member: int, ordinal: int) -> dict:
        keys = self._keys.setdefault(graph, {})
        shard, values = self.shards[member], {}
        pieces = list(zip(self.pieces[member], self.piece_variables[member]))
        with tf.device(self.group.local_devices[member]):
            for b, layout in enumerate(self.layouts):
                own = [variable.value for (lb, _), variable in pieces if lb == b]
                block = layout.pack_block(own, shard)
                if (ordinal, b) not in keys:  # the first local member to read takes the key
                    keys[(ordinal, b)] = next_instance_key(self.group.key)
                chain = b % self.num_chains
                buffer = self.group.all_gather_member(block, member, keys[(ordinal, b)], chain)
                values.update(zip(layout.indices, layout.unpack_all(buffer)))
        return values

    def prefetch(self) -> None:
        """Inside `eager_reads()`: gathers the stage now (every worker in the same order),
        whether or not this worker reads it (a checkpoint's owner may be another)."""
        self._eager_values()

    def _eager_values(self) -> list[dict]:
        """Every local member's values, gathered by one compiled call (all halves)."""
        if _EAGER_CACHE is not None and id(self) in _EAGER_CACHE:
            return _EAGER_CACHE[id(self)]
        if self._eager is None:
            members = range(len(self.shards))
            self._eager = tf.function(
                lambda: [self._gather(tf.compat.v1.get_default_graph(), m, 0) for m in members]
            )
        values = self._eager()
        if _EAGER_CACHE is not None:
            _EAGER_CACHE[id(self)] = values
        return values


class MemberParameter:
    """A lane's stand-in for a v2 variable whose stage group spans workers, with the
    `keras.Variable` surface the engine reads (`value`, `assign`, `shape`, `dtype`, ...).

    Args:
      original: the user's model variable (its shape, name and path).
      index: its trainable index.
      reads: the stage's `StageGather`; `member`: the lane's position in it.
      own: [(Piece, piece variable)] of this variable that the lane holds (may be empty).
    """

    def __init__(self, original, index: int, reads: StageGather, member: int, own):
        self.shape = tuple(original.shape)
        self.dtype = original.dtype
        self.name, self.path, self.trainable = original.name, original.path, True
        self.index, self.reads, self.member, self.pieces = index, reads, member, list(own)

    @property
    def value(self) -> tf.Tensor:
        return self.reads.value(self.member, self.index)

    def gather(self, after=None) -> tf.Tensor:
        if after is not None:
            raise ValueError(
                f"{self.path!r}: ZeRO v2 across workers does not re-gather per segment "
                "(gradient checkpointing); rules.check_zero_v2_recompute refuses it."
            )
        return self.value

    def assign(self, value) -> None:
        """Writes the lane's own pieces of `value` (the whole variable's)."""
        flat = tf.reshape(tf.convert_to_tensor(value, self.dtype), [-1])
        assert flat.shape[0] == math.prod(self.shape), (self.path, flat.shape)
        for piece, variable in self.pieces:
            with tf.device(variable.value.device):
                variable.assign(tf.reshape(flat[piece.start : piece.stop], variable.shape))

    def __repr__(self) -> str:
        return f"<MemberParameter {self.path} shape={self.shape} member={self.member}>"
