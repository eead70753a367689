"""ZeRO partitions as data: which elements of which variable each shard owns.

The variables of one dtype (one bucket with `communication.max_splits` > 1) are laid end
to end as one flat buffer, and the buffer is cut into `num_shards` ranges of
ceil(total/N) elements: block r of the exchange buffer is exactly shard r's range, so
packing a reduce-scatter is one concatenation (the last block padded) and every shard
owns total/N elements whatever the variable sizes. A `Piece` is the part of one
variable a shard owns, as a flat element range [start, stop) of that variable.

Three ways to cut (`FlatLayout(cut=...)`):

* "elements" (dense variables, element-wise optimizers): cuts anywhere; a cut piece is a
  1-D tensor of its elements.
* "rows" (variables whose gradient can be IndexedSlices, an Embedding's table): cuts move
  to the nearest row boundary, so a piece is whole rows (shape: the variable's, fewer
  rows) and a sparse gradient splits by row index. Blocks then differ by up to a row;
  such a layout packs its (rarely dense) gradients piece by piece.
* "whole" (optimizers whose update is not element-wise: LAMB's trust ratio, Adafactor's
  factored moments, per-variable `clipnorm`): each variable is owned whole, dealt out
  largest first; balance is then bounded by the largest variable.

Exchange buffers (`pack`, `unpack_block`, ...) take an `excluded` set of layout
positions: sparse gradients travel as rows, not in the buffer, while ownership stays the
same. Pure Python but for the pack/unpack helpers.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Collection, Sequence

import tensorflow as tf

from epl_trainer.core import comm

CUTS = ("elements", "rows", "whole")


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of the variable at layout position `position`."""

    position: int  # in the layout
    index: int  # the caller's index of the variable
    start: int
    stop: int
    shape: tuple[int, ...]  # the piece's own shape (the variable's when whole)
    whole: bool  # the piece is the entire variable

    @property
    def size(self) -> int:
        return self.stop - self.start


def row_size(shape: Sequence[int]) -> int:
    """Elements per row (per index of the first axis); a scalar is one row of one."""
    return math.prod(shape[1:]) if len(shape) > 1 else 1


