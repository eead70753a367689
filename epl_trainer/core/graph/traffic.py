"""Bytes the elementwise ops of a traced training step read and write, per layer.

The step-time model (`core/plan/step_time.py`) times a layer's matmuls by their FLOPs
and its other ops by the bytes they move. A Keras graph's static costs
(`core/graph/cost.py`) know a layer's output, not how many ops its call runs: Keras's
LayerNormalization reads and writes 15 output-sized tensors in forward (the mean, the
variance, and the normalisation broadcast in several steps) and 39 in backward, an exact
GELU 11 and 26, where "output written and read once" counts 2 and 4. This module counts
them from the ops TensorFlow traces for the layer:

`elementwise_traffic(model, x, y, loss)` traces one training step of the model
(`flops_profile.trace_train_step`: forward, loss, backward) for a batch of 1 and of 2
samples, walks both graphs as `flops.count_flops` does (called functions, loops,
conditionals; only ops that run), and sums per layer and phase the bytes every op that is
not a contraction (matmul, einsum, convolution: timed by FLOPs) and not a view (reshape,
identity, variable read) reads and writes. The difference of the two batches is the
per-sample traffic. Ops outside every layer (the loss) are not a layer's.

`with_elementwise_traffic(cost, traffic)` puts the counts into a `ModelCost`'s nodes
(`NodeCost.elementwise_bytes`, `elementwise_backward_bytes`). They are TensorFlow's ops
before its graph optimizer, which fuses few of them on CPU (a trace of the zoo's
transformer ran every layer normalisation's ops separately).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import keras
import tensorflow as tf

from epl_trainer.core.graph import flops as flops_module
from epl_trainer.core.graph.flops_profile import trace_train_step
from epl_trainer.core.plan.estimate import ModelCost

__all__ = ["VIEWS", "elementwise_traffic", "with_elementwise_traffic"]

# Ops that move no data (a view of their input, a read of a variable's buffer, shapes).
VIEWS = frozenset({
    "Reshape", "Identity", "IdentityN", "ExpandDims", "Squeeze", "StopGradient", "Snapshot",
    "ReadVariableOp", "Const", "Placeholder", "PlaceholderWithDefault", "Shape", "ShapeN",
    "Size", "Rank", "NoOp", "VarHandleOp", "BroadcastGradientArgs", "EnsureShape",
    "CheckNumerics", "PreventGradient",
})  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _OpBytes:
    """One op's bytes read and written (the walker's record; `flops` and `contraction`
    are what `flops._Walker` compares conditional branches by)."""

    name: str
    op_type: str
    moved_bytes: int
    phase: str
    layer: tuple[str, ...]
    flops: int = 0
    contraction: bool = False


class _TrafficWalker(flops_module._Walker):
    def _record(self, op, name: str, multiplier: int):
        if op.type in flops_module.CONTRACTIONS or op.type in VIEWS:
            return None
        tensors = [t for t in (*op.inputs, *op.outputs) if t.dtype.is_floating]
        try:
            moved = sum(_bytes(t) for t in tensors)
        except flops_module._Unknown:
            self.unresolved.append(name)
            return None
        if not moved:
            return None
        scopes = name.split("/")[:-1]
        return _OpBytes(name, op.type, moved * multiplier, self._phase(scopes),
                        self.layers.path(scopes))  # fmt: skip


def _bytes(tensor) -> int:
    return math.prod(flops_module._dims(tensor)) * tensor.dtype.size


def _layer_traffic(model, batch: int, inputs, labels, loss) -> dict[tuple[str, str], int]:
    """{(top-level layer name, phase): bytes} of one training step on `batch` samples."""
    x = tf.nest.map_structure(lambda s: tf.TensorSpec((batch, *s.shape[1:]), s.dtype), inputs)
    y = tf.nest.map_structure(lambda s: tf.TensorSpec((batch, *s.shape[1:]), s.dtype), labels)
    # An update keeps the gradients alive (the walk counts only ops that run); plain SGD
    # adds no layer's ops.
    function, scope = trace_train_step(model, x, y, loss=loss, optimizer=keras.optimizers.SGD())
    walker = _TrafficWalker(flops_module._LayerTree(model), {scope}, {})
    totals: dict[tuple[str, str], int] = {}
    for op in walker.walk(function.graph, "", 1):
        if op.layer:
            key = (op.layer[0], op.phase)
            totals[key] = totals.get(key, 0) + op.moved_bytes
    return totals


def elementwise_traffic(model, inputs, labels, loss) -> dict[str, tuple[int, int]]:
    """{layer name: (forward, backward) bytes per sample} the elementwise ops of the
    model's layers read and write in one training step (module doc).

    Args:
      model: a built Keras model.
      inputs, labels: `tf.TensorSpec`s (or structures of them) of one batch; their first
        dimension is replaced by 1 and 2.
      loss: `loss(y_true, y_pred, sample_weight)` -> scalar.
    """
    one, two = (_layer_traffic(model, b, inputs, labels, loss) for b in (1, 2))
    names = {name for name, _ in (*one, *two)}
    return {
        name: tuple(
            max(0, two.get((name, phase), 0) - one.get((name, phase), 0))
            for phase in (flops_module.FORWARD, flops_module.BACKWARD)
        )
        for name in names
    }


def with_elementwise_traffic(cost: ModelCost, traffic: Mapping[str, tuple[int, int]]) -> ModelCost:
    """`cost` with each node's elementwise bytes from `traffic` (`elementwise_traffic`:
    by layer name; a shared layer's calls split it evenly); nodes of no layer there keep
    theirs."""
    calls: dict[str, int] = {}
    for node in cost.nodes:
        base = _layer_of(node.name)
        calls[base] = calls.get(base, 0) + 1
    nodes = []
    for node in cost.nodes:
        base = _layer_of(node.name)
        if base not in traffic:
            nodes.append(node)
            continue
        forward, backward = (b / calls[base] for b in traffic[base])
        nodes.append(dataclasses.replace(node, elementwise_bytes=round(forward),
                                         elementwise_backward_bytes=round(backward)))  # fmt: skip
    return dataclasses.replace(cost, nodes=tuple(nodes))


def _layer_of(node_name: str) -> str:
    """The layer name of a node label (`cost.node_labels`: `name[i]` for a shared layer's
    i-th call)."""
    return node_name.split("[", 1)[0]
