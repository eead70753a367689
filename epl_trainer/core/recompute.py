"""Gradient checkpointing (`gradient_checkpoint.*`): recompute segments of a stage in
its backward instead of keeping their activations.

A stage sub-model is cut into consecutive *segments* of its compute nodes (in
`compute_nodes` order). Each segment runs as one `tf.custom_gradient` op: its forward
keeps nothing but its inputs (the tensors crossing the segment's start, the variable
values and the non-trainable state it read); its backward runs the segment's forward
again under a fresh tape and differentiates that. Only segment-boundary tensors live
from a micro-batch's forward to its backward.

Steps, in order:

1. Checkpoints: the user's (`add_to_collection(x, "checkpoints")` on KerasTensors, or
   layer-name regexes) for `type="collection"`, or `auto_checkpoints`: the boundaries of
   repeated blocks (transformer layers) when they carry most FLOPs, else about sqrt(N)
   segments balanced by activation bytes.
2. `checkpoint_segments`: a cut after every checkpoint's producer node, except where it
   would separate two calls of a shared layer or two users of a shared weight.
3. `RecomputedStage`: the segments cut out of the stage model with `partition_model`,
   called with the same contract as `stage.model.stateless_call(..., return_losses=True)`.

Why our own `tf.custom_gradient` and not `tf.recompute_grad`: the segment also reads
int tensors (token ids, the SeedGenerator state that makes dropout masks) and returns
updated non-trainable state (BatchNorm statistics), neither of which has a gradient;
`tf.recompute_grad` wants every argument differentiable and has no side output. Here
int inputs and state are closed over, so the recompute sees the *same* seed (same
dropout mask) and the state updates of the recompute are dropped (BatchNorm statistics
move once per forward).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from epl_trainer.core.auto_partition import balanced_cuts, boundary_bytes, find_repeated_blocks
from epl_trainer.core.cost import format_bytes, nodes_cost
from epl_trainer.core.partition import (
    StagedModel,
    TensorKey,
    compute_nodes,
    functional_graph,
    partition_model,
    tensor_key,
)

__all__ = [
    "COLLECTION",
    "GradientMismatchError",
    "RecomputedStage",
    "Segment",
    "add_to_collection",
    "apply_recompute",
    "auto_checkpoints",
    "check_gradients",
    "check_stage_gradients",
    "checkpoint_segments",
    "clear_collections",
    "get_collection",
    "make_recompute_call",
    "recompute_stage",
    "stage_checkpoint_keys",
]

COLLECTION = "checkpoints"
# Repeated blocks become the segments when they carry at least this share of the FLOPs
# (the same rule as the automatic pipeline partition).
MIN_BLOCK_FLOPS_SHARE = 0.5
_COLLECTIONS: dict[str, list] = {COLLECTION: []}


# ------------------------------------------------------------------ the collection
def add_to_collection(value, name: str = COLLECTION) -> None:
    """Marks a checkpoint for `gradient_checkpoint.type="collection"`.

    Args:
      value: a KerasTensor made while building a functional model (kept for backward;
        the nodes after it up to the next checkpoint are recomputed), or a str regex
        matched with `re.fullmatch` against layer names (each call's output of a
        matching layer becomes a checkpoint).
      name: the collection; only "checkpoints" has a meaning.

    Raises:
      ValueError: another collection name, or an invalid regex.
      TypeError: a value that is neither a KerasTensor nor a str.
    """
    if name != COLLECTION:
        raise ValueError(
            f"Only the {COLLECTION!r} collection is used (gradient_checkpoint.type="
            f"'collection'). Received: name={name!r}"
        )
    if isinstance(value, str):
        try:
            re.compile(value)
        except re.error as e:
            raise ValueError(f"Invalid layer-name regex for a checkpoint: {value!r} ({e})") from e
    elif not (isinstance(value, keras.KerasTensor) and hasattr(value, "_keras_history")):
        raise TypeError(
            "add_to_collection takes a KerasTensor (the output of a layer while building a "
            "functional model) or a layer-name regex str. Eager tensors have no place in "
            f"the model graph. Received: {type(value).__name__}"
        )
    if not any(v is value for v in _COLLECTIONS[name]):
        _COLLECTIONS[name].append(value)


def get_collection(name: str = COLLECTION) -> list:
    """The KerasTensors and regexes added to `name` so far (a copy)."""
    if name != COLLECTION:
        raise ValueError(f"Only the {COLLECTION!r} collection exists. Received: name={name!r}")
    return list(_COLLECTIONS[name])


def clear_collections() -> None:
    """Forgets every checkpoint mark (`epl.init` calls it)."""
    for marks in _COLLECTIONS.values():
        marks.clear()


# ------------------------------------------------------------------ segmentation
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


def stage_checkpoint_keys(staged: StagedModel, stage_index: int, marks=None) -> list:
    """The checkpoints of one stage as keys of *its own* graph, plus regex strs.

    Stage sub-models of `partition_model` are Keras clones of the model's graph (new
    nodes, new tensor keys), so a KerasTensor marked on the model is found by walking
    the stage graph and the model graph side by side from the stage outputs.

    Args:
      staged: the model cut into stages (`whole_model` or `partition_model`).
      stage_index: which stage.
      marks: KerasTensors and regex strs; default `get_collection()`.
    """
    marks = get_collection() if marks is None else list(marks)
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


# ------------------------------------------------------------------ the recomputed call
class RecomputedStage:
    """A stage model called segment by segment, each segment recomputed in backward.

    `stateless_call` has the contract of `stage_model.stateless_call(...)`: variable
    values in `stage_model.trainable_variables` order, non-trainable values in
    `stage_model.non_trainable_variables` order, outputs in the stage model's output
    structure; auxiliary losses (`add_loss`, regularizers) sum to the same value.

    Args:
      stage_model: the stage's functional (or built Sequential) model.
      segments: from `checkpoint_segments`, covering all of the stage's nodes.
      recompute_last: also recompute the last segment (EPL's semantics: everything but
        the checkpoints is recomputed). False saves 1/len(segments) of a forward but keeps
        the last segment's activations for every micro-batch in flight. Measured on 16 x
        Dense(1024), batch 256 (4 segments): peak 0.57-0.72x of plain with it, 0.62-0.77x
        without (scheduling moves the peak by a few MiB); the time difference was within
        the noise of a shared 2-core machine.
      description: how the checkpoints were chosen (for `describe`).
    """

    def __init__(
        self,
        stage_model: keras.Model,
        segments: Sequence[Segment],
        recompute_last: bool = True,
        description: str = "",
    ):
        self.model = stage_model
        self.segments = tuple(segments)
        self.recompute_last = recompute_last
        self.description = description
        nodes = compute_nodes(stage_model)
        segment_of = {id(n): s.index for s in self.segments for n in nodes[s.start : s.stop]}
        if len(segment_of) != len(nodes):
            raise ValueError(
                f"Segments must cover the {len(nodes)} nodes of stage model "
                f"{stage_model.name!r}. Received: {[(s.start, s.stop) for s in segments]}"
            )
        self.staged = partition_model(
            stage_model, lambda node: segment_of[id(node)], len(self.segments)
        )
        self._graph_inputs = functional_graph(stage_model).inputs
        trainable = {id(v): i for i, v in enumerate(stage_model.trainable_variables)}
        non_trainable = {id(v): i for i, v in enumerate(stage_model.non_trainable_variables)}
        self._trainable_idx = [
            [trainable[id(v)] for v in part.model.trainable_variables]
            for part in self.staged.stages
        ]
        self._non_trainable_idx = [
            [non_trainable[id(v)] for v in part.model.non_trainable_variables]
            for part in self.staged.stages
        ]

    @property
    def recomputed(self) -> tuple[bool, ...]:
        """Per segment: whether its backward recomputes it."""
        last = len(self.segments) - 1
        return tuple(self.recompute_last or s.index < last for s in self.segments)

    @tf.autograph.experimental.do_not_convert
    def stateless_call(
        self,
        trainable_variables,
        non_trainable_variables,
        inputs,
        training: bool = False,
        return_losses: bool = False,
    ):
        """Runs the segments in order; see the class doc for the contract."""
        staged = self.staged
        flat = staged.flatten_inputs(inputs)
        flat = [
            x if x is None else keras.ops.convert_to_tensor(x, dtype=t.dtype)
            for x, t in zip(flat, self._graph_inputs)
        ]
        values = dict(zip(staged.input_keys, flat))
        non_trainable = list(non_trainable_variables)
        losses: list = []
        for part, recompute in zip(staged.stages, self.recomputed):
            t_idx, nt_idx = self._trainable_idx[part.index], self._non_trainable_idx[part.index]
            call = _recomputed_call if recompute else _plain_call
            outputs, new_state, part_losses = call(
                part.model,
                [trainable_variables[i] for i in t_idx],
                [non_trainable[i] for i in nt_idx],
                [values[k] for k in part.input_keys],
                training,
            )
            for i, value in zip(nt_idx, new_state):
                non_trainable[i] = value
            values.update(zip(part.output_keys, outputs))
            losses += part_losses
        outputs = staged.pack_outputs([values[k] for k in staged.output_keys])
        return (outputs, non_trainable, losses) if return_losses else (outputs, non_trainable)

    __call__ = stateless_call

    def describe(self) -> str:
        """A table of the segments: nodes, layers, recomputed bytes, kept bytes."""
        lines = [
            f"Gradient checkpointing of {self.model.name!r}: {len(self.segments)} segment(s)"
            + (f"; {self.description}" if self.description else ""),
            "segment  nodes      first .. last                     recomputed  activation  kept",
        ]
        for s, again in zip(self.segments, self.recomputed):
            span = s.first if s.stop - s.start == 1 else f"{s.first} .. {s.last}"
            lines.append(
                f"{s.index:<8} {f'{s.start}-{s.stop - 1}':<10} {span:<33} "
                f"{'yes' if again else 'no':<11} {format_bytes(s.activation_bytes):<11} "
                f"{format_bytes(s.kept_bytes)}"
            )
        lines.append("(bytes per sample)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def make_recompute_call(recomputed: RecomputedStage):
    """A `Program.stage_calls[k]`: `(variables, non_trainable, args, training) ->
    (outputs, new non-trainable values, auxiliary losses)`, recomputing the segments."""

    def call(variables, non_trainable, args, training):
        return recomputed.stateless_call(
            variables, non_trainable, args, training=training, return_losses=True
        )

    return call


def apply_recompute(program, config, recompute_last: bool = True):
    """The recompute pass: replaces `program.stage_calls[k]` of the checkpointed stages.

    Stages 0..`config.end_taskgraph` (all with -1) are checkpointed. Sets
    `program.recomputed` (stage -> RecomputedStage) for the plan summary and for
    `check_stage_gradients`.

    Args:
      program: a `Program` (its `staged` and `stage_calls` are used).
      config: the `gradient_checkpoint` config section (type, end_taskgraph).
      recompute_last: see `RecomputedStage`.
    """
    program.recomputed = {}
    if not config.type:
        return program
    for k in range(len(program.staged.stages)):
        if 0 <= config.end_taskgraph < k:
            break
        stage = recompute_stage(program.staged, k, config.type, recompute_last=recompute_last)
        program.recomputed[k] = stage
        program.stage_calls[k] = make_recompute_call(stage)
    return program


def recompute_stage(
    staged: StagedModel,
    stage_index: int,
    kind: str,
    marks=None,
    recompute_last: bool = True,
) -> RecomputedStage:
    """Plans the gradient checkpointing of one stage.

    Args:
      staged: the model cut into stages.
      stage_index: which stage.
      kind: "collection" (the marks; a stage without marks is one recomputed segment)
        or "auto" (`auto_checkpoints`).
      marks: for "collection", KerasTensors and layer-name regexes; default
        `get_collection()`.
      recompute_last: see `RecomputedStage`.

    Raises:
      ValueError: an unknown kind, or a subclassed model (no graph to cut).
    """
    model = staged.stages[stage_index].model
    if kind not in ("collection", "auto"):
        raise ValueError(
            f"gradient_checkpoint.type must be 'collection' or 'auto'. Received: {kind!r}"
        )
    if not isinstance(model, keras.Sequential) and not hasattr(model, "_nodes_by_depth"):
        raise ValueError(
            f"Gradient checkpointing needs a functional or Sequential model to cut into "
            f"segments; {model.name!r} ({type(model).__name__}) is subclassed. Use "
            "keras.RematScope inside its layers instead, or rebuild it functionally."
        )
    if kind == "auto":
        keys, how = auto_checkpoints(model)
    else:
        keys = stage_checkpoint_keys(staged, stage_index, marks)
        how = f"collection: {len(keys)} mark(s) for this stage"
    return RecomputedStage(model, checkpoint_segments(model, keys), recompute_last, how)


def _plain_call(model, variables, non_trainable, args, training):
    outputs, state, losses = model.stateless_call(
        variables, non_trainable, args, training=training, return_losses=True
    )
    return tree.flatten(outputs), state, list(losses)


def _recomputed_call(model, variables, non_trainable, args, training):
    """One segment as a custom-gradient op whose backward reruns its forward.

    Float inputs and variable values are the op's differentiable arguments. Int inputs
    and the non-trainable state are closed over, so the recompute reads the same seeds
    (same dropout masks); the state the recompute returns is dropped.

    A softmax or sigmoid output carries its logits (`_keras_logits`), from which Keras's
    crossentropy losses compute, even with `from_logits=True`. The op's results would
    lose that attribute (the loss then applied a second softmax: the bias of a softmax
    classifier moved off Keras's), so the logits are extra results of the op and are
    attached to their outputs again.
    """
    if not any(_is_float(t.dtype) for t in model.outputs):
        return _plain_call(model, variables, non_trainable, args, training)  # no gradient
    float_at = [i for i, x in enumerate(args) if x.dtype.is_floating]
    count = len(float_at)
    side = {}  # what the forward hands out besides its differentiable results

    def run(float_args, values, dependency=None):
        full = list(args)
        for i, x in zip(float_at, float_args):
            full[i] = x
        if dependency is not None:  # see _after: recompute only once dy exists
            full = [
                x + tf.cast(dependency, x.dtype) if x.dtype.is_floating or x.dtype.is_integer else x
                for x in full
            ]
        outputs, state, losses = model.stateless_call(
            list(values), non_trainable, full, training=training, return_losses=True
        )
        return tree.flatten(outputs), state, list(losses)

    @tf.custom_gradient
    def segment(*differentiable):
        # stop_gradient: no enclosing tape records the segment's inner ops, so none of
        # its activations is kept for backward.
        held = [tf.stop_gradient(x) for x in differentiable]
        flat, state, losses = run(held[:count], held[count:])
        side["flat"], side["state"] = flat, state
        float_out = [i for i, y in enumerate(flat) if y.dtype.is_floating]
        with_logits = [i for i in float_out if _logits_of(flat[i]) is not None]
        side["float_out"], side["with_logits"] = float_out, with_logits

        def grad(*upstream, variables=None):
            if variables:
                raise AssertionError(
                    f"A segment of {model.name!r} read tf.Variables directly: "
                    f"{[v.name for v in variables]}"
                )
            wanted = [
                (i, tf.convert_to_tensor(dy)) for i, dy in enumerate(upstream) if dy is not None
            ]
            dependency = None if tf.executing_eagerly() or not wanted else _after(wanted[0][1])
            with tf.GradientTape() as tape:
                tape.watch(differentiable)
                again, _, again_losses = run(
                    differentiable[:count], differentiable[count:], dependency
                )
                logits = [_logits_of(again[i]) for i in with_logits]
                targets = [again[i] for i in float_out] + logits + again_losses
            return tape.gradient(
                [targets[i] for i, _ in wanted],
                list(differentiable),
                output_gradients=[dy for _, dy in wanted],
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )

        logits = [_logits_of(flat[i]) for i in with_logits]
        return [flat[i] for i in float_out] + logits + losses, grad

    differentiable = [args[i] for i in float_at] + list(variables)
    results = segment(*differentiable)
    float_out, with_logits = side["float_out"], side["with_logits"]
    flat = list(side["flat"])
    for i, y in zip(float_out, results):
        flat[i] = y
    for i, logits in zip(with_logits, results[len(float_out) :]):
        flat[i]._keras_logits = logits  # as Keras's softmax / sigmoid set it
    return flat, side["state"], list(results[len(float_out) + len(with_logits) :])


def _logits_of(tensor):
    return getattr(tensor, "_keras_logits", None)


def _after(upstream):
    """A scalar 0 that depends on `upstream` (NaN if its first element is NaN).

    Added to the recompute's inputs inside a tf.function, it keeps grappler from
    merging the recomputed ops with the identical forward ops (which would keep the
    forward activations alive) and keeps the runtime from recomputing before the
    backward reaches the segment. The same device as tf.recompute_grad's; a data edge,
    because XLA ignores control edges.
    """
    first = tf.reduce_max(tf.reshape(upstream, [-1])[:1])
    first = tf.cast(first, tf.bool)
    return tf.where(tf.equal(first, first), 0.0, float("nan"))


# ------------------------------------------------------------------ check_gradients
class GradientMismatchError(ValueError):
    """Gradients with checkpointing differ from the plain ones beyond the tolerance."""


def check_gradients(
    plain_call,
    recompute_call,
    variables: Sequence,
    non_trainable: Sequence,
    inputs,
    *,
    training: bool = True,
    names: Sequence[str] | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> float:
    """Compares both calls' gradients for one micro-batch (`check_gradients=True`).

    The objective is the sum of every float output times a fixed random tensor plus the
    auxiliary losses, so every output's gradient path is checked. Both calls get the
    same non-trainable values (so the same dropout masks). Call it eagerly, once.

    Args:
      plain_call, recompute_call: `stateless_call`-like callables of the same stage.
      variables: trainable values in the stage model's order.
      non_trainable: non-trainable values in the stage model's order.
      inputs: the stage's argument (float leaves are differentiated too).
      names: one per variable, for the error message (default: "variable <i>").

    Returns:
      The largest absolute difference over all gradients.

    Raises:
      GradientMismatchError: some |recomputed - plain| > atol + rtol * |plain|; the
        message names the worst tensor and the largest absolute difference.
    """
    variables = [tf.convert_to_tensor(v) for v in variables]
    flat = [tf.convert_to_tensor(x) for x in tree.flatten(inputs)]
    float_inputs = [x for x in flat if x.dtype.is_floating]
    names = list(names or [f"variable {i}" for i in range(len(variables))])
    names += [f"input {i}" for i, x in enumerate(flat) if x.dtype.is_floating]

    @tf.function(autograph=False)
    def both(variables, float_inputs):
        results = []
        for call in (plain_call, recompute_call):
            with tf.GradientTape() as tape:
                tape.watch(variables + float_inputs)
                leaves, at = list(flat), iter(float_inputs)
                leaves = [next(at) if x.dtype.is_floating else x for x in leaves]
                outputs, _, losses = call(
                    variables,
                    list(non_trainable),
                    tree.pack_sequence_as(inputs, leaves),
                    training=training,
                    return_losses=True,
                )
                objective = tf.add_n([tf.zeros([])] + [tf.cast(x, tf.float32) for x in losses])
                for i, y in enumerate(tree.flatten(outputs)):
                    if y.dtype.is_floating:
                        weights = tf.random.stateless_normal(tf.shape(y), [7, i], dtype=y.dtype)
                        objective += tf.cast(tf.reduce_sum(y * weights), tf.float32)
            results.append(
                tape.gradient(
                    objective,
                    variables + float_inputs,
                    unconnected_gradients=tf.UnconnectedGradients.ZERO,
                )
            )
        return results

    plain, recomputed = both(variables, float_inputs)
    worst, worst_excess, largest = None, -np.inf, 0.0
    for name, a, b in zip(names, plain, recomputed):
        a, b = np.asarray(tf.convert_to_tensor(a)), np.asarray(tf.convert_to_tensor(b))
        diff = np.abs(b.astype(np.float64) - a)
        if diff.size == 0:
            continue
        excess = float(np.max(diff - atol - rtol * np.abs(a)))
        largest = max(largest, float(diff.max()))
        if excess > worst_excess:
            worst, worst_excess, worst_diff = name, excess, float(diff.max())
    if worst_excess > 0:
        raise GradientMismatchError(
            f"Gradients with gradient checkpointing differ from the plain gradients: "
            f"worst is {worst!r} with max |difference| {worst_diff:.3g} (tolerance: "
            f"atol={atol}, rtol={rtol}). Received: largest difference over all "
            f"gradients {largest:.3g}"
        )
    return largest


def check_stage_gradients(
    staged: StagedModel,
    recomputed: dict,
    features,
    *,
    training: bool = True,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> dict:
    """`check_gradients` for every recomputed stage on one micro-batch of features.

    Stages run plainly in order to produce each stage's inputs; every stage uses the
    Keras model's current variable values (equal to the engine's before the first
    step). Call it eagerly, once, before training.

    Args:
      recomputed: stage index -> `RecomputedStage`.

    Returns:
      Stage index -> the largest absolute gradient difference.
    """
    values = dict(zip(staged.input_keys, staged.flatten_inputs(features)))
    if not staged.whole_model:
        graph_inputs = functional_graph(staged.model).inputs
        values = {
            k: keras.ops.convert_to_tensor(v, dtype=t.dtype)
            for (k, v), t in zip(values.items(), graph_inputs)
        }
    differences = {}
    for stage in staged.stages:
        model = stage.model
        variables = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        arguments = staged.stage_arguments(stage, values)
        if stage.index in recomputed:
            differences[stage.index] = check_gradients(
                model.stateless_call,
                recomputed[stage.index].stateless_call,
                variables,
                non_trainable,
                arguments,
                training=training,
                names=[f"stage {stage.index}: {v.path}" for v in model.trainable_variables],
                rtol=rtol,
                atol=atol,
            )
        outputs, _ = model.stateless_call(variables, non_trainable, arguments, training=training)
        values.update(staged.stage_results(stage, outputs))
    return differences


def _is_float(dtype) -> bool:
    return tf.as_dtype(keras.backend.standardize_dtype(dtype)).is_floating
