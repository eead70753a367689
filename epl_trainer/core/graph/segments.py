"""Where gradient checkpointing cuts a stage: segments of its compute nodes.

Checkpoints are the user's marks (`add_to_collection` KerasTensors or layer-name
regexes, for `gradient_checkpoint.type="collection"`), or chosen by `auto_checkpoints`:
the boundaries of repeated blocks (transformer layers) when they carry most FLOPs, else
about sqrt(N) segments balanced by activation bytes. `checkpoint_segments` cuts after
every checkpoint's producer node, except where a cut would separate two calls of a
shared layer or two users of a shared weight. The engine runs the segments
(`core/engine/recompute.py`).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import keras
import numpy as np

from epl_trainer.core.graph.auto_partition import (
    balanced_cuts,
    boundary_bytes,
    find_repeated_blocks,
)
from epl_trainer.core.graph.cost import nodes_cost
from epl_trainer.core.graph.partition import (
    StagedModel,
    TensorKey,
    compute_nodes,
    functional_graph,
    tensor_key,
)

# Repeated blocks become the segments when they carry at least this share of the FLOPs
# (the same rule as the automatic pipeline partition).
MIN_BLOCK_FLOPS_SHARE = 0.5


@dataclass(frozen=True)
class Segment:
    """Nodes [start, stop) of a stage model (`compute_nodes` order), recomputed together.

    Attributes:
      activation_bytes: per sample, outputs of the segment's nodes.
      kept_bytes: per sample, tensors made inside the stage before the segment's end
        and used after it (what stays alive from forward to backward; 0 for the last).
    """

    index: int
    start: int
    stop: int
    first: str
    last: str
    activation_bytes: int
    kept_bytes: int


def stage_checkpoint_keys(staged: StagedModel, stage_index: int, marks: Iterable) -> list:
    """The checkpoints of one stage as keys of *its own* graph, plus regex strs.

    Stage sub-models of `partition_model` are Keras clones of the model's graph (new
    nodes, new tensor keys), so a KerasTensor marked on the model is found by walking
    the stage graph and the model graph side by side from the stage outputs.

    Args:
      staged: the model cut into stages (`whole_model` or `partition_model`).
      stage_index: which stage.
      marks: KerasTensors and regex strs (`epl.add_to_collection`'s marks).
    """
    marks = list(marks)
    stage = staged.stages[stage_index]
    graph = functional_graph(stage.model)
    if staged.whole_model:
        originals = list(graph.outputs)  # the model's own graph: no clone
    else:
        originals = [_original_tensor(t, key) for t, key in zip(graph.outputs, stage.output_keys)]
    to_stage = _clone_keys(graph.outputs, originals)
    keys = []
    for mark in marks:
        if isinstance(mark, str):
            keys.append(mark)
        elif tensor_key(mark) in to_stage:
            keys.append(to_stage[tensor_key(mark)])
    return keys


def _original_tensor(clone, key: TensorKey):
    operation = clone._keras_history.operation  # a clone node calls the same layer
    return operation._inbound_nodes[key[1]].output_tensors[key[2]]


def _clone_keys(clones: Sequence, originals: Sequence) -> dict:
    """Original tensor key -> stage-graph key, for every tensor the stage computes."""
    mapping: dict = {}
    pending = list(zip(clones, originals))
    while pending:
        clone, original = pending.pop()
        key = tensor_key(original)
        if key in mapping:
            continue
        mapping[key] = tensor_key(clone)
        clone_history, original_history = clone._keras_history, original._keras_history
        node = clone_history.operation._inbound_nodes[clone_history.node_index]
        if node.is_input or isinstance(node.operation, keras.layers.InputLayer):
            continue  # a stage input: produced by an earlier stage
        source = original_history.operation._inbound_nodes[original_history.node_index]
        assert source.operation is node.operation, (source.operation, node.operation)
        pending.extend(zip(node.input_tensors, source.input_tensors))
    return mapping


def checkpoint_segments(stage_model: keras.Model, checkpoints: Iterable) -> list[Segment]:
    """Cuts a stage model's nodes into segments ending at the checkpoints.

    Args:
      stage_model: a functional (or built Sequential) model; its inputs may be
        intermediate tensors of a bigger model.
      checkpoints: tensor keys of the stage graph (`stage_checkpoint_keys`) and/or
        layer-name regexes (the outputs of every call of a matching layer). Keys of
        tensors outside the stage graph are ignored, and so are checkpoints between two
        calls of a shared layer (or two users of a shared weight): their segments merge.

    Returns:
      Consecutive segments covering all nodes; one segment when no checkpoint cuts.
    """
    nodes = compute_nodes(stage_model)
    keys, patterns = set(), []
    for mark in checkpoints:
        if isinstance(mark, str):
            patterns.append(re.compile(mark))
        else:
            keys.add(tuple(mark))
    cuts = set()
    for i, node in enumerate(nodes):
        produced = {tensor_key(t) for t in node.output_tensors}
        if produced & keys or any(p.fullmatch(node.operation.name) for p in patterns):
            cuts.add(i + 1)
    return _segments(nodes, cuts)


def auto_checkpoints(stage_model: keras.Model) -> tuple[list[TensorKey], str]:
    """Checkpoints chosen for a stage: repeated-block boundaries, else ~sqrt(N) segments.

    Returns:
      (tensor keys of the stage graph, one line saying how they were chosen).
    """
    nodes = compute_nodes(stage_model)
    n = len(nodes)
    costs = nodes_cost(nodes)
    allowed = [int(p) + 1 for p in np.flatnonzero(_cut_allowed(nodes)[1:n])]
    crossing = boundary_bytes(nodes)
    runs = find_repeated_blocks(nodes, crossing)
    total = sum(c.flops for c in costs)
    in_blocks = sum(c.flops for run in runs for c in costs[run.start : run.stop])
    if runs and in_blocks >= MIN_BLOCK_FLOPS_SHARE * total:
        cuts, group = _group_blocks(runs, allowed, costs, crossing)
        how = f"repeated blocks, {group} per segment: " + "; ".join(run.describe() for run in runs)
    else:
        count = min(max(1, round(math.sqrt(n))), len(allowed) + 1)
        activations = [c.activation_bytes for c in costs]
        cuts = list(balanced_cuts(activations, [c.flops for c in costs], allowed, count))
        how = f"no repeated blocks: {count} segment(s) of {n} nodes balanced by activation bytes"
    keys = [tensor_key(t) for p in cuts for t in nodes[p - 1].output_tensors]
    return keys, how


def _group_blocks(runs, allowed, costs, crossing) -> tuple[list[int], int]:
    """Cuts every `group` blocks, with the group size that minimises the estimated
    activation peak: bytes kept at the cuts + the largest segment's activations.

    A transformer layer holds much more inside (attention scores, the 4x FFN) than it
    passes on, so one block per segment wins; a stack of single Dense layers holds as
    much as it passes on, so about sqrt(blocks) per segment wins.
    """
    allowed = set(allowed)
    prefix = np.concatenate(([0], np.cumsum([c.activation_bytes for c in costs])))
    best = None
    for group in range(1, max(run.count for run in runs) + 1):
        bounds = set()
        for run in runs:
            bounds.update(run.block_starts[::group])
            bounds.add(run.stop)
        cuts = sorted(p for p in bounds if p in allowed)
        edges = [0, *cuts, len(costs)]
        inside = max(int(prefix[b] - prefix[a]) for a, b in itertools.pairwise(edges))
        peak = int(sum(crossing[p] for p in cuts)) + inside
        if best is None or peak < best[0]:
            best = (peak, cuts, group)
    return best[1], best[2]


def _segments(nodes: Sequence, cuts: set[int]) -> list[Segment]:
    allowed = _cut_allowed(nodes)
    bounds = [0, *sorted(p for p in cuts if 0 < p < len(nodes) and allowed[p]), len(nodes)]
    costs = nodes_cost(nodes)
    kept = boundary_bytes(nodes)
    return [
        Segment(
            index=i,
            start=a,
            stop=b,
            first=costs[a].name,
            last=costs[b - 1].name,
            activation_bytes=sum(c.activation_bytes for c in costs[a:b]),
            kept_bytes=int(kept[b]),
        )
        for i, (a, b) in enumerate(itertools.pairwise(bounds))
    ]


def _cut_allowed(nodes: Sequence) -> np.ndarray:
    """allowed[p]: a cut before node p keeps every layer's calls, and every weight's
    users, in one segment (partition_model refuses weights shared across sub-models)."""
    allowed = np.ones(len(nodes) + 1, dtype=bool)
    span: dict[int, list[int]] = {}
    for i, node in enumerate(nodes):
        owners = [id(node.operation)] + [id(w) for w in getattr(node.operation, "weights", ())]
        for owner in owners:
            span.setdefault(owner, [i, i])[1] = i
    for first, last in span.values():
        allowed[first + 1 : last + 1] = False
    return allowed
