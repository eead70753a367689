"""Gradient checkpointing (`gradient_checkpoint.*`): recompute segments of a stage in
its backward instead of keeping their activations.

A stage sub-model is cut into consecutive *segments* of its compute nodes (in
`compute_nodes` order). Each segment runs as one `tf.custom_gradient` op: its forward
keeps nothing but its inputs (the tensors crossing the segment's start, the variable
values and the non-trainable state it read); its backward runs the segment's forward
again under a fresh tape and differentiates that. Only segment-boundary tensors live
from a micro-batch's forward to its backward.

Steps, in order:

1. Checkpoints and segments: `core/graph/segments.py` (the user's marks, or
   `auto_checkpoints`), cut by `checkpoint_segments`.
2. `RecomputedStage`: the segments cut out of the stage model with `partition_model`,
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

from collections.abc import Sequence

import keras
import tensorflow as tf
from keras import tree

from epl_trainer.core.graph.cost import format_bytes
from epl_trainer.core.graph.partition import (
    StagedModel,
    compute_nodes,
    functional_graph,
    partition_model,
)
from epl_trainer.core.graph.segments import (
    Segment,
    auto_checkpoints,
    checkpoint_segments,
    stage_checkpoint_keys,
)


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
        the last segment's activations for every micro-batch in flight: a higher peak
        for no time saved that a 2-core CPU could measure
        (docs/benchmarks.md#recomputing-the-last-segment).
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
        """Runs the segments in order; see the class doc for the contract.

        `trainable_variables` may also be a `zero_params.SegmentGathers` (ZeRO v2): each
        segment then gathers its parameters just before its forward, the gather of
        segment b+1 waiting for segment b-1's outputs (one segment of prefetch), and
        gathers them again in its backward instead of keeping them.
        """
        staged = self.staged
        gathers = trainable_variables if hasattr(trainable_variables, "regather") else None
        markers: list = []  # per segment run: a scalar 0 once its outputs exist
        flat = staged.flatten_inputs(inputs)
        flat = [
            x if x is None else keras.ops.convert_to_tensor(x, dtype=t.dtype)
            for x, t in zip(flat, self._graph_inputs)
        ]
        values = dict(zip(staged.input_keys, flat))
        non_trainable = list(non_trainable_variables)
        losses: list = []
        backwards: dict = {}  # segment index -> its backward's weight gradients, once built
        for part, recompute in zip(staged.stages, self.recomputed):
            t_idx, nt_idx = self._trainable_idx[part.index], self._non_trainable_idx[part.index]
            regather = None
            if gathers is None:
                variables = [trainable_variables[i] for i in t_idx]
            else:
                variables = gathers.gather(t_idx, markers[-2] if len(markers) > 1 else None)
                regather = lambda after, t_idx=t_idx: gathers.regather(t_idx, after)  # noqa: E731
            args = [values[k] for k in part.input_keys]
            nt_values = [non_trainable[i] for i in nt_idx]
            if recompute:
                outputs, new_state, part_losses = _recomputed_call(
                    part.model,
                    variables,
                    nt_values,
                    args,
                    training,
                    regather,
                    backwards=backwards,
                    index=part.index,
                )
            else:
                outputs, new_state, part_losses = _plain_call(
                    part.model, variables, nt_values, args, training
                )
            if gathers is not None:
                floats = [y for y in outputs if y.dtype.is_floating]
                markers.append(_after(floats[0]) if floats else None)
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
    """A `StepHooks.stage_calls[k]`: `(variables, non_trainable, args, training) ->
    (outputs, new non-trainable values, auxiliary losses)`, recomputing the segments."""

    def call(variables, non_trainable, args, training):
        return recomputed.stateless_call(
            variables, non_trainable, args, training=training, return_losses=True
        )

    return call


def apply_recompute(
    hooks, staged: StagedModel, config, marks: Sequence = (), recompute_last: bool = True
) -> None:
    """The recompute pass: replaces `hooks.stage_calls[k]` of the checkpointed stages.

    Stages 0..`config.end_taskgraph` (all with -1) are checkpointed. Fills
    `hooks.recomputed` (stage -> RecomputedStage) for the plan summary and for
    `check_stage_gradients`.

    Args:
      hooks: the program's `StepHooks`.
      staged: the model cut into stages.
      config: the `gradient_checkpoint` config section (type, end_taskgraph).
      marks: the user's checkpoint marks (for type "collection").
      recompute_last: see `RecomputedStage`.

    Raises:
      ValueError: `end_taskgraph` is past the last stage.
    """
    num_stages = len(staged.stages)
    if config.end_taskgraph >= num_stages:  # it would checkpoint every stage, as -1 does
        raise ValueError(
            f"gradient_checkpoint.end_taskgraph={config.end_taskgraph} names no taskgraph: "
            f"the model has {num_stages} (0..{num_stages - 1}); -1 checkpoints every one."
        )
    for k in range(num_stages):
        if 0 <= config.end_taskgraph < k:
            break
        stage = recompute_stage(staged, k, config.type, marks, recompute_last=recompute_last)
        hooks.recomputed[k] = stage
        hooks.stage_calls[k] = make_recompute_call(stage)


def recompute_stage(
    staged: StagedModel,
    stage_index: int,
    kind: str,
    marks: Sequence = (),
    recompute_last: bool = True,
) -> RecomputedStage:
    """Plans the gradient checkpointing of one stage.

    Args:
      staged: the model cut into stages.
      stage_index: which stage.
      kind: "collection" (the marks; a stage without marks is one recomputed segment)
        or "auto" (`auto_checkpoints`).
      marks: for "collection", KerasTensors and layer-name regexes (the user's
        `add_to_collection` marks, which the trainer passes).
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


