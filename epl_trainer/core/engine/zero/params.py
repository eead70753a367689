"""ZeRO "v2" (DeepSpeed stage 3): the parameters themselves live only as ZeRO pieces.

Under v0 / v1 every lane holds a full copy of its stages' variables and the pieces (the
owned elements, zero.py) are refreshed from it. Under v2 the lanes hold no copy: the
pieces are the parameters, and a lane's `state.trainable[l][i]` is a `GatheredParameter`,
a stand-in that assembles the whole value from the pieces when it is read. So each
device keeps 1/N of the parameters between steps, and a stage's whole parameters exist
only while they are used:

* in training, once per (lane, stage) per step, at the stage's first forward; freed
  after the stage's last backward of the step (the tapes keep them until then);
* with gradient checkpointing, per recomputed segment instead: gathered just before the
  segment's forward (the next segment's gather may start while a segment computes:
  prefetch), freed after it, and gathered again in the segment's backward
  (recompute.py), so a stage's whole parameters never exist at once;
* for evaluation, checkpoints, `write_back` and `set_weights`, when read or assigned.

The gather reads the pieces of every member directly (TF copies them to the reading
device) when the stage group is on this worker; a group spanning workers reads by
all-gathers instead (zero_gather.py). The gradients are v1's: each micro-batch's
full gradients of the gathered values are reduce-scattered into the owners' pieces.
"""

from __future__ import annotations

import math

import tensorflow as tf

from epl_trainer.core.engine.zero.gather import MemberParameter


class GatheredParameter:
    """A variable held only as ZeRO pieces, with the `keras.Variable` surface the engine
    reads (`value`, `assign`, `shape`, `dtype`, `name`, `path`, `trainable`).

    Args:
      original: the user's model variable it stands for (its shape, name and path).
      pieces: [(Piece, piece variable)] covering the variable's elements, any order.
    """

    def __init__(self, original, pieces):
        self.shape = tuple(original.shape)
        self.dtype = pieces[0][1].dtype
        self.name = original.name
        self.path = original.path
        self.trainable = True
        self.pieces = sorted(pieces, key=lambda pair: pair[0].start)
        size = math.prod(self.shape)
        covered = [(p.start, p.stop) for p, _ in self.pieces]
        expected_start = 0
        for start, stop in covered:
            if start != expected_start:
                raise ValueError(
                    f"The pieces of {self.path!r} do not cover it: element ranges {covered}"
                )
            expected_start = stop
        if expected_start != size:
            raise ValueError(
                f"The pieces of {self.path!r} cover {expected_start} of its {size} elements."
            )

    @property
    def value(self) -> tf.Tensor:
        return self.gather()

    def gather(self, after=None) -> tf.Tensor:
        """The whole value, assembled on the current device.

        Args:
          after: None, or a float scalar 0 added to every piece first: a data edge that
            keeps the gather from running (or being merged with an identical gather)
            before `after` exists (recompute.py's re-gather in backward, prefetch).
        """
        parts = []
        for _, variable in self.pieces:
            part = variable.value
            if after is not None:
                part = part + tf.cast(after, part.dtype)
            parts.append(tf.reshape(part, [-1]))
        flat = parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)
        return tf.reshape(flat, self.shape)

    def assign(self, value) -> None:
        """Writes `value` (the whole variable's) into the pieces."""
        flat = tf.reshape(tf.convert_to_tensor(value, self.dtype), [-1])
        for piece, variable in self.pieces:
            with tf.device(variable.value.device):
                variable.assign(tf.reshape(flat[piece.start : piece.stop], variable.shape))

    def __repr__(self) -> str:
        return f"<GatheredParameter {self.path} shape={self.shape} pieces={len(self.pieces)}>"


def is_gathered(variable) -> bool:
    """A v2 stand-in: one over local pieces, or a lane's over a group across workers."""
    return isinstance(variable, (GatheredParameter, MemberParameter))


class SegmentGathers:
    """One (stage, micro-batch) forward's parameters, gathered segment by segment (v2
    with gradient checkpointing; recompute.py's `RecomputedStage` calls it).

    `gather` is the forward's gather of one segment's parameters: the tensors are watched
    by the stage's tape and recorded as `sources`, whose gradients the executor reduces.
    `regather` is the same segment's gather in its backward; its `after` is the upstream
    gradient of the segment *after* it in forward (the one whose backward runs just
    before), so the gather overlaps that backward (prefetch) instead of waiting for its
    own upstream.

    Args:
      parameters: the stage's lane variables in stage order (`GatheredParameter`s, or
        plain variables for split shards, which are read as they are).
      watch: the stage tape's `watch`.
    """

    def __init__(self, parameters, watch):
        self.parameters = list(parameters)
        self.watch = watch
        self.sources: list[tuple[int, tf.Tensor]] = []  # (stage position, gathered value)
        self._backward_trigger = None

    def gather(self, positions, after=None) -> list:
        values = [self._read(p, after) for p in positions]
        self.watch(values)
        self.sources.extend(zip(positions, values))
        return values

    def regather(self, positions, after) -> list:
        trigger = after if self._backward_trigger is None else self._backward_trigger
        self._backward_trigger = after
        return [self._read(p, trigger) for p in positions]

    def _read(self, position: int, after):
        parameter = self.parameters[position]
        if is_gathered(parameter):
            return parameter.gather(after)
        value = parameter.value
        return value if after is None else value + tf.cast(after, value.dtype)