def cut_points(shapes: Sequence[Sequence[int]], num_shards: int, rows: bool) -> list[int]:
    """Element offsets [0, c_1, ..., c_{N-1}, total] of the shards' ranges: c_r =
    r * ceil(total / N), or with `rows` r*total/N moved to the nearest row boundary of
    the variable it falls in. Cuts never go backwards."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1. Received: {num_shards}")
    sizes = [math.prod(shape) for shape in shapes]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    total = starts[-1]
    if not rows:
        block = -(-total // num_shards)
        return [min(r * block, total) for r in range(num_shards)] + [total]
    cuts, j = [0], 0
    for r in range(1, num_shards):
        target = r * total / num_shards
        while j < len(sizes) - 1 and starts[j + 1] <= target:
            j += 1
        unit = row_size(shapes[j]) if sizes else 1
        cut = starts[j] + round((target - starts[j]) / unit) * unit if sizes else 0
        cuts.append(min(max(cut, cuts[-1]), total))
    cuts.append(total)
    return cuts


class FlatLayout:
    """Shard ranges over the variables of one dtype, and their exchange buffers.

    Attributes:
      shapes, sizes, dtype, num_shards: the variables' shapes and element counts.
      indices: `indices[j]` is variable j's index in the caller's list.
      cut: "elements", "rows" or "whole" (module doc).
      pieces: `pieces[r]`, the pieces shard r owns, in buffer order.
      loads: `loads[r]`, elements shard r owns.
      block_size: elements per block of a full exchange buffer (the largest load, >= 1).
    """

    def __init__(
        self,
        shapes: Sequence[Sequence[int]],
        num_shards: int,
        dtype: str = "float32",
        indices: Sequence[int] | None = None,
        cut: str = "elements",
    ):
        if cut not in CUTS:
            raise ValueError(f"cut must be one of {CUTS}. Received: {cut!r}")
        self.shapes = tuple(tuple(int(d) for d in shape) for shape in shapes)
        self.sizes = tuple(math.prod(shape) for shape in self.shapes)
        self.num_shards = num_shards
        self.dtype = tf.as_dtype(dtype).name
        self.cut = cut
        self.indices = tuple(range(len(self.shapes)) if indices is None else indices)
        if len(self.indices) != len(self.shapes):
            raise ValueError(
                "FlatLayout needs one index per shape. Received: "
                f"{len(self.shapes)} shapes, {len(self.indices)} indices"
            )
        if cut == "whole":  # dealt out largest first (not contiguous: better balance)
            owners = assign_owners(self.sizes, num_shards)
            self.pieces = tuple(
                tuple(self._whole(j) for j, owner in enumerate(owners) if owner == r)
                for r in range(num_shards)
            )
        else:
            cuts = cut_points(self.shapes, num_shards, rows=cut == "rows")
            self.pieces = tuple(self._pieces_between(a, b) for a, b in itertools.pairwise(cuts))
        self.loads = tuple(sum(p.size for p in pieces) for pieces in self.pieces)
        self.block_size = max(1, *self.loads)

    def _whole(self, j: int) -> Piece:
        return Piece(j, self.indices[j], 0, self.sizes[j], self.shapes[j], True)

    def _pieces_between(self, begin: int, end: int) -> tuple[Piece, ...]:
        pieces, offset = [], 0
        for j, (shape, size) in enumerate(zip(self.shapes, self.sizes)):
            low, high = max(begin, offset), min(end, offset + size)
            if low < high:
                start, stop = low - offset, high - offset
                if start == 0 and stop == size:
                    pieces.append(self._whole(j))
                else:
                    unit = row_size(shape)
                    own = (
                        ((stop - start) // unit, *shape[1:])
                        if self.cut == "rows"
                        else (stop - start,)
                    )
                    pieces.append(Piece(j, self.indices[j], start, stop, own, False))
            offset += size
        return tuple(pieces)

    def __repr__(self) -> str:
        return (
            f"FlatLayout(dtype={self.dtype}, cut={self.cut}, vars={len(self.shapes)}, "
            f"num_shards={self.num_shards}, block_size={self.block_size}, loads={self.loads})"
        )

    @property
    def buffer_size(self) -> int:
        return self.num_shards * self.block_size

    def pieces_of(self, shard: int, excluded: Collection[int] = ()) -> list[Piece]:
        return [p for p in self.pieces[shard] if p.position not in excluded]

    def exchange_block_size(self, excluded: Collection[int] = ()) -> int:
        """Block size of a buffer without the variables at `excluded` positions."""
        if not excluded:
            return self.block_size
        return max(1, *(sum(p.size for p in self.pieces_of(r, excluded))
                        for r in range(self.num_shards)))  # fmt: skip

    # ---- buffers -----------------------------------------------------------------------

    def pack(self, values: Sequence[tf.Tensor], excluded: Collection[int] = ()) -> tf.Tensor:
        """Every variable's tensor (layout order; anything at excluded positions) -> the
        `[num_shards * block]` buffer, block r holding shard r's pieces."""
        self._check_count(values, len(self.shapes), "pack")
        if self.cut == "elements" and not excluded:
            # Blocks are consecutive ranges of the variables laid end to end: one concat.
            parts = [tf.reshape(v, [-1]) for v in values]
            parts.append(tf.zeros([self.buffer_size - sum(self.sizes)], self.dtype))
            return tf.concat(parts, axis=0)
        block = self.exchange_block_size(excluded)
        flat = {}
        parts = []
        for r in range(self.num_shards):
            pieces = self.pieces_of(r, excluded)
            for p in pieces:
                if p.position not in flat:
                    flat[p.position] = tf.reshape(values[p.position], [-1])
                parts.append(flat[p.position] if p.whole else flat[p.position][p.start : p.stop])
            parts.append(tf.zeros([block - sum(p.size for p in pieces)], self.dtype))
        return tf.concat(parts, axis=0)

    def unpack_block(
        self, chunk: tf.Tensor, shard: int, excluded: Collection[int] = ()
    ) -> list[tf.Tensor]:
        """Block `shard` of a buffer -> its pieces' tensors (pieces_of(shard, excluded))."""
        pieces = self.pieces_of(shard, excluded)
        padding = self.exchange_block_size(excluded) - sum(p.size for p in pieces)
        parts = tf.split(chunk, [p.size for p in pieces] + [padding])
        return [tf.reshape(part, p.shape) for p, part in zip(pieces, parts)]

    def pack_block(self, values: Sequence[tf.Tensor], shard: int) -> tf.Tensor:
        """Shard's piece tensors (all its pieces, in order) -> its `block_size` block."""
        pieces = self.pieces[shard]
        self._check_count(values, len(pieces), f"pack_block(shard={shard})")
        parts = [tf.reshape(v, [-1]) for v in values]
        parts.append(tf.zeros([self.block_size - self.loads[shard]], self.dtype))
        return tf.concat(parts, axis=0)

    def unpack_all(self, buffer: tf.Tensor) -> list[tf.Tensor]:
        """A full buffer (all-gathered blocks) -> every variable's tensor, layout order."""
        if self.cut == "elements":
            parts = tf.split(buffer, [*self.sizes, self.buffer_size - sum(self.sizes)])
            return [tf.reshape(part, shape) for part, shape in zip(parts, self.shapes)]
        blocks = tf.split(buffer, self.num_shards)
        flat: list[list[tf.Tensor]] = [[] for _ in self.shapes]
        for r, block in enumerate(blocks):
            sizes = [p.size for p in self.pieces[r]]
            for p, part in zip(
                self.pieces[r], tf.split(block, [*sizes, self.block_size - sum(sizes)])
            ):
                flat[p.position].append(part)
        return [
            tf.reshape(parts[0] if len(parts) == 1 else tf.concat(parts, 0), shape)
            for parts, shape in zip(flat, self.shapes)
        ]

    def _check_count(self, values, expected: int, what: str) -> None:
        if len(values) != expected:
            raise ValueError(f"{what} expects {expected} tensors. Received: {len(values)}")


def make_layouts(
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence,
    num_shards: int,
    max_splits: int = 1,
    indices: Sequence[int] | None = None,
    split_variables: bool = True,
    row_aligned: Collection[int] = (),
) -> list[FlatLayout]:
    """One layout per dtype (per contiguous bucket with `max_splits` > 1), cut by
    elements; the variables at caller indices `row_aligned` (those whose gradient can be
    IndexedSlices) in their own layout per dtype, cut by rows; everything whole when not
    `split_variables`.

    `indices[j]` is variable j's index in the caller's list (default: j). Each bucket is
    cut into N equal ranges on its own.
    """
    if len(shapes) != len(dtypes):
        raise ValueError(
            f"make_layouts needs one dtype per shape. Received: {len(shapes)} shapes, "
            f"{len(dtypes)} dtypes"
        )
    sizes = [math.prod(int(d) for d in shape) for shape in shapes]
    names = [tf.as_dtype(d).name for d in dtypes]
    itemsizes = [tf.as_dtype(d).size for d in dtypes]
    indices = list(range(len(shapes)) if indices is None else indices)
    rows = [j for j, i in enumerate(indices) if i in set(row_aligned)] if split_variables else []
    dense = [j for j in range(len(shapes)) if j not in rows]
    groups = [
        ([dense[b] for b in bucket], "elements" if split_variables else "whole")
        for bucket in comm.plan_buckets(
            [sizes[j] * itemsizes[j] for j in dense], [names[j] for j in dense], max_splits
        )
    ]
    by_dtype: dict[str, list[int]] = {}
    for j in rows:
        by_dtype.setdefault(names[j], []).append(j)
    groups += [(members, "rows") for members in by_dtype.values()]
    return [
        FlatLayout(
            [shapes[j] for j in members],
            num_shards,
            names[members[0]],
            indices=[indices[j] for j in members],
            cut=cut,
        )
        for members, cut in groups
    ]


def assign_owners(sizes: Sequence[int], num_shards: int) -> list[int]:
    """Greedy balanced owners: largest first, each to the least-loaded shard (ties to the
    lower index, so every worker computes the same). The most-loaded shard exceeds the
    least-loaded by at most the largest size. Returns `owners[i]` for item i."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1. Received: {num_shards}")
    if any(s < 0 for s in sizes):
        raise ValueError(f"sizes must be >= 0. Received: {list(sizes)}")
    loads = [(0, shard) for shard in range(num_shards)]  # a heap of (load, shard)
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, shard = heapq.heappop(loads)
        owners[i] = shard
        heapq.heappush(loads, (load + sizes[i], shard))
    return owners


def shard_bytes(layouts: FlatLayout | Sequence[FlatLayout]) -> list[int]:
    """Bytes of variables each shard owns (what its optimizer slots scale with)."""
    layouts = [layouts] if isinstance(layouts, FlatLayout) else list(layouts)
    if not layouts:
        return []
    totals = [0] * layouts[0].num_shards
    for layout in layouts:
        itemsize = tf.as_dtype(layout.dtype).size
        for r, load in enumerate(layout.loads):
            totals[r] += load * itemsize
    return totals


def balance(layouts: FlatLayout | Sequence[FlatLayout]) -> dict[str, float]:
    """Shard balance for reports: max / min owned bytes, their ratio, padding bytes."""
    layouts = [layouts] if isinstance(layouts, FlatLayout) else list(layouts)
    per_shard = shard_bytes(layouts)
    padding = sum(
        (layout.buffer_size - sum(layout.loads)) * tf.as_dtype(layout.dtype).size
        for layout in layouts
    )
    high, low = max(per_shard, default=0), min(per_shard, default=0)
    return {
        "max_bytes": high,
        "min_bytes": low,
        "max_over_min": high / low if low else float("inf") if high else 1.0,
        "padding_bytes": padding,
    }


# Keras optimizers whose update of a tensor is element by element (no per-variable norm,
# no factored statistics): any piece of a variable updates as the whole would.
ELEMENTWISE_OPTIMIZERS = (
    "SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad", "Adadelta", "Lion", "Ftrl",
)  # fmt: skip


def splits_variables(optimizer) -> bool:
    """Whether ZeRO may cut `optimizer`'s variables into pieces: its update is a
    Keras element-wise one (the class defining `update_step`, so a subclass that changes
    the update is not taken on trust) and it has no per-variable `clipnorm`."""
    owner = next((cls for cls in type(optimizer).__mro__ if "update_step" in vars(cls)), object)
    return (
        owner.__module__.startswith("keras")
        and owner.__name__ in ELEMENTWISE_OPTIMIZERS
        and optimizer.clipnorm is None
    )