def _recomputed_call(
    model, variables, non_trainable, args, training, regather=None, backwards=None, index=0
):
    """One segment as a custom-gradient op whose backward reruns its forward.

    Float inputs and variable values are the op's differentiable arguments. Int inputs
    and the non-trainable state are closed over, so the recompute reads the same seeds
    (same dropout masks); the state the recompute returns is dropped.

    A softmax or sigmoid output carries its logits (`_keras_logits`), from which Keras's
    crossentropy losses compute, even with `from_logits=True`. The op's results would
    lose that attribute (the loss then applied a second softmax: the bias of a softmax
    classifier moved off Keras's), so the logits are extra results of the op and are
    attached to their outputs again.

    `regather`: None, or `(after) -> variable values` (ZeRO v2): the backward gathers the
    parameters again instead of reading the op's inputs, so the forward's gathered
    values are freed after the forward; the gradients of the gathered values are the
    gradients of the op's variable inputs.

    `backwards`: None, or a dict shared by the segments of one stage call, in which the
    backward of segment `index` records its weight gradients; the recompute of segment
    `index` waits for those of segment `index + 1` as well as for its upstream gradient.
    Nothing else waits for weight gradients until the reduction after the whole
    backward, so without that edge TensorFlow's executor follows the input-gradient
    chain and defers ops such as the FFN's `BiasAddGrad`, the attention's weight matmuls
    and the normalisations' sums, each of which holds an activation-sized gradient of a
    recomputed segment: a 2-replica trace of the 4-layer transformer
    (`bench/plan_accuracy.py` row 7) held three later segments' 2.1 MB FFN gradients
    per replica while the first segment recomputed, until those ops ran after the
    backward (docs/benchmarks.md#recompute-waits-for-the-weight-gradients-after-it).
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
            graph = not tf.executing_eagerly()
            later = (backwards or {}).get(index + 1, []) if graph else []
            dependency = _after(wanted[0][1], *later) if graph and wanted else None
            inputs = list(differentiable)
            if regather is not None:
                inputs[count:] = regather(dependency)
            with tf.GradientTape() as tape:
                tape.watch(inputs)
                again, _, again_losses = run(inputs[:count], inputs[count:], dependency)
                logits = [_logits_of(again[i]) for i in with_logits]
                targets = [again[i] for i in float_out] + logits + again_losses
            gradients = tape.gradient(
                [targets[i] for i, _ in wanted],
                inputs,
                output_gradients=[dy for _, dy in wanted],
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )
            if backwards is not None and graph:
                backwards[index] = [
                    g.values if isinstance(g, tf.IndexedSlices) else g
                    for g in gradients[count:]
                    if g is not None
                ]
            return gradients

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


def _after(*tensors):
    """A scalar 0 that exists only once every one of `tensors` does.

    Added to the recompute's inputs inside a tf.function, it keeps grappler from
    merging the recomputed ops with the identical forward ops (which would keep the
    forward activations alive) and keeps the runtime from recomputing before the
    backward reaches the segment (the upstream gradient) and before the later segment's
    weight gradients are done (`_recomputed_call`'s `backwards`). The same device as
    tf.recompute_grad's; a data edge, because XLA ignores control edges. It reads one
    element of each tensor, as a bool, so it is 0 whatever the values (NaN included):
    the recompute's inputs are unchanged.
    """
    firsts = [tf.cast(tf.reshape(t, [-1])[:1], tf.bool) for t in tensors]
    first = tf.concat(firsts, 0) if len(firsts) > 1 else firsts[0]
    return tf.where(tf.reduce_all(tf.equal(first, first)), 0.0, float("nan"))


def _is_float(dtype) -> bool:
    return tf.as_dtype(keras.backend.standardize_dtype(dtype)).is_floating
