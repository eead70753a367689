"""ZeRO: optimizer state (v0), gradients (v1) and parameters (v2) sharded over the
data-parallel lanes.

Each stage's variables are cut into equal contiguous ranges, one per member of the
stage's collective group (zero_layout.py: per dtype and `communication.max_splits`
bucket, cuts on row boundaries), so every member owns total/N elements whatever the
variable sizes. A member's optimizer is built on its *pieces*: one variable per piece
holding the owned rows (DeepSpeed's master partition), refreshed from the lane's copy
each step, so the lane's variables stay the truth for checkpoints, `set_weights` and
evaluation. The optimizer's slots exist for the pieces only: the memory saving, and the
optimizer state of every member (pieces and slots) is total/N within one row.
Optimizers that are not element-wise (LAMB, per-variable `clipnorm`) get whole
variables instead (balance is then bounded by the largest one). Under v2 the pieces are
the only copy of the parameters: the lanes read them through `GatheredParameter`s
(zero_params.py), or, for a stage group spanning workers, through their own all-gathers
(`MemberParameter`s, zero_gather.py), and steps 0 and 4 below do not exist.

One step, in this order:

0. (v0, v1) the pieces take the lane's values (a checkpoint restore or `set_weights`
   wrote those);
1. v1 and v2: each micro-batch's dense gradients are reduce-scattered as soon as backward
   makes them (`MicroBatchGradients`, filled by the lane executors) and summed into the
   member's shard, so no device holds the accumulated gradient of the whole stage;
   v0: gradients accumulate per lane, then all-reduce, each member keeping its pieces;
   sparse gradients (an Embedding's rows) are all-gathered and each owner keeps its rows;
2. [global-norm clipping over the owned pieces];
3. each member applies its optimizer to its pieces;
4. (v0, v1) the updated pieces are all-gathered and every lane assigns what it did not
   update.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from epl_trainer.core import comm
from epl_trainer.core.engine.precision import unscale_gradients
from epl_trainer.core.engine.update import (
    OptimizerStep,
    balanced_groups,
    clipped_by,
    scaled,
    sum_over_lane,
    written,
)
from epl_trainer.core.engine.zero import exchange
from epl_trainer.core.engine.zero.gather import MemberParameter, StageGather
from epl_trainer.core.engine.zero.layout import make_layouts, shard_bytes
from epl_trainer.core.engine.zero.params import GatheredParameter

LEVELS = ("v0", "v1", "v2")
SHARDS_GRADIENTS = ("v1", "v2")


class MicroBatchGradients:
    """ZeRO v1's gradients, one micro-batch at a time: the lane executors hand over each
    backward's dense gradients (`add`) instead of accumulating them; once every local
    lane has, the program calls `flush(stage)`, which reduce-scatters them over the stage
    group at once and sums each member's pieces into its running total (`take` gives
    the totals to the update). `flush` returns, per lane, tensors the stage's next task
    waits for, so a micro-batch's full gradients are freed before the next backward:
    the running totals, whose adds then drive a control dependency, which grappler's
    arithmetic optimizer leaves as they are (it rewrites a chain of adds nothing waits
    for into one AddN over every micro-batch's pieces, run after the last backward).

    Args:
      reduce_micro_batch: `(stage, per-member {index: gradient}) -> per-member
        {piece key: reduced piece}`.

    Attributes:
      scale: None, or the AMP loss scale (a callable): the totals are unscaled after
        the reduction, as the other gradients are before it.
      correction: None, or a factor the step sets before the update (a loss divisor
        known only from the data, program.py): the totals are multiplied by it.
    """

    def __init__(self, reduce_micro_batch, covered: frozenset):
        self._reduce = reduce_micro_batch
        self.covered = covered  # model indices the ZeRO layouts hold (not split shards)
        self.scale = None
        self.correction = None
        self.clear()

    def clear(self) -> None:
        self.correction = None
        self.pending: dict[tuple[int, int], dict] = {}
        self.totals: dict[int, list[dict]] = {}

    def add(self, lane_position: int, stage: int, grads: dict) -> None:
        self.pending[(lane_position, stage)] = grads

    def flush(self, stage: int) -> dict[int, list]:
        lanes = sorted(li for li, k in self.pending if k == stage)
        if not lanes:
            return {}
        reduced = self._reduce(stage, [self.pending.pop((li, stage)) for li in lanes])
        totals = self.totals.setdefault(stage, [{} for _ in lanes])
        for total, pieces in zip(totals, reduced):
            for key, value in pieces.items():
                with tf.device(value.device):
                    total[key] = value if key not in total else total[key] + value
        return {
            li: [total[key] for key in pieces] for li, total, pieces in zip(lanes, totals, reduced)
        }

    def take(self, stage: int) -> list[dict] | None:
        return self.totals.pop(stage, None)


class ZeroUpdate:
    """Sharded update for `zero.level` "v0" / "v1" / "v2"; a drop-in for `ReplicatedUpdate`.

    Args:
      layout: the step layout (lanes, stage groups, stages' variables, state).
      reduction: the gradient reduction and clipping settings (reduce.py).
      make_optimizer: `(device, variables) -> built Keras optimizer`; `split_variables`
        says whether it may get pieces (`zero_layout.splits_variables`).
      level: "v0", "v1" or "v2".
      jit_compile: compile each shard's optimizer update with XLA (True, False or
        "auto": by the shard's size, apply.py).
      measure_ranks: run `CollectiveGroup.measure_ranks()` on every stage group (one
        tiny eager gather each, at build time, on every worker in the same order).
        Default: only for GPU groups, whose ranks follow interconnect links.
      split_variables: cut variables into pieces (element-wise optimizers).
      row_aligned: model indices of variables whose gradient can be IndexedSlices (an
        Embedding's table): cut on row boundaries, so sparse rows split by index.
      apply_device: where the pieces, their optimizer state and update live (offload,
        as ZeRO-Offload: the host; the lanes' variables are then the host's shared copy).
        None: each member's stage device.
      num_apply_group: `optimizer.num_apply_group`: each member's update runs as this
        many size-balanced groups of pieces, one after the other (update.py).
    """

    def __init__(
        self,
        layout,
        reduction,
        make_optimizer,
        level: str = "v1",
        jit_compile: bool | str = False,
        measure_ranks: bool | None = None,
        split_variables: bool = True,
        row_aligned: frozenset = frozenset(),
        apply_device: str | None = None,
        num_apply_group: int = 1,
    ):
        if level not in LEVELS:
            raise ValueError(f"zero.level must be one of {LEVELS}. Received: {level!r}")
        self.layout = layout
        self.reduction = reduction
        self.level = level
        self.apply_device = apply_device
        state = layout.state
        # v2 stages whose group has members on other workers read by all-gathers.
        self.spanning_stages = [
            k
            for k, group in enumerate(layout.stage_groups)
            if level == "v2" and tuple(group.local_devices) != tuple(group.devices)
        ]
        self.stage_gathers = []  # their reads (zero_gather.StageGather), one per stage
        # v1 and v2 shard each micro-batch's gradients (clipping before the reduction needs
        # each lane's whole gradient, so then they accumulate first).
        self.micro_batch_grads = (
            MicroBatchGradients(
                self._reduce_micro_batch,
                frozenset(i for i in range(len(state.model_trainable)) if i not in state.sharded),
            )
            if level in SHARDS_GRADIENTS and not reduction.clip_before
            else None
        )
        self.layouts = []  # layouts[stage]
        self.shards = []  # shards[stage][member]: the member's rank in the stage group
        self.pieces = []  # pieces[stage][member]: [(layout number, Piece)] it owns
        for k, group in enumerate(layout.stage_groups):
            on_gpu = any(tf.DeviceSpec.from_string(d).device_type == "GPU" for d in group.devices)
            if group.size > 1 and (on_gpu if measure_ranks is None else measure_ranks):
                group.measure_ranks()
            # Split layers' shards are not replicated: each lane updates its own (below).
            idx = [i for i in layout.trainable_idx[k] if i not in state.sharded]
            variables = [state.model_trainable[i] for i in idx]
            layouts = make_layouts(
                [v.shape for v in variables],
                [v.dtype for v in variables],
                group.size,
                max_splits=getattr(reduction, "max_splits", 1),
                indices=idx,
                split_variables=split_variables,
                row_aligned=row_aligned,
            )
            self.layouts.append(layouts)
            shards = exchange.member_shards(group, layouts) if layout.stage_lanes[k] else []
            self.shards.append(shards)
            self.pieces.append(
                [
                    [(b, p) for b, x in enumerate(layouts) for p in x.pieces[shard]]
                    for shard in shards
                ]
            )
        # piece_variables[stage][member]: what the member's optimizer updates, one
        # variable per piece, holding its rows.
        self.piece_variables = [
            [
                [self._piece_variable(k, li, p) for _, p in self.pieces[k][m]]
                for m, li in enumerate(layout.stage_lanes[k])
            ]
            for k in range(layout.num_stages)
        ]
        # groups[stage][member]: positions in its pieces, one list per apply group.
        self.groups = [
            [
                balanced_groups([p.size for _, p in pieces], num_apply_group) if pieces else []
                for pieces in self.pieces[k]
            ]
            for k in range(layout.num_stages)
        ]
        # steps[lane][stage]: the member's updates, one per apply group ([] if none).
        self.steps = [[[] for _ in range(layout.num_stages)] for _ in layout.lanes]
        for k in range(layout.num_stages):
            for m, li in enumerate(layout.stage_lanes[k]):
                device = self._apply_device(k, li)
                for group in self.groups[k][m]:
                    variables = [self.piece_variables[k][m][j] for j in group]
                    optimizer = make_optimizer(device, variables)
                    self.steps[li][k].append(
                        OptimizerStep(optimizer, variables, device, jit_compile)
                    )
        # Split layers (split.py): every lane updates its own slices of the split weights,
        # after they are reduced over the replicas (the lane hooks), as without ZeRO.
        self.split_idx = [
            [i for i in layout.trainable_idx[k] if i in state.sharded]
            for k in range(layout.num_stages)
        ]
        self.split_steps = [
            [
                OptimizerStep(
                    make_optimizer(lane.devices[k], [state.trainable[li][i] for i in idx]),
                    [state.trainable[li][i] for i in idx],
                    lane.devices[k],
                    jit_compile,
                )
                if idx and lane.is_local(k)
                else None
                for k, idx in enumerate(self.split_idx)
            ]
            for li, lane in enumerate(layout.lanes)
        ]
        self.reduced_agree = False  # each lane holds the reduced gradients of its shard
        if level == "v2":
            state.hold_in_pieces(self._gathered_parameters(), self.stage_gathers)

    def _gathered_parameters(self) -> dict:
        """v2: {trainable index: its stand-in over the pieces of every member}; for a
        stage whose group spans workers, {trainable index: {lane: its MemberParameter}}."""
        state, views = self.layout.state, {}
        for k in range(self.layout.num_stages):
            if k in self.spanning_stages:
                views.update(self._member_parameters(k))
                continue
            found: dict[int, list] = {}
            for pieces, variables in zip(self.pieces[k], self.piece_variables[k]):
                for (_, piece), variable in zip(pieces, variables):
                    found.setdefault(piece.index, []).append((piece, variable))
            for i, pairs in found.items():
                views[i] = GatheredParameter(state.model_trainable[i], pairs)
        return views

    def _member_parameters(self, k: int) -> dict[int, dict]:
        reads = StageGather(
            self.layout.stage_groups[k],
            self.layouts[k],
            self.shards[k],
            self.pieces[k],
            self.piece_variables[k],
            self.reduction.num_communicators,
        )
        self.stage_gathers.append(reads)
        state, views = self.layout.state, {}
        for m, li in enumerate(self.layout.stage_lanes[k]):
            own: dict[int, list] = {}
            for (_, piece), variable in zip(self.pieces[k][m], self.piece_variables[k][m]):
                own.setdefault(piece.index, []).append((piece, variable))
            for layout in self.layouts[k]:
                for i in layout.indices:
                    original = state.model_trainable[i]
                    views.setdefault(i, {})[li] = MemberParameter(
                        original, i, reads, m, own.get(i, [])
                    )
        return views

    def _apply_device(self, k: int, li: int) -> str:
        return self.apply_device or self.layout.lanes[li].devices[k]

    def _piece_variable(self, k: int, li: int, piece):
        lane_variable = self.layout.state.trainable[li][piece.index]
        with tf.device(self._apply_device(k, li)):
            copy = keras.Variable(
                exchange.elements_of(lane_variable.value, piece),
                dtype=lane_variable.dtype,
                trainable=True,
                name=lane_variable.name,
            )
        state = self.layout.state
        state.adopt(copy, state.original_of(lane_variable))
        return copy

    def members_of(self, k: int) -> list[int]:
        return list(self.layout.stage_lanes[k])

    def __call__(self, lane_grads: list[list]) -> None:
        self.apply(self.reduce(lane_grads))
        self.finish()

    # ---- reduce --------------------------------------------------------------------------

    def reduce(self, lane_grads: list[list]) -> list[list[list]]:
        """owned[stage][lane]: each lane's reduced gradients of its pieces (piece order)."""
        if self.reduction.clip_before:
            lane_grads = self.reduction.clip_each(lane_grads)
        self._refresh_pieces()
        owned = [self._reduce_stage(k, group, lane_grads)
                 for k, group in enumerate(self.layout.stage_groups)]  # fmt: skip
        if any(self.split_idx):
            reduced = [list(grads) for grads in lane_grads]
            self.reduction.lane_hooks.reduce_sharded(lane_grads, reduced)
            for k, idx in enumerate(self.split_idx):
                for li in range(len(self.layout.lanes)):
                    if self.split_steps[li][k] is not None:
                        owned[k][li] = owned[k][li] + [reduced[li][i] for i in idx]
        if self.reduction.clip_after:
            owned = self._clip_owned(owned)
        return owned

    def _refresh_pieces(self) -> None:
        """Piece variables take the rows of the lane's copy (restored, or set by the user);
        under v2 the pieces are the only copy."""
        if self.level == "v2":
            return
        state = self.layout.state
        for k in range(self.layout.num_stages):
            for m, li in enumerate(self.layout.stage_lanes[k]):
                with tf.device(self._apply_device(k, li)):
                    for (_, piece), variable in zip(self.pieces[k][m], self.piece_variables[k][m]):
                        source = state.trainable[li][piece.index].value
                        variable.assign(exchange.elements_of(source, piece))

    def _reduce_stage(self, k: int, group, lane_grads: list[list]) -> list[list]:
        """Each lane's reduced gradients of its stage-k pieces.

        Sparse gradients (an Embedding's IndexedSlices) stay sparse: their rows are
        all-gathered (as in plain data parallelism) and each owner keeps its rows, so the
        optimizer sees what Keras sees (Adam squares each row of a slice before repeated
        indices are summed; densifying first would change the update).
        """
        method = self.reduction.method
        members = self.members_of(k)
        merged: list[list] = [[] for _ in self.layout.lanes]
        if not members:  # the stage runs on other workers only
            return merged
        sharded = self.layout.state.sharded
        idx = [i for i in self.layout.trainable_idx[k] if i not in sharded]
        member_grads = [lane_grads[li] for li in members]
        sparse = {i for i in idx if isinstance(member_grads[0][i], tf.IndexedSlices)}
        chains = self.reduction.num_communicators
        wire = getattr(self.reduction, "wire_fp16_scale", None)
        layouts = self.layouts[k]
        totals = self.micro_batch_grads.take(k) if self.micro_batch_grads else None
        if totals is not None:  # v1: reduce-scattered micro-batch by micro-batch
            dense = totals
            if self.micro_batch_grads.scale is not None:
                scale = self.micro_batch_grads.scale()
                dense = [dict(zip(d, unscale_gradients(list(d.values()), scale))) for d in dense]
            if self.micro_batch_grads.correction is not None:
                factor = self.micro_batch_grads.correction
                dense = [{key: scaled(g, factor) for key, g in d.items()} for d in dense]
        elif self.level in SHARDS_GRADIENTS:  # accumulated first (clipping before the reduction)
            as_dicts = [[{i: grads[i] for i in idx if i not in sparse} for grads in member_grads]]
            dense = exchange.reduce_scatter_pieces(
                group, layouts, as_dicts, sparse, method, chains, wire
            )
        else:
            as_dicts = [{i: grads[i] for i in idx if i not in sparse} for grads in member_grads]
            dense = exchange.all_reduce_pieces(
                group, layouts, as_dicts, sparse, method, chains, wire
            )
        gathered = {
            i: comm.all_gather_slices(group, [grads[i] for grads in member_grads], method)
            for i in sorted(sparse, reverse=True)
        }
        for m, (li, device) in enumerate(zip(members, group.local_devices)):
            grads = []
            for b, piece in self.pieces[k][m]:
                if piece.index in sparse:
                    with tf.device(device):
                        grads.append(exchange.piece_of_slices(gathered[piece.index][m], piece))
                else:
                    grads.append(dense[m][(b, piece.position)])
            merged[li] = grads
        return merged

    def _reduce_micro_batch(self, k: int, member_grads: list[dict]) -> list[dict]:
        """One micro-batch's dense stage-k gradients, reduce-scattered into pieces."""
        group, members = self.layout.stage_groups[k], self.members_of(k)
        if len(member_grads) != len(members):
            raise ValueError(
                f"Stage {k}'s gradients come from {len(member_grads)} lanes; its group has "
                f"{len(members)} members here."
            )
        sparse = set(self.layout.trainable_idx[k]) - set(member_grads[0])
        return exchange.reduce_scatter_pieces(
            group,
            self.layouts[k],
            [member_grads],
            sparse,
            self.reduction.method,
            self.reduction.num_communicators,
            getattr(self.reduction, "wire_fp16_scale", None),
        )

    def reduced_of_lane(self, owned_grads: list[list[list]], li: int) -> list:
        return [g for stage in owned_grads for g in stage[li]]

    def _clip_owned(self, owned_grads: list[list[list]]) -> list[list[list]]:
        """Global-norm clipping after the reduction, from the owned pieces of all stages."""
        layout = self.layout
        squares = []  # squares[stage][lane]: the stage's squared norm, on local lanes
        for k, group in enumerate(layout.stage_groups):
            members = self.members_of(k)
            per_lane: list = [None] * len(layout.lanes)
            if members:
                grads = [self._piece_part(k, li, owned_grads[k][li]) for li in members]
                for li, total in zip(members, exchange.global_norm_squared(group, grads)):
                    per_lane[li] = total
            squares.append(per_lane)
        clipped = [[list(grads) for grads in stage] for stage in owned_grads]
        limit = self.reduction.clip_global_norm
        for li, lane in enumerate(layout.lanes):
            local_stages = layout.local_stages(li)
            split_squares = self._split_norm_squares(li, owned_grads)
            with tf.device(lane.devices[local_stages[0]]):
                total = tf.add_n([squares[k][li] for k in local_stages] + split_squares)
            total = sum_over_lane(layout, li, total)  # stages on other workers add theirs
            with tf.device(lane.devices[local_stages[0]]):
                factor = limit / tf.maximum(tf.sqrt(total), limit)
            for k in local_stages:
                with tf.device(lane.devices[k]):
                    clipped[k][li] = [clipped_by(g, factor) for g in owned_grads[k][li]]
        return clipped

    def _piece_part(self, k: int, li: int, grads: list) -> list:
        """A lane's owned gradients of stage k without the split shards' (appended last)."""
        return grads[: len(grads) - len(self.split_idx[k])] if self.split_idx[k] else grads

    def _split_norm_squares(self, li: int, owned_grads: list[list[list]]) -> list:
        """The split shards' squared norm summed over the lane's replica (lane hooks)."""
        if not any(self.split_idx):
            return []
        grads = [None] * len(self.layout.state.model_trainable)
        for k, idx in enumerate(self.split_idx):
            if idx and owned_grads[k][li]:
                for i, g in zip(idx, owned_grads[k][li][-len(idx) :]):
                    grads[i] = g
        return self.reduction.lane_hooks.shard_norm_squares(li, grads)

    # ---- apply and gather ----------------------------------------------------------------

    def apply(self, owned_grads: list[list[list]]) -> None:
        for k in range(self.layout.num_stages):
            for m, li in enumerate(self.members_of(k)):
                grads, variables = owned_grads[k][li], self.piece_variables[k][m]
                previous = []
                # Last layers first (backward's order); each group waits for the one before,
                # so one group's temporaries are freed before the next starts.
                split_step = self.split_steps[li][k]
                if split_step is not None:
                    split_step(grads[len(grads) - len(self.split_idx[k]) :])
                pairs = list(zip(self.groups[k][m], self.steps[li][k]))[::-1]
                for position, (group, step) in enumerate(pairs):
                    with tf.control_dependencies(previous):
                        step([grads[j] for j in group])
                        if position + 1 < len(pairs):
                            with tf.device(step.device):
                                previous = written([variables[j] for j in group])

    def finish(self) -> None:
        """Every lane gathers the updated pieces (unchanged ones after a skipped step) and
        assigns its copy of every variable; under v2 the next read gathers them."""
        if self.level == "v2":
            return
        layout = self.layout
        trainable = layout.state.trainable
        for k, group in enumerate(layout.stage_groups):
            members = self.members_of(k)
            if not members:
                continue
            # Reading after the apply: the function orders ops on the same variable.
            values = [
                {(b, p.position): v.value for (b, p), v in zip(pieces, variables)}
                for pieces, variables in zip(self.pieces[k], self.piece_variables[k])
            ]
            full = exchange.gather_pieces(
                group, self.layouts[k], values, self.reduction.num_communicators
            )
            assigned: set[int] = set()  # with offload the lanes share one copy
            for li, lane_values in zip(members, full):
                with tf.device(layout.lanes[li].devices[k]):
                    for i, value in lane_values.items():
                        if id(trainable[li][i]) not in assigned:
                            assigned.add(id(trainable[li][i]))
                            trainable[li][i].assign(value)

    # ---- reports and checkpoints -----------------------------------------------------------

    def local_optimizers(self) -> list[tuple[int, object, list]]:
        """[(local lane position, optimizer, the variables it updates)] on this worker."""
        pieces = [
            (li, step.optimizer, step.variables)
            for li, lane_steps in enumerate(self.steps)
            for stage_steps in lane_steps
            for step in stage_steps
        ]
        split = [
            (li, step.optimizer, step.variables)
            for li, lane_steps in enumerate(self.split_steps)
            for step in lane_steps
            if step is not None
        ]
        return pieces + split

    def slot_owners(self) -> dict[int, str]:
        """{trainable index: the stage device of the lane (on any worker) owning it whole}:
        the only lane holding that variable's optimizer slots. Variables cut into pieces
        are not listed (each piece is held by exactly one lane, `piece_spans`)."""
        owners = {}
        for k, layouts in enumerate(self.layouts):
            group = self.layout.stage_groups[k]
            device_of_rank = {group.rank_of(d): d for d in group.devices}
            for layout in layouts:
                for r, pieces in enumerate(layout.pieces):
                    owners.update({p.index: device_of_rank[r] for p in pieces if p.whole})
        return owners

    @property
    def state_spans_workers(self) -> bool:
        """Whether some optimizer state lives only on other workers: the shards of a stage
        group with members there, or a stage there (master_state.py exchanges it)."""
        groups = self.layout.stage_groups
        spans = any(set(group.local_devices) != set(group.devices) for group in groups)
        return spans or self.layout.spans_workers or bool(self.layout.state.blocks_elsewhere())

    def piece_spans(self) -> dict[int, tuple[int, int, int | None, int | None]]:
        """{id(piece variable): (local lane position, trainable index, first element, end
        element)} for the pieces held here; the elements are None for a whole variable."""
        rows = {}
        for k in range(self.layout.num_stages):
            for m, li in enumerate(self.members_of(k)):
                for (_, p), v in zip(self.pieces[k][m], self.piece_variables[k][m]):
                    span = (None, None) if p.whole else (p.start, p.stop)
                    rows[id(v)] = (li, p.index, *span)
        return rows

    def gradient_bytes(self) -> dict[str, int]:
        """Bytes of reduced gradients per compute device: the owned pieces under v1 and v2;
        under v0 the whole stage (all-reduced before the pieces are kept)."""
        usage = {}
        for k, layouts in enumerate(self.layouts):
            per_shard = shard_bytes(layouts)
            whole = sum(per_shard)
            for m, li in enumerate(self.members_of(k)):
                device = self.layout.lanes[li].devices[k]
                count = per_shard[self.shards[k][m]] if self.level in SHARDS_GRADIENTS else whole
                usage[device] = usage.get(device, 0) + count
        return usage

    def optimizer_shard_bytes(self) -> list[list[int]]:
        """[stage][shard] bytes of variables each shard owns (slots scale with it)."""
        return [shard_bytes(layouts) for layouts in self.layouts]

    def all_optimizer_variables(self) -> list:
        """Slots and counters, and the piece variables (the owned rows' master copy, part of
        the shard's optimizer state as in the ZeRO paper's K = 12 bytes per parameter),
        except under v2, where the pieces are the parameters (`parameter_pieces`)."""
        slots = [v for _, optimizer, _ in self.local_optimizers() for v in optimizer.variables]
        return slots + ([] if self.level == "v2" else self._all_pieces())

    def parameter_pieces(self) -> list:
        """v2: the piece variables, the only copy of the parameters ([] under v0, v1)."""
        return self._all_pieces() if self.level == "v2" else []

    def _all_pieces(self) -> list:
        return [v for stage in self.piece_variables for member in stage for v in member]

    @property
    def optimizers(self) -> list[list[list]]:
        """optimizers[lane][stage]: the member's optimizers, one per apply group."""
        return [[[step.optimizer for step in steps] for steps in lane] for lane in self.steps]

    def owned_pieces(self, k: int, li: int) -> list:
        """The pieces local lane li owns in stage k ([] if stage k runs elsewhere)."""
        members = self.members_of(k)
        return [p for _, p in self.pieces[k][members.index(li)]] if li in members else []
