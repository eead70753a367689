"""ZeRO's collectives over one stage's group, on the pieces of `FlatLayout`s.

A member's pieces are addressed by `(layout number, layout position)`: one shard holds
at most one piece of a variable per layout. Shard r belongs to the member whose rank in
the group is r (`CollectiveGroup.rank_of`), because that is where TF's collectives put
chunk r.

* `reduce_scatter_pieces` (v1): each member receives the reduced gradients of its pieces
  only; with several micro-batches, one reduce-scatter per micro-batch, summed into the
  shard, so no member ever holds the accumulated gradient of the whole stage.
* `all_reduce_pieces` (v0): the full gradients all-reduced, each member keeps its pieces.
* `gather_pieces`: the updated pieces all-gathered, every member gets whole variables.
* `piece_of_slices`: an Embedding's IndexedSlices restricted to a piece's rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from epl_trainer.core import comm
from epl_trainer.core.engine.zero.layout import FlatLayout, Piece, row_size

PieceKey = tuple[int, int]  # (layout number, layout position)


def member_shards(group: comm.CollectiveGroup, layouts: Sequence[FlatLayout]) -> list[int]:
    """The shard of each local member: its rank in the group."""
    for layout in layouts:
        if layout.num_shards != group.size:
            raise ValueError(
                "Each layout needs one shard per group member. Received: "
                f"num_shards={layout.num_shards}, group_size={group.size}"
            )
    return [group.rank_of(device) for device in group.local_devices]


def _excluded(layout: FlatLayout, sparse: set[int]) -> set[int]:
    return {j for j, i in enumerate(layout.indices) if i in sparse}


def reduce_scatter_pieces(
    group: comm.CollectiveGroup,
    layouts: Sequence[FlatLayout],
    micro_batch_grads: Sequence[Sequence[dict]],
    sparse: set[int],
    reduction: str = "mean",
    num_chains: int = 1,
    wire_fp16_scale: float | None = None,
) -> list[dict[PieceKey, tf.Tensor]]:
    """v1: per member, the reduced gradients of its dense pieces, summed over micro-batches.

    Args:
      micro_batch_grads: `[micro-batch][member]`, {caller index: gradient} of every
        dense variable the layouts cover, on the member's device.
      sparse: caller indices whose gradients are IndexedSlices (not in the buffers).
      wire_fp16_scale: `communication.fp16`: float32 buffers cross as scaled float16.
    """
    shards = member_shards(group, layouts)
    owned: list[dict[PieceKey, tf.Tensor]] = [{} for _ in shards]
    # Last layers' bucket first: backward produces it first.
    for b in reversed(range(len(layouts))):
        layout = layouts[b]
        excluded = _excluded(layout, sparse)
        if len(excluded) == len(layout.shapes):
            continue
        totals: list = [None] * len(shards)
        for per_member in micro_batch_grads:
            buffers = []
            for device, grads in zip(group.local_devices, per_member):
                with tf.device(device):
                    values = [
                        None if j in excluded else grads[i] for j, i in enumerate(layout.indices)
                    ]
                    buffers.append(layout.pack(values, excluded))
            chunks = comm.reduce_scatter(group, buffers, reduction, b % num_chains, wire_fp16_scale)
            for m, (device, chunk) in enumerate(zip(group.local_devices, chunks)):
                with tf.device(device):
                    totals[m] = chunk if totals[m] is None else totals[m] + chunk
        for m, (device, total) in enumerate(zip(group.local_devices, totals)):
            pieces = layout.pieces_of(shards[m], excluded)
            with tf.device(device):
                values = layout.unpack_block(total, shards[m], excluded)
            owned[m].update(((b, p.position), v) for p, v in zip(pieces, values))
    return owned


def all_reduce_pieces(
    group: comm.CollectiveGroup,
    layouts: Sequence[FlatLayout],
    member_grads: Sequence[dict],
    sparse: set[int],
    reduction: str = "mean",
    num_chains: int = 1,
    wire_fp16_scale: float | None = None,
) -> list[dict[PieceKey, tf.Tensor]]:
    """v0: all-reduces the full dense gradients (a fused bucket per layout); each member
    keeps its pieces. `member_grads[m]`: {caller index: gradient}."""
    shards = member_shards(group, layouts)
    covered = sorted(i for layout in layouts for i in layout.indices if i not in sparse)
    position = {i: p for p, i in enumerate(covered)}
    per_member = [[grads[i] for i in covered] for grads in member_grads]
    buckets = [
        [position[i] for i in layout.indices if i not in sparse]
        for layout in reversed(layouts)  # last layers first
    ]
    buckets = [bucket for bucket in buckets if bucket]
    reduced = comm.fused_all_reduce(
        group, per_member, buckets, reduction, num_chains, wire_fp16_scale
    )
    owned: list[dict[PieceKey, tf.Tensor]] = [{} for _ in shards]
    for m, device in enumerate(group.local_devices):
        for b, layout in enumerate(layouts):
            for p in layout.pieces_of(shards[m], _excluded(layout, sparse)):
                with tf.device(device):
                    owned[m][(b, p.position)] = elements_of(reduced[m][position[p.index]], p)
    return owned


def gather_pieces(
    group: comm.CollectiveGroup,
    layouts: Sequence[FlatLayout],
    member_pieces: Sequence[dict[PieceKey, tf.Tensor]],
    num_chains: int = 1,
) -> list[dict[int, tf.Tensor]]:
    """All-gathers every member's pieces (all of them, dense or not): per member,
    {caller index: whole value} of every variable the layouts cover."""
    shards = member_shards(group, layouts)
    results: list[dict[int, tf.Tensor]] = [{} for _ in shards]
    for b, layout in enumerate(layouts):
        blocks = []
        for m, device in enumerate(group.local_devices):
            values = [member_pieces[m][(b, p.position)] for p in layout.pieces[shards[m]]]
            with tf.device(device):
                blocks.append(layout.pack_block(values, shards[m]))
        gathered = group.all_gather(blocks, chain=b % num_chains)
        for m, (device, buffer) in enumerate(zip(group.local_devices, gathered)):
            with tf.device(device):
                results[m].update(zip(layout.indices, layout.unpack_all(buffer)))
    return results


def elements_of(value: tf.Tensor, piece: Piece) -> tf.Tensor:
    """A whole variable's dense tensor -> the piece's elements, in the piece's shape."""
    if piece.whole:
        return value
    return tf.reshape(tf.reshape(value, [-1])[piece.start : piece.stop], piece.shape)


