"""Automatic pipeline partition: cut an unannotated functional model into S contiguous
stages balanced by the static cost model (`core/graph/cost.py`).

Steps, in order:

1. Cost every compute node (`cost.nodes_cost`), in topological order.
2. Find repeated blocks (`find_repeated_blocks`): runs of consecutive nodes whose
   structural signatures (class, weight shapes, input/output shapes, dtypes) repeat
   with a fixed period, e.g. 12 transformer layers built from plain layers (7 nodes
   each) or 12 calls of a custom block Layer (1 node each). Blocks are found by their
   position in the graph, never by layer names.
3. Candidate cuts (`cut_candidates`): the boundaries between consecutive blocks when
   blocks carry most of the model's FLOPs, otherwise every node boundary. Nodes before
   the first block (embeddings) join the first stage and nodes after the last (the head)
   the last stage. A cut never separates two calls of the same layer, nor two users of
   the same weight (tied input and output embeddings, a layer inside a nested model
   called again outside it): `partition_model` keeps each weight in one stage.
4. Choose S-1 cuts among the candidates (`estimate.partition_stages`, the same cut
   `epl-plan` makes for models it only knows by their sizes): an exact dynamic program
   minimising the largest stage cost, ties broken by the smallest largest stage
   parameter count, then by the earliest cuts.

Steps 1-3 make the model's `estimate.ModelCost` (`model_cost`); `AutoPartition.estimate`
hands it, with the cut, to the estimator for per-device memory and communication.

Stage cost = forward FLOPs per sample. The backward pass costs ~2x the forward of the
same layers, so it does not move the best cut; parameter counts only break ties.

Stages are contiguous in topological order, so every stage only consumes model inputs
and outputs of earlier stages; `core.partition.partition_model` routes skip connections
that jump over a stage.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from epl_trainer.core.graph.cost import NodeCost, format_bytes, nodes_cost, tensor_bytes
from epl_trainer.core.graph.partition import compute_nodes, tensor_key
from epl_trainer.core.plan import estimate
from epl_trainer.core.plan.estimate import balanced_cuts
from epl_trainer.core.plan.ir import StrategySpec, format_count

__all__ = [
    "CUT_AT",
    "AutoPartition",
    "CutCandidates",
    "RepeatedRun",
    "auto_partition",
    "balanced_cuts",
    "boundary_bytes",
    "cut_candidates",
    "find_repeated_blocks",
    "model_cost",
    "node_signature",
]

CUT_AT = ("blocks", "nodes")
# Repeated blocks are used as the cut grid only when they carry at least this share of
# the model's FLOPs; otherwise a few accidental repeats would forbid good cuts.
MIN_BLOCK_FLOPS_SHARE = 0.5


@dataclass(frozen=True)
class RepeatedRun:
    """`count` consecutive blocks of `period` nodes each, starting at node `start`."""

    start: int
    period: int
    count: int
    kinds: tuple[str, ...]  # class names of one block's nodes

    @property
    def stop(self) -> int:
        return self.start + self.period * self.count

    @property
    def block_starts(self) -> tuple[int, ...]:
        return tuple(self.start + i * self.period for i in range(self.count))

    def describe(self) -> str:
        kinds = ", ".join(self.kinds[:8]) + (", ..." if len(self.kinds) > 8 else "")
        noun = "node" if self.period == 1 else "nodes"
        return (
            f"{self.count} blocks of {self.period} {noun} ({kinds}) "
            f"at nodes {self.start}-{self.stop - 1}"
        )


@dataclass(frozen=True)
class CutCandidates:
    """Where stages may start: node indices in (0, num_nodes), ascending."""

    positions: tuple[int, ...]
    runs: tuple[RepeatedRun, ...]  # the blocks the positions come from (empty: nodes)
    num_nodes: int
    excluded_shared: int = 0  # positions dropped by `_outside_shared_layers`
    # What dropped them: layers called again ("layer 'x' (called 3 times)"), and
    # non-trainable weights whose users would be split ("non-trainable weight 'bn/mean'").
    excluded_layers: tuple[str, ...] = ()
    excluded_weights: tuple[str, ...] = ()

    @property
    def max_stages(self) -> int:
        return len(self.positions) + 1

    @property
    def num_blocks(self) -> int:
        return sum(run.count for run in self.runs)

    def describe(self) -> str:
        if not self.runs:
            text = f"no repeated blocks; cuts may fall between any of the {self.num_nodes} nodes"
        else:
            text = "; ".join(run.describe() for run in self.runs) + "; cuts only between blocks"
        if self.excluded_shared:
            text += f" ({self.excluded_shared} cut(s) excluded: {self.exclusions()})"
        return text

    def exclusions(self) -> str:
        """Why the excluded cuts are, naming the layers and weights."""
        reasons = []
        if self.excluded_layers:
            reasons.append(
                "a stage would read the output of a layer it calls again, which Keras "
                f"cannot cut: {_listed(self.excluded_layers)}"
            )
        if self.excluded_weights:
            reasons.append(
                "the users of a non-trainable weight (BatchNorm statistics) would be split, "
                f"which must live in one stage: {_listed(self.excluded_weights)}"
            )
        return "; ".join(reasons)


def _listed(names: Sequence[str], limit: int = 3) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


@dataclass(frozen=True, eq=False)
class AutoPartition:
    """The result of `auto_partition`: stage of every node, costs and cuts."""

    model_name: str
    nodes: tuple  # compute nodes in topological order
    costs: tuple[NodeCost, ...]  # aligned with `nodes`
    cuts: tuple[int, ...]  # node index where stage 1, 2, ... S-1 starts
    candidates: CutCandidates
    boundary_bytes: tuple[int, ...]  # activation bytes per sample crossing each cut
    model_cost: estimate.ModelCost | None = None  # what the cut was chosen on

    @property
    def num_stages(self) -> int:
        return len(self.cuts) + 1

    @property
    def stage_ranges(self) -> tuple[tuple[int, int], ...]:
        """[start, stop) node indices of every stage."""
        bounds = (0, *self.cuts, len(self.nodes))
        return tuple(itertools.pairwise(bounds))

    @property
    def node_stage(self) -> dict:
        """Node -> stage index, for every compute node (what `partition_model` takes)."""
        return {
            node: stage
            for stage, (start, stop) in enumerate(self.stage_ranges)
            for node in self.nodes[start:stop]
        }

    @property
    def stage_costs(self) -> tuple[float, ...]:
        """Forward FLOPs per sample of every stage."""
        return tuple(float(sum(c.flops for c in self.costs[a:b])) for a, b in self.stage_ranges)

    @property
    def stage_params(self) -> tuple[int, ...]:
        return tuple(sum(c.params for c in self.costs[a:b]) for a, b in self.stage_ranges)

    @property
    def spread(self) -> float:
        """max / min stage cost (1.0 is perfect balance; inf if a stage costs 0)."""
        costs = self.stage_costs
        low, high = min(costs), max(costs)
        return high / low if low > 0 else (1.0 if high == 0 else float("inf"))

    @property
    def cut_names(self) -> tuple[str, ...]:
        """The first node of every stage after the first."""
        return tuple(self.costs[i].name for i in self.cuts)

    @property
    def cut_description(self) -> str:
        """One line for `Plan.summary()`: where the model was cut, and why there."""
        starts = ", ".join(
            f"node {i} {name!r}" for i, name in zip(self.cuts, self.cut_names, strict=True)
        )
        where = f"stages 1.. start at {starts}" if self.cuts else "one stage, no cut"
        return f"automatic, cost = forward FLOPs per sample; {where}; {self.candidates.describe()}"

    def taskgraph_specs(self, kind: str = "replicate", device_count: int | None = 1):
        """One `StrategySpec` per stage, named `stage_<i>`, for the planner."""
        return tuple(StrategySpec(kind, device_count, f"stage_{i}") for i in range(self.num_stages))

    def estimate(self, plan, options: estimate.TrainOptions) -> estimate.Estimate:
        """Per-device memory and communication of these stages on `plan`
        (`core/plan/estimate.py`); `plan` has one TaskGraph per stage."""
        if self.model_cost is None:
            raise ValueError("This AutoPartition was built without a model_cost.")
        return estimate.estimate(self.model_cost, plan, options, cuts=self.cuts)

    def describe(self) -> str:
        """A table of the stages with their nodes, blocks, FLOPs, parameters, the bytes
        each keeps for backward (the estimator's activations) and sends to later stages,
        per sample."""
        block_starts = [s for run in self.candidates.runs for s in run.block_starts]
        header = ("stage", "nodes", "first .. last", "blocks", "FLOPs", "params", "kept", "sends")
        rows = []
        for stage, (a, b) in enumerate(self.stage_ranges):
            blocks = [i for i, s in enumerate(block_starts) if a <= s < b]
            sends = format_bytes(self.boundary_bytes[stage]) if stage < len(self.cuts) else "-"
            rows.append(
                (
                    str(stage),
                    f"{a}-{b - 1}",
                    self.costs[a].name
                    if b - a == 1
                    else f"{self.costs[a].name} .. {self.costs[b - 1].name}",
                    f"{blocks[0]}-{blocks[-1]}" if blocks else "-",
                    format_count(self.stage_costs[stage]),
                    format_count(self.stage_params[stage]),
                    format_bytes(sum(c.kept_bytes for c in self.costs[a:b])),
                    sends,
                )
            )
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        costs = self.stage_costs
        lines = [
            f"Automatic pipeline partition of model {self.model_name!r}: "
            f"{self.num_stages} stage(s) over {len(self.nodes)} nodes; "
            "cost = forward FLOPs per sample",
            f"Candidates: {self.candidates.describe()}",
            "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip(),
            "  ".join("-" * w for w in widths),
        ]
        lines += [
            "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
        ]
        lines.append(
            f"spread max/min = {self.spread:.3f} "
            f"(max {format_count(max(costs))}, min {format_count(min(costs))})"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


# ------------------------------------------------------------------ entry point
def auto_partition(model, num_stages: int, cut_at: str = "blocks") -> AutoPartition:
    """Cuts `model` into `num_stages` contiguous stages balanced by forward FLOPs.

    Args:
      model: a functional Keras model or a built Sequential.
      num_stages: number of pipeline stages, >= 1.
      cut_at: "blocks" (default): cut only between repeated blocks when the model has
        them, else between any nodes; "nodes": between any nodes.

    Returns:
      An `AutoPartition`; `node_stage` feeds `partition_model(model, node_stage, S)`.

    Raises:
      ValueError: `num_stages` < 1 or not an int, unknown `cut_at`, or more stages
        than the model has cut points for.
      PartitionError: a subclassed model (no layer graph to cut).
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, numbers.Integral):
        raise ValueError(
            f"num_stages must be an int >= 1 (pipeline.num_stages). Received: "
            f"num_stages={num_stages!r}"
        )
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1 (pipeline.num_stages). Received: {num_stages}")
    if cut_at not in CUT_AT:
        raise ValueError(f"cut_at must be one of {CUT_AT}. Received: cut_at={cut_at!r}")
    nodes = tuple(compute_nodes(model))
    if not nodes:
        raise ValueError(f"Model {model.name!r} has no layers to cut into {num_stages} stage(s).")
    costs = tuple(nodes_cost(nodes))
    crossing = boundary_bytes(nodes)
    candidates = cut_candidates(nodes, costs, crossing, cut_at=cut_at)
    if num_stages > candidates.max_stages:
        raise ValueError(_too_many_stages(model.name, num_stages, candidates))
    cost = _model_cost(model, costs, crossing, candidates)
    cuts = estimate.partition_stages(cost, num_stages)
    return AutoPartition(
        model_name=model.name,
        nodes=nodes,
        costs=costs,
        cuts=cuts,
        candidates=candidates,
        boundary_bytes=tuple(int(crossing[i]) for i in cuts),
        model_cost=cost,
    )


def model_cost(model, cut_at: str = "blocks") -> estimate.ModelCost:
    """The estimator's view of a functional Keras model: node costs (`core/graph/cost.py`),
    stage cuts allowed by `cut_candidates` and the activation bytes crossing each.

    Gradient checkpointing is estimated with segments between the same candidates
    (one repeated block per segment), as `gradient_checkpoint.type="auto"` cuts
    transformer-like models.
    """
    if cut_at not in CUT_AT:
        raise ValueError(f"cut_at must be one of {CUT_AT}. Received: cut_at={cut_at!r}")
    nodes = tuple(compute_nodes(model))
    if not nodes:
        raise ValueError(f"Model {model.name!r} has no layers to estimate.")
    costs = tuple(nodes_cost(nodes))
    crossing = boundary_bytes(nodes)
    return _model_cost(model, costs, crossing, cut_candidates(nodes, costs, crossing, cut_at))


def _model_cost(model, costs, crossing, candidates: CutCandidates) -> estimate.ModelCost:
    inputs = list(getattr(model, "inputs", None) or [])
    return estimate.ModelCost(
        name=model.name,
        nodes=tuple(costs),
        cut_positions=candidates.positions,
        crossing_bytes=tuple(int(c) for c in crossing),
        input_bytes=sum(tensor_bytes(t) for t in inputs),
        description=f"Keras model, {len(costs)} nodes; {candidates.describe()}",
    )


def _too_many_stages(name: str, num_stages: int, candidates: CutCandidates) -> str:
    if candidates.runs:
        what = f"{candidates.num_blocks} blocks"
        why = f"cuts fall only between blocks ({candidates.describe()})"
        hint = "; auto_partition(..., cut_at='nodes') also cuts inside blocks"
    else:
        what = f"{candidates.num_nodes} compute nodes"
        why = "a stage needs at least one node"
        hint = ""
    # The trainer cuts between blocks; its users place layers by hand instead.
    hint += "; or give EPLTrainer stages={layer name pattern: stage}"
    if candidates.excluded_shared and not candidates.runs:  # else in describe()
        why += f", and {candidates.excluded_shared} cut point(s) are excluded: "
        why += candidates.exclusions()
    return (
        f"Cannot cut {num_stages} stages from model {name!r} with {what}: {why}, so at "
        f"most {candidates.max_stages} stage(s). Use pipeline.num_stages <= "
        f"{candidates.max_stages}{hint}. Received: num_stages={num_stages}"
    )


# ------------------------------------------------------------------ repeated blocks
def node_signature(node) -> tuple:
    """What makes two nodes structurally the same: class, weight shapes, input and
    output shapes (batch dim dropped) and output dtypes. Names are ignored."""
    operation = node.operation
    return (
        type(operation).__name__,
        tuple(tuple(w.shape) for w in getattr(operation, "weights", ())),
        tuple(tuple(t.shape)[1:] for t in node.input_tensors),
        tuple((tuple(t.shape)[1:], str(t.dtype)) for t in node.output_tensors),
    )


def find_repeated_blocks(
    nodes: Sequence, crossing: Sequence[int] | None = None
) -> tuple[RepeatedRun, ...]:
    """Runs of consecutive, structurally identical blocks, in node order.

    Greedy: the run covering the most nodes (ties: the shorter block) is taken, then the
    parts before and after it are searched the same way. A block must contain a node
    with weights (two ReLUs in a row are not a block). When a run can start at several
    offsets (e.g. a LayerNormalization before the first block looks like the last node
    of a block), the offset whose block boundaries carry the fewest activation bytes is
    chosen, so cuts fall where one tensor crosses rather than a residual pair
    (`crossing`, from `boundary_bytes(nodes)`; without it the earliest offset).
    """
    ids: dict[tuple, int] = {}
    signature = np.array([ids.setdefault(node_signature(n), len(ids)) for n in nodes], np.int64)
    weighted = np.array([bool(getattr(n.operation, "weights", ())) for n in nodes], dtype=bool)
    crossing = np.zeros(len(nodes) + 1) if crossing is None else np.asarray(crossing)
    runs: list[RepeatedRun] = []
    pending = [(0, len(nodes))]
    while pending:
        lo, hi = pending.pop()
        run = _best_run(signature, weighted, crossing, lo, hi)
        if run is None:
            continue
        kinds = tuple(type(n.operation).__name__ for n in nodes[run[0] : run[0] + run[1]])
        runs.append(RepeatedRun(run[0], run[1], run[2], kinds))
        pending += [(lo, run[0]), (run[0] + run[1] * run[2], hi)]
    return tuple(sorted(runs, key=lambda r: r.start))


def _best_run(signature, weighted, crossing, lo: int, hi: int):
    """(start, period, count) of the best periodic run inside [lo, hi), or None."""
    best = None  # (coverage, -period, start, count)
    for period in range(1, (hi - lo) // 2 + 1):
        same = signature[lo : hi - period] == signature[lo + period : hi]
        edges = np.diff(np.concatenate(([0], same.astype(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        # A run of matches of length L spans L + period periodic nodes.
        for first, stop in zip(starts, ends, strict=True):
            length = int(stop - first) + period
            count = length // period
            coverage = count * period
            if count < 2 or (best is not None and (coverage, -period) <= best[:2]):
                continue
            first = lo + int(first)
            if not weighted[first : first + period].any():
                continue
            offsets = range(first, first + length - coverage + 1)
            loads = [_interior_load(crossing, a, period, count) for a in offsets]
            start = offsets[int(np.argmin(loads))]
            best = (coverage, -period, start, count)
    if best is None:
        return None
    return best[2], -best[1], best[3]


def _interior_load(crossing, start: int, period: int, count: int) -> float:
    """Bytes crossing the boundaries between the blocks of a run starting at `start`."""
    return float(sum(crossing[start + i * period] for i in range(1, count)))


def cut_candidates(
    nodes: Sequence,
    costs: Sequence[NodeCost],
    crossing: Sequence[int] | None = None,
    cut_at: str = "blocks",
) -> CutCandidates:
    """Node indices where a stage may start (see the module doc, step 3)."""
    n = len(nodes)
    runs: tuple[RepeatedRun, ...] = ()
    if cut_at == "blocks":
        runs = find_repeated_blocks(nodes, crossing)
        total = sum(c.flops for c in costs)
        in_blocks = sum(c.flops for run in runs for c in costs[run.start : run.stop])
        if total > 0 and in_blocks < MIN_BLOCK_FLOPS_SHARE * total:
            runs = ()
    if runs:
        positions = set()
        for run in runs:
            positions.update(run.block_starts[1:])
        for before, after in itertools.pairwise(runs):
            positions.update((before.stop, after.start))  # either side of the nodes between
    else:
        positions = set(range(1, n))
    valid = [p for p in sorted(positions) if 0 < p < n]
    allowed, layers, weights = _outside_shared_layers(nodes)
    kept = tuple(p for p in valid if allowed[p])
    excluded = [p for p in valid if not allowed[p]]

    def names(by_position: dict) -> tuple[str, ...]:
        return tuple(dict.fromkeys(name for p in excluded for name in by_position.get(p, ())))

    return CutCandidates(
        kept,
        runs,
        n,
        excluded_shared=len(excluded),
        excluded_layers=names(layers),
        excluded_weights=names(weights),
    )


def _outside_shared_layers(nodes: Sequence) -> tuple[np.ndarray, dict, dict]:
    """allowed[p]: a stage may start at node p (see `partition._build_stage`); and, by
    position, the layers ("layer 'x' (called 3 times)") and the non-trainable weights
    that forbid starting there.

    A trainable weight may have users on both sides (tied input and output embeddings:
    each stage holds a copy, state.py). Two things must stay in one stage:
    * a non-trainable weight's users (BatchNorm statistics updated by two stages);
    * a layer called at or after p whose output made before p is read at or after p:
      `keras.Model` maps the layer producing a stage input to an InputLayer, so its call
      inside that stage would be replaced too. Checked against all nodes after p, a
      superset of the stage starting at p, so every stage of a cut passes.
    """
    allowed = np.ones(len(nodes) + 1, dtype=bool)
    layers: dict[int, list[str]] = {}
    weights: dict[int, list[str]] = {}
    span: dict[int, list] = {}
    for i, node in enumerate(nodes):
        for weight in getattr(node.operation, "non_trainable_weights", ()):
            span.setdefault(id(weight), [i, i, weight])[1] = i
    for first, last, weight in span.values():
        allowed[first + 1 : last + 1] = False
        for p in range(first + 1, last + 1):
            weights.setdefault(p, []).append(f"non-trainable weight {weight.path!r}")
    producer: dict = {}  # tensor key -> (node position, id(layer))
    for i, node in enumerate(nodes):
        for tensor in node.output_tensors:
            producer[tensor_key(tensor)] = (i, id(node.operation))
    last_call: dict[int, int] = {}
    calls: dict[int, int] = {}
    for i, node in enumerate(nodes):
        last_call[id(node.operation)] = i
        calls[id(node.operation)] = calls.get(id(node.operation), 0) + 1
    for j, node in enumerate(nodes):
        for tensor in node.input_tensors:
            made = producer.get(tensor_key(tensor))
            if made is None:
                continue
            i, layer = made
            # Cuts in (i, j] make this tensor an input of a stage reading it; a call of
            # its layer in (cut .. end] is in that stage or a later one.
            again = last_call[layer]
            if again > i:
                allowed[i + 1 : min(j, again) + 1] = False
                name = f"layer {nodes[i].operation.name!r} (called {calls[layer]} times)"
                for p in range(i + 1, min(j, again) + 1):
                    layers.setdefault(p, []).append(name)
    return allowed, layers, weights


def boundary_bytes(nodes: Sequence) -> np.ndarray:
    """crossing[p]: bytes per sample of tensors made before node p and used at or after
    it (what a cut before node p sends forward; model inputs are not counted)."""
    produced: dict = {}
    for i, node in enumerate(nodes):
        for tensor in node.output_tensors:
            produced[tensor_key(tensor)] = (i, tensor_bytes(tensor))
    last_use: dict = {}
    for j, node in enumerate(nodes):
        for tensor in node.input_tensors:
            key = tensor_key(tensor)
            if key in produced:
                last_use[key] = j
    delta = np.zeros(len(nodes) + 2, dtype=np.int64)
    for key, (i, size) in produced.items():
        if key in last_use and last_use[key] > i:
            delta[i + 1] += size
            delta[last_use[key] + 1] -= size
    return np.cumsum(delta)[: len(nodes) + 1]
