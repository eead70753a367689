"""ZeRO: optimizer state (v0) and gradients (v1) sharded over the data-parallel lanes.

Each variable of a stage is owned, whole, by one lane of the stage's collective group
(so per-variable optimizer semantics stay exact: weight-decay exclusions, LAMB trust
ratios, per-variable `clipnorm`). Owners are chosen by size, largest first, so the
shards are balanced. Shard r belongs to the lane whose rank in the group is r
(`CollectiveGroup.rank_of`), because that is where TF's collectives put chunk r.

One step, in this order:

1. accumulate gradients per lane (unchanged);
2. v1: reduce-scatter a flat buffer per layout, each lane receiving only the reduced
   gradients it owns (`zero_reduce_scatter`); v0: all-reduce the full gradients and
   keep the owned ones (`zero_all_reduce`);
3. each lane applies its optimizer, built only on the variables it owns (so its slots
   exist only for its shard: the memory saving);
4. all-gather the updated variables (`zero_all_gather`) and assign the ones each lane
   does not own.

Layout as data: `ShardLayout` is plain Python (owners, offsets, block size) plus
pack/unpack helpers; one layout holds one dtype (`make_layouts` groups by dtype), since
a collective moves one dtype. Memory report: `shard_bytes`, `balance`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import tensorflow as tf

from epl_trainer.core import comm
from epl_trainer.core.engine.apply import OptimizerStep
from epl_trainer.core.engine.reduce import scaled, sum_over_lane


def assign_owners(sizes: Sequence[int], num_shards: int) -> list[int]:
    """Greedy balanced owners: largest first, each to the least-loaded shard.

    Ties (equal sizes, equal loads) go to the lower index, so the result is
    deterministic and identical on every worker. The most-loaded shard exceeds the
    least-loaded by at most the largest size.

    Returns:
      `owners[i]`, the shard that owns item i.
    """
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


class ShardLayout:
    """Where each variable of one dtype lives in a ZeRO exchange buffer.

    The buffer has `num_shards` blocks of `block_size` elements; block r holds the
    flattened variables shard r owns (in their order in the layout), then zeros.

    Attributes:
      shapes: the variables' shapes.
      sizes: their element counts.
      dtype: the dtype of every variable in the layout.
      indices: `indices[j]` is variable j's index in the caller's list.
      owners: `owners[j]`, the shard (= group rank) owning variable j.
      owned: `owned[r]`, the layout positions shard r owns, ascending.
      loads: `loads[r]`, elements shard r owns.
      block_size: elements per block (the largest load, at least 1).
    """

    def __init__(
        self,
        shapes: Sequence[Sequence[int]],
        num_shards: int,
        dtype: str = "float32",
        indices: Sequence[int] | None = None,
        owners: Sequence[int] | None = None,
    ):
        self.shapes = tuple(tuple(int(d) for d in shape) for shape in shapes)
        self.sizes = tuple(math.prod(shape) for shape in self.shapes)
        self.num_shards = num_shards
        self.dtype = str(dtype)
        self.indices = tuple(range(len(self.shapes)) if indices is None else indices)
        if len(self.indices) != len(self.shapes):
            raise ValueError(
                "ShardLayout needs one index per shape. Received: "
                f"{len(self.shapes)} shapes, {len(self.indices)} indices"
            )
        self.owners = tuple(assign_owners(self.sizes, num_shards) if owners is None else owners)
        if any(not 0 <= r < num_shards for r in self.owners):
            raise ValueError(f"owners must be in [0, {num_shards}). Received: {self.owners}")
        self.owned = tuple(
            tuple(j for j, owner in enumerate(self.owners) if owner == r) for r in range(num_shards)
        )
        self.loads = tuple(sum(self.sizes[j] for j in owned) for owned in self.owned)
        # At least one element: collectives of empty buffers are not worth special-casing.
        self.block_size = max(1, *self.loads)
        # One concat / one split for the whole buffer: pieces in buffer order, with the
        # layout position of each piece (None for padding).
        self._pieces: list[tuple[int | None, int]] = []
        for r in range(num_shards):
            self._pieces += [(j, self.sizes[j]) for j in self.owned[r]]
            if self.block_size > self.loads[r]:
                self._pieces.append((None, self.block_size - self.loads[r]))

    def __repr__(self) -> str:
        return (
            f"ShardLayout(dtype={self.dtype}, vars={len(self.shapes)}, "
            f"num_shards={self.num_shards}, block_size={self.block_size}, loads={self.loads})"
        )

    @property
    def buffer_size(self) -> int:
        return self.num_shards * self.block_size

    def owned_indices(self, shard: int) -> list[int]:
        """The caller's indices of the variables `shard` owns, in layout order."""
        return [self.indices[j] for j in self.owned[shard]]

    def pack(self, values: Sequence[tf.Tensor]) -> tf.Tensor:
        """All variables' tensors -> the flat `[num_shards * block_size]` buffer (by rank)."""
        self._check_count(values, len(self.shapes), "pack")
        parts = [
            tf.reshape(values[j], [-1]) if j is not None else tf.zeros([n], self.dtype)
            for j, n in self._pieces
        ]
        return tf.concat(parts, axis=0)

    def unpack_owned(self, chunk: tf.Tensor, shard: int) -> list[tf.Tensor]:
        """Block `shard` of a buffer (`block_size` elements) -> the tensors shard owns."""
        owned = self.owned[shard]
        pieces = tf.split(chunk, [self.sizes[j] for j in owned] + [self.padding(shard)])
        return [tf.reshape(p, self.shapes[j]) for j, p in zip(owned, pieces)]

    def pack_owned(self, values: Sequence[tf.Tensor], shard: int) -> tf.Tensor:
        """The tensors `shard` owns (in layout order) -> its `block_size`-element block."""
        owned = self.owned[shard]
        self._check_count(values, len(owned), f"pack_owned(shard={shard})")
        parts = [tf.reshape(v, [-1]) for v in values]
        parts.append(tf.zeros([self.padding(shard)], self.dtype))
        return tf.concat(parts, axis=0)

    def unpack_all(self, buffer: tf.Tensor) -> list[tf.Tensor]:
        """A full buffer (e.g. all-gathered) -> every variable's tensor, in layout order."""
        pieces = tf.split(buffer, [n for _, n in self._pieces])
        values: list[tf.Tensor | None] = [None] * len(self.shapes)
        for (j, _), piece in zip(self._pieces, pieces):
            if j is not None:
                values[j] = tf.reshape(piece, self.shapes[j])
        return values

    def padding(self, shard: int) -> int:
        return self.block_size - self.loads[shard]

    def _check_count(self, values, expected: int, what: str) -> None:
        if len(values) != expected:
            raise ValueError(f"{what} expects {expected} tensors. Received: {len(values)}")


def make_layouts(
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence,
    num_shards: int,
    max_splits: int = 1,
    indices: Sequence[int] | None = None,
) -> list[ShardLayout]:
    """One layout per dtype (per bucket with `max_splits` > 1) for a list of variables.

    `indices[j]` is variable j's index in the caller's list (default: j); the
    exchanges below index the per-lane gradient lists with it.

    With `max_splits` > 1 the variables of a dtype are cut into contiguous size-balanced
    buckets (`comm.plan_buckets`) and owners are balanced inside each bucket, so each
    collective has little padding; the total imbalance is then bounded by the sum of the
    buckets' largest variables instead of the single largest one.
    """
    if len(shapes) != len(dtypes):
        raise ValueError(
            f"make_layouts needs one dtype per shape. Received: {len(shapes)} shapes, "
            f"{len(dtypes)} dtypes"
        )
    sizes = [math.prod(int(d) for d in shape) for shape in shapes]
    names = [tf.as_dtype(d).name for d in dtypes]
    itemsizes = [tf.as_dtype(d).size for d in dtypes]
    buckets = comm.plan_buckets([s * b for s, b in zip(sizes, itemsizes)], names, max_splits)
    indices = list(range(len(shapes)) if indices is None else indices)
    return [
        ShardLayout(
            [shapes[j] for j in bucket],
            num_shards,
            names[bucket[0]],
            indices=[indices[j] for j in bucket],
        )
        for bucket in buckets
    ]


def owned_indices(layouts: Sequence[ShardLayout], shard: int) -> list[int]:
    """The caller's indices of every variable `shard` owns, ascending."""
    return sorted(i for layout in layouts for i in layout.owned_indices(shard))


def owner_of(layouts: Sequence[ShardLayout]) -> dict[int, int]:
    """{caller index: owning shard} over all layouts."""
    return {i: r for layout in layouts for i, r in zip(layout.indices, layout.owners)}


def shard_bytes(layouts: ShardLayout | Sequence[ShardLayout]) -> list[int]:
    """Bytes of variables each shard owns (what its optimizer slots scale with)."""
    layouts = [layouts] if isinstance(layouts, ShardLayout) else list(layouts)
    if not layouts:
        return []
    totals = [0] * layouts[0].num_shards
    for layout in layouts:
        itemsize = tf.as_dtype(layout.dtype).size
        for r, load in enumerate(layout.loads):
            totals[r] += load * itemsize
    return totals


def balance(layouts: ShardLayout | Sequence[ShardLayout]) -> dict[str, float]:
    """Shard balance for reports: max / min owned bytes, their ratio, padding bytes."""
    layouts = [layouts] if isinstance(layouts, ShardLayout) else list(layouts)
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


def without_indices(layout: ShardLayout, removed: Sequence[int]) -> ShardLayout:
    """`layout` less the variables at caller indices `removed`, owners unchanged."""
    removed = set(removed)
    keep = [j for j, i in enumerate(layout.indices) if i not in removed]
    return ShardLayout(
        [layout.shapes[j] for j in keep],
        layout.num_shards,
        layout.dtype,
        indices=[layout.indices[j] for j in keep],
        owners=[layout.owners[j] for j in keep],
    )


def _is_slices(gradient) -> bool:
    return isinstance(gradient, tf.IndexedSlices)


# ---- the exchanges (one stage, one collective group) ------------------------------------


def lane_shards(group: comm.CollectiveGroup, layouts: Sequence[ShardLayout]) -> list[int]:
    """The shard of each local lane: its rank in the group."""
    for layout in layouts:
        if layout.num_shards != group.size:
            raise ValueError(
                "Each layout needs one shard per group member. Received: "
                f"num_shards={layout.num_shards}, group_size={group.size}"
            )
    return [group.rank_of(device) for device in group.local_devices]


def zero_reduce_scatter(
    group: comm.CollectiveGroup,
    layouts: Sequence[ShardLayout],
    lane_grads: Sequence[Sequence[tf.Tensor]],
    reduction: str = "mean",
    num_chains: int = 1,
) -> list[list[tf.Tensor]]:
    """ZeRO v1: reduce-scatters the gradients; each lane receives only those it owns.

    Args:
      group: the stage's group; `lane_grads[li]` lives on `group.local_devices[li]`.
      layouts: from `make_layouts(..., num_shards=group.size)`.
      lane_grads: per local lane, the gradients of every variable the layouts cover
        (indexed like the layouts' `indices`).
      reduction: "mean" or "sum".
      num_chains: layouts are spread round-robin over this many ordering chains.

    Returns:
      Per local lane, its reduced gradients, aligned with
      `owned_indices(layouts, group.rank_of(device))`.
    """
    shards = lane_shards(group, layouts)
    owned: list[dict[int, tf.Tensor]] = [{} for _ in shards]
    for b, layout in enumerate(layouts):
        buffers = []
        for device, grads in zip(group.local_devices, lane_grads):
            with tf.device(device):
                buffers.append(layout.pack([grads[i] for i in layout.indices]))
        chunks = group.reduce_scatter(buffers, reduction, chain=b % num_chains)
        for li, (device, chunk) in enumerate(zip(group.local_devices, chunks)):
            with tf.device(device):
                values = layout.unpack_owned(chunk, shards[li])
            owned[li].update(zip(layout.owned_indices(shards[li]), values))
    return [[grads[i] for i in sorted(grads)] for grads in owned]


def zero_all_reduce(
    group: comm.CollectiveGroup,
    layouts: Sequence[ShardLayout],
    lane_grads: Sequence[Sequence[tf.Tensor]],
    reduction: str = "mean",
    num_chains: int = 1,
) -> list[list[tf.Tensor]]:
    """ZeRO v0: all-reduces the full gradients (one fused bucket per layout) and keeps,
    per lane, the ones it owns. Same arguments and result as `zero_reduce_scatter`."""
    shards = lane_shards(group, layouts)
    covered = sorted(i for layout in layouts for i in layout.indices)
    position = {i: p for p, i in enumerate(covered)}
    per_member = [[grads[i] for i in covered] for grads in lane_grads]
    buckets = [[position[i] for i in layout.indices] for layout in layouts]
    reduced = comm.fused_all_reduce(group, per_member, buckets, reduction, num_chains)
    return [
        [reduced[li][position[i]] for i in owned_indices(layouts, shard)]
        for li, shard in enumerate(shards)
    ]


def zero_all_gather(
    group: comm.CollectiveGroup,
    layouts: Sequence[ShardLayout],
    lane_owned_values: Sequence[Sequence[tf.Tensor]],
    num_chains: int = 1,
) -> list[dict[int, tf.Tensor]]:
    """All-gathers the owned (updated) variables so every lane has every variable.

    Args:
      lane_owned_values: per local lane, the values it owns, aligned with
        `owned_indices(layouts, group.rank_of(device))`.

    Returns:
      Per local lane, {caller index: value} for every variable the layouts cover.
    """
    shards = lane_shards(group, layouts)
    owned = [
        dict(zip(owned_indices(layouts, shard), values))
        for shard, values in zip(shards, lane_owned_values)
    ]
    results: list[dict[int, tf.Tensor]] = [{} for _ in shards]
    for b, layout in enumerate(layouts):
        blocks = []
        for li, device in enumerate(group.local_devices):
            mine = [owned[li][i] for i in layout.owned_indices(shards[li])]
            with tf.device(device):
                blocks.append(layout.pack_owned(mine, shards[li]))
        gathered = group.all_gather(blocks, chain=b % num_chains)
        for li, (device, buffer) in enumerate(zip(group.local_devices, gathered)):
            with tf.device(device):
                results[li].update(zip(layout.indices, layout.unpack_all(buffer)))
    return results


def zero_global_norm_squared(
    group: comm.CollectiveGroup, lane_owned_grads: Sequence[Sequence[tf.Tensor]]
) -> list[tf.Tensor]:
    """Squared norm of the whole stage gradient, from the owned shards, on every lane.

    Every reduced gradient lives on exactly one lane after a ZeRO reduction, so the sum
    over the group of each lane's owned squares is the stage's squared norm (for
    `global_clipnorm` applied after the reduction; add the stages, then take the root).
    """
    squares = []
    for device, grads in zip(group.local_devices, lane_owned_grads):
        with tf.device(device):
            # Slices count row by row, as Keras's global norm counts them.
            terms = [
                tf.reduce_sum(tf.square(tf.cast(g.values if _is_slices(g) else g, tf.float32)))
                for g in grads
            ]
            squares.append(tf.add_n(terms) if terms else tf.zeros([], tf.float32))
    return group.all_reduce(squares, "sum")


# ---- the update pass (same interface as update.ReplicatedUpdate) -------------------------


class ZeroUpdate:
    """Sharded update for `zero.level` "v0" / "v1"; a drop-in for `ReplicatedUpdate`.

    Per stage and local lane, the optimizer is built only on the variables the lane
    owns (`make_optimizer(device, owned_variables)`), so optimizer slots are sharded.
    The step: [clip local grads] -> reduce (v1 reduce-scatter, v0 all-reduce + keep
    owned) -> [global-norm clip over the owned shards] -> apply owned -> all-gather ->
    assign the variables the lane does not own.

    Args:
      layout: the step layout (lanes, stage groups, stages' variables, state).
      reduction: the gradient reduction and clipping settings (reduce.py).
      make_optimizer: `(device, variables) -> built Keras optimizer`.
      level: "v0" or "v1".
      jit_compile: compile each shard's optimizer update with XLA (apply.py).
      measure_ranks: run `CollectiveGroup.measure_ranks()` on every stage group (one
        tiny eager gather each, at build time, on every worker in the same order).
        Default: only for GPU groups, whose ranks follow interconnect links.
    """

    def __init__(
        self,
        layout,
        reduction,
        make_optimizer,
        level: str = "v1",
        jit_compile: bool = False,
        measure_ranks: bool | None = None,
    ):
        if level not in ("v0", "v1"):
            raise ValueError(f"zero.level must be 'v0' or 'v1'. Received: {level!r}")
        self.layout = layout
        self.reduction = reduction
        self.level = level
        self._exchange = zero_reduce_scatter if level == "v1" else zero_all_reduce
        state = layout.state
        self.layouts = []  # layouts[stage], indexed by model trainable index
        # owned[stage][member]: model indices the stage group's local member owns; the
        # members of stage k are the local lanes `layout.stage_lanes[k]` (every local
        # lane, unless a replica spans workers and stage k runs on another one).
        self.owned = []
        for k, group in enumerate(layout.stage_groups):
            on_gpu = any(tf.DeviceSpec.from_string(d).device_type == "GPU" for d in group.devices)
            if group.size > 1 and (on_gpu if measure_ranks is None else measure_ranks):
                group.measure_ranks()
            idx = layout.trainable_idx[k]
            variables = [state.model_trainable[i] for i in idx]
            layouts = make_layouts(
                [v.shape for v in variables], [v.dtype for v in variables], group.size, indices=idx
            )
            self.layouts.append(layouts)
            self.owned.append([owned_indices(layouts, r) for r in lane_shards(group, layouts)])
        # optimizers[lane][stage]: None when the lane owns nothing in that stage here.
        self.optimizers = [
            [
                make_optimizer(lane.devices[k], [state.trainable[li][i] for i in owned])
                if (owned := self.owned_by(k, li))
                else None
                for k in range(layout.num_stages)
            ]
            for li, lane in enumerate(layout.lanes)
        ]
        self.steps = [
            [
                OptimizerStep(
                    optimizer,
                    [state.trainable[li][i] for i in self.owned_by(k, li)],
                    lane.devices[k],
                    jit_compile,
                )
                if optimizer is not None
                else None
                for k, optimizer in enumerate(lane_optimizers)
            ]
            for li, (lane, lane_optimizers) in enumerate(zip(layout.lanes, self.optimizers))
        ]
        self.reduced_agree = False  # each lane holds the reduced gradients of its shard

    def owned_by(self, k: int, li: int) -> list[int]:
        """The stage-k variables local lane li owns ([] if stage k runs elsewhere)."""
        members = self.layout.stage_lanes[k]
        return self.owned[k][members.index(li)] if li in members else []

    def __call__(self, lane_grads: list[list]) -> None:
        self.apply(self.reduce(lane_grads))
        self.finish()

    def reduce(self, lane_grads: list[list]) -> list[list[list]]:
        """owned_grads[stage][lane]: each lane's reduced gradients of what it owns."""
        if self.reduction.clip_before:
            lane_grads = self.reduction.clip_each(lane_grads)
        owned_grads = [
            self._reduce_stage(k, group, lane_grads)
            for k, group in enumerate(self.layout.stage_groups)
        ]
        if self.reduction.clip_after:
            owned_grads = self._clip_owned(owned_grads)
        return owned_grads

    def reduced_of_lane(self, owned_grads: list[list[list]], li: int) -> list:
        return [g for stage in owned_grads for g in stage[li]]

    def finish(self) -> None:
        """Every lane gathers the updated shards (unchanged ones after a skipped step)."""
        self._gather()

    def _reduce_stage(self, k: int, group, lane_grads: list[list]) -> list[list]:
        """Each lane's reduced gradients of the stage-k variables it owns.

        Sparse gradients (an Embedding's IndexedSlices) stay sparse: their rows are
        all-gathered (as in plain data parallelism) and only the owner applies them, so
        the optimizer sees what Keras sees. Densifying them would change the update:
        Adam squares each row of a slice before summing repeated indices.
        """
        method = self.reduction.method
        members = self.layout.stage_lanes[k]
        merged: list[list] = [[] for _ in self.layout.lanes]
        if not members:  # the stage runs on other workers only
            return merged
        member_grads = [lane_grads[li] for li in members]
        sparse = [i for i in self.layout.trainable_idx[k] if _is_slices(member_grads[0][i])]
        layouts = self.layouts[k]
        if sparse:  # the same owners, without the sparse variables in the dense buffers
            layouts = [without_indices(layout, sparse) for layout in layouts]
            layouts = [layout for layout in layouts if layout.indices]
        dense = self._exchange(
            group, layouts, member_grads, method, self.reduction.num_communicators
        )
        gathered = {
            i: comm.all_gather_slices(group, [grads[i] for grads in member_grads], method)
            for i in sparse
        }
        shards = lane_shards(group, self.layouts[k])
        for m, (li, shard) in enumerate(zip(members, shards)):
            by_index = dict(zip(owned_indices(layouts, shard), dense[m]))
            by_index.update({i: gathered[i][m] for i in sparse})
            merged[li] = [by_index[i] for i in self.owned[k][m]]
        return merged

    def apply(self, owned_grads: list[list[list]]) -> None:
        for li, lane_steps in enumerate(self.steps):
            for k, step in enumerate(lane_steps):
                if step is not None:
                    step(owned_grads[k][li])

    def _gather(self) -> None:
        layout = self.layout
        trainable = layout.state.trainable
        for k, group in enumerate(layout.stage_groups):
            owned, members = self.owned[k], layout.stage_lanes[k]
            if not members:
                continue
            # Reading after the apply: the function orders ops on the same variable.
            values = [[trainable[li][i].value for i in owned[m]] for m, li in enumerate(members)]
            full = zero_all_gather(group, self.layouts[k], values, self.reduction.num_communicators)
            for m, (li, lane_values) in enumerate(zip(members, full)):
                mine = set(owned[m])
                with tf.device(layout.lanes[li].devices[k]):
                    for i, value in lane_values.items():
                        if i not in mine:
                            trainable[li][i].assign(value)

    def _clip_owned(self, owned_grads: list[list[list]]) -> list[list[list]]:
        """Global-norm clipping after the reduction, from the owned shards of all stages."""
        layout = self.layout
        squares = []  # squares[stage][lane]: the stage's squared norm, on local lanes
        for k, group in enumerate(layout.stage_groups):
            members = layout.stage_lanes[k]
            per_lane: list = [None] * len(layout.lanes)
            if members:
                totals = zero_global_norm_squared(group, [owned_grads[k][li] for li in members])
                for li, total in zip(members, totals):
                    per_lane[li] = total
            squares.append(per_lane)
        clipped = [[list(grads) for grads in stage] for stage in owned_grads]
        limit = self.reduction.clip_global_norm
        for li, lane in enumerate(layout.lanes):
            local_stages = layout.local_stages(li)
            with tf.device(lane.devices[local_stages[0]]):
                total = tf.add_n([squares[k][li] for k in local_stages])
            total = sum_over_lane(layout, li, total)  # stages on other workers add theirs
            with tf.device(lane.devices[local_stages[0]]):
                factor = limit / tf.maximum(tf.sqrt(total), limit)
            for k in local_stages:
                with tf.device(lane.devices[k]):
                    clipped[k][li] = [scaled(g, factor) for g in owned_grads[k][li]]
        return clipped

    def local_optimizers(self) -> list[tuple[int, object, list]]:
        """[(local lane position, optimizer, the variables it updates)] on this worker."""
        return [
            (li, step.optimizer, step.variables)
            for li, lane_steps in enumerate(self.steps)
            for step in lane_steps
            if step is not None
        ]

    def slot_owners(self) -> dict[int, str]:
        """{trainable index: the stage device of the lane (on any worker) that owns its
        shard}: the only lane holding that variable's optimizer slots."""
        owners = {}
        for k, layouts in enumerate(self.layouts):
            group = self.layout.stage_groups[k]
            device_of_rank = {group.rank_of(d): d for d in group.devices}
            owners.update({i: device_of_rank[r] for i, r in owner_of(layouts).items()})
        return owners

    def gradient_bytes(self) -> dict[str, int]:
        """Bytes of reduced gradients per compute device: the owned block under v1, the
        whole stage under v0 (the per-lane accumulated gradients are full in both)."""
        usage = {}
        for k, layouts in enumerate(self.layouts):
            if self.level == "v1":
                count = sum(x.block_size * tf.as_dtype(x.dtype).size for x in layouts)
            else:
                count = sum(shard_bytes(layouts))
            for li in self.layout.stage_lanes[k]:
                device = self.layout.lanes[li].devices[k]
                usage[device] = usage.get(device, 0) + count
        return usage

    def optimizer_shard_bytes(self) -> list[list[int]]:
        """[stage][shard] bytes of variables each shard owns (slots scale with it)."""
        return [shard_bytes(layouts) for layouts in self.layouts]

    def all_optimizer_variables(self) -> list:
        return [v for lane in self.optimizers for o in lane if o is not None for v in o.variables]