def piece_of_slices(slices: tf.IndexedSlices, piece: Piece) -> tf.IndexedSlices:
    """The rows of `slices` inside the piece, indices made piece-local.

    The row count stays static (XLA-compiled updates need static shapes): rows outside
    the piece become zero rows at index 0, which add nothing to a densified gradient (how
    Keras's optimizers apply IndexedSlices: a segment sum, or scatter-adds of values).
    A piece cut by elements (a variable not expected to get sparse gradients) gets
    the densified gradient's elements.
    """
    if piece.whole:
        return slices
    if tuple(slices.values.shape[1:]) != tuple(piece.shape[1:]):
        return elements_of(tf.convert_to_tensor(slices), piece)
    unit = row_size(piece.shape)
    first, end = piece.start // unit, piece.stop // unit
    indices = tf.cast(slices.indices, tf.int64)
    inside = (indices >= first) & (indices < end)
    mask = tf.reshape(inside, [-1] + [1] * (len(slices.values.shape) - 1))
    values = tf.where(mask, slices.values, tf.zeros_like(slices.values))
    local = tf.where(inside, indices - first, tf.zeros_like(indices))
    dense_shape = tf.constant(
        piece.shape, tf.int64 if slices.dense_shape is None else slices.dense_shape.dtype
    )
    return tf.IndexedSlices(values, tf.cast(local, slices.indices.dtype), dense_shape)


def global_norm_squared(
    group: comm.CollectiveGroup, member_owned_grads: Sequence[Sequence]
) -> list[tf.Tensor]:
    """Squared norm of the whole stage gradient, from the owned pieces, on every member.

    Every reduced gradient element lives in exactly one piece after a ZeRO reduction,
    so the sum over the group of each member's owned squares is the stage's squared norm
    (for `global_clipnorm` after the reduction; add the stages, then take the root).
    """
    squares = []
    for device, grads in zip(group.local_devices, member_owned_grads):
        with tf.device(device):
            # Slices count row by row, as Keras's global norm counts them.
            terms = [tf.reduce_sum(tf.square(tf.cast(_dense_values(g), tf.float32))) for g in grads]
            squares.append(tf.add_n(terms) if terms else tf.zeros([], tf.float32))
    return group.all_reduce(squares, "sum")


def _dense_values(gradient):
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient
