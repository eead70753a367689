"""FLOPs of a traced training step, counted op by op from its TensorFlow graph.

`count_flops(concrete_function)` walks the graph a `tf.function` traced, and the graphs of
the functions it calls (PartitionedCall, XLA clusters), of its loops (While bodies) and of
its conditionals (If / Case branches). Only ops that run are counted: an op whose output
reaches no output and no stateful op is pruned by TensorFlow before it runs (e.g. the
gradient of a convolution with respect to the input images), so it is dropped here too.

Two kinds of FLOPs, a multiply-add counted as 2:

* **contractions** (`FlopCount.flops`, what MFU divides): MatMul, BatchMatMul*, Einsum
  with two operands, Conv2D/Conv3D/Conv and their input and filter backprops,
  DepthwiseConv2dNative and its backprops, each exactly from its static shapes:
  2 * product of every index size (a convolution: 2 * output positions * kernel volume
  * input channels per group; a backprop costs what its forward costs);
* **elementwise** (`FlopCount.elementwise_flops`, an estimate shown beside it): 1 FLOP per
  output element of float arithmetic and activations, 5 for softmax and the fused
  cross-entropies, one per input element for reductions. Data movement counts 0.

Loops: a While body counts `trip count` times. The trip count is read from the graph when
the loop counts a variable from a constant to a constant bound (`for i in range(7)`, a
`maximum_iterations`; several bounds: the smallest). A bound the graph does not hold (a
tensor input such as the engine's steps per call) is taken from `trip_counts` (keyed by the
While op's name) if given; otherwise the body counts once and the loop is listed in
`FlopCount.unknown_loops`, so the caller multiplies (it knows its steps per execution).
Conditionals count their most expensive branch (an upper bound of the step).

Attribution: each op gets the Keras layer path its name scopes name (`layer_0/query`:
Keras opens a scope per layer call, suffixed `_1`, `_2` when a name repeats), and a phase:
`backward` under a GradientTape's `gradient_tape` scope, `optimizer` under the optimizer's
scope, `forward` otherwise (the loss included).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence

import tensorflow as tf

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"
PHASES = (FORWARD, BACKWARD, OPTIMIZER)
_BACKWARD_SCOPES = frozenset({"gradient_tape", "gradients"})
_SUFFIX = re.compile(r"_\d+$")


@dataclasses.dataclass(frozen=True)
class OpFlops:
    """One counted op: its FLOPs over the whole step (loop trips included)."""

    name: str  # with the scopes of the calls and loops it runs in
    op_type: str
    flops: int
    contraction: bool
    phase: str
    layer: tuple[str, ...]  # Keras layer path; () outside any layer (loss, optimizer)


@dataclasses.dataclass(frozen=True)
class FlopCount:
    """The FLOPs of one traced function, with their breakdowns.

    Attributes:
      ops: every op with FLOPs.
      unknown_loops: While ops whose trip count the graph does not hold and `trip_counts`
        did not give (their bodies counted once).
      unresolved: contraction ops without static shapes (not counted).
    """

    ops: tuple[OpFlops, ...]
    unknown_loops: tuple[str, ...] = ()
    unresolved: tuple[str, ...] = ()

    @property
    def flops(self) -> int:
        """Contraction FLOPs (matmuls, einsums, convolutions): the MFU numerator."""
        return sum(op.flops for op in self.ops if op.contraction)

    @property
    def elementwise_flops(self) -> int:
        return sum(op.flops for op in self.ops if not op.contraction)

    def by_phase(self, contraction: bool = True) -> dict[str, int]:
        return _sum_by(self._ops(contraction), lambda op: op.phase, PHASES)

    def by_op_type(self, contraction: bool = True) -> dict[str, int]:
        totals = _sum_by(self._ops(contraction), lambda op: op.op_type)
        return dict(sorted(totals.items(), key=lambda item: -item[1]))

    def by_layer(self, depth: int = -1, phase: str | None = None) -> dict[str, int]:
        """Contraction FLOPs per layer path cut to `depth` levels (-1: the full path);
        ops outside any layer under ""."""
        ops = [op for op in self._ops(True) if phase is None or op.phase == phase]
        return _sum_by(ops, lambda op: "/".join(op.layer if depth < 0 else op.layer[:depth]))

    def by_stage(self, stage_of: Mapping[str, int] | Callable[[str], int | None]):
        """Contraction FLOPs per pipeline stage; `stage_of` maps a top-level layer name
        to its stage (a dict of layer-name regexes, as `stages=`, or a function). Ops of
        no stage (loss, optimizer, unmapped layers) are under None."""
        lookup = stage_of if callable(stage_of) else _regex_lookup(stage_of)
        totals = _sum_by(self._ops(True), lambda op: lookup(op.layer[0]) if op.layer else None)
        return dict(sorted(totals.items(), key=lambda item: (item[0] is None, item[0] or 0)))

    def _ops(self, contraction: bool):
        return [op for op in self.ops if op.contraction == contraction]


def count_flops(
    function,
    *,
    model=None,
    optimizer_scopes: Sequence[str] = (),
    trip_counts: Mapping[str, int] | None = None,
) -> FlopCount:
    """Counts the FLOPs of a traced function (a `ConcreteFunction` or its graph).

    Args:
      model: the Keras model whose layers the op name scopes are matched to.
      optimizer_scopes: name scopes of the optimizer update (Keras's: the optimizer name).
      trip_counts: trip counts of loops the graph does not bound, by While op name (the
        name with the scopes of the calls it is in, as `unknown_loops` lists them).
    """
    graph = getattr(function, "graph", function)
    walker = _Walker(_LayerTree(model), set(optimizer_scopes), dict(trip_counts or {}))
    ops = walker.walk(graph, "", 1)
    return FlopCount(tuple(ops), tuple(walker.unknown_loops), tuple(walker.unresolved))


def _sum_by(ops, key, order=()) -> dict:
    totals = dict.fromkeys(order, 0)
    for op in ops:
        k = key(op)
        totals[k] = totals.get(k, 0) + op.flops
    return totals


def _regex_lookup(stage_of: Mapping[str, int]) -> Callable[[str], int | None]:
    patterns = [(re.compile(pattern), stage) for pattern, stage in stage_of.items()]
    return lambda name: next((s for p, s in patterns if p.fullmatch(name)), None)


# ------------------------------------------------------------------ layer attribution
class _LayerTree:
    """Layer names as a tree, to map an op's name scopes to a layer path."""

    def __init__(self, model):
        self.children = self._children(model) if model is not None else {}

    def _children(self, layer) -> dict:
        sublayers = layer._flatten_layers(include_self=False, recursive=False)
        return {sub.name: self._children(sub) for sub in sublayers}

    def path(self, scopes: Sequence[str]) -> tuple[str, ...]:
        """Scopes that name a layer, in nesting order; other scopes (the model's own,
        `gradient_tape`, call and op scopes) are skipped."""
        node, path = self.children, []
        for scope in scopes:
            name = _layer_name(scope, node)
            if name is not None:
                path.append(name)
                node = node[name]
        return tuple(path)


def _layer_name(scope: str, children: Mapping) -> str | None:
    while scope:
        if scope in children:
            return scope
        stripped = _SUFFIX.sub("", scope)  # Keras's `_1` on a repeated scope name
        if stripped == scope:
            return None
        scope = stripped
    return None


# ------------------------------------------------------------------ the graph walk
_CALLS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
_WHILES = frozenset({"While", "StatelessWhile"})
_IFS = frozenset({"If", "StatelessIf"})
_CASES = frozenset({"Case", "StatelessCase"})


class _Walker:
    def __init__(self, layers: _LayerTree, optimizer_scopes: set[str], trip_counts: dict):
        self.layers = layers
        self.optimizer_scopes = optimizer_scopes
        self.trip_counts = trip_counts
        self.unknown_loops: list[str] = []
        self.unresolved: list[str] = []

    def walk(self, graph, prefix: str, multiplier: int) -> list[OpFlops]:
        counted: list[OpFlops] = []
        for op in _live_ops(graph):
            name = prefix + op.name
            if op.type in _CALLS or _function_graph(graph, op.type) is not None:
                inner = op.get_attr("f").name if op.type in _CALLS else op.type
                counted += self._call(graph, inner, name, multiplier)
            elif op.type in _WHILES:
                counted += self._loop(graph, op, name, multiplier)
            elif op.type in _IFS or op.type in _CASES:
                names = (
                    [op.get_attr("then_branch").name, op.get_attr("else_branch").name]
                    if op.type in _IFS
                    else [branch.name for branch in op.get_attr("branches")]
                )
                branches = [self._call(graph, inner, name, multiplier) for inner in names]
                counted += max(branches, key=lambda ops: (_total(ops, True), _total(ops, False)))
            else:
                record = self._record(op, name, multiplier)
                if record is not None:
                    counted.append(record)
        return counted

    def _call(self, graph, function_name: str, name: str, multiplier: int) -> list[OpFlops]:
        inner = _function_graph(graph, function_name)
        if inner is None:  # a function without its traced graph (e.g. loaded): no shapes
            self.unresolved.append(name)
            return []
        return self.walk(inner, name + "/", multiplier)

    def _loop(self, graph, op, name: str, multiplier: int) -> list[OpFlops]:
        body = _function_graph(graph, op.get_attr("body").name)
        cond = _function_graph(graph, op.get_attr("cond").name)
        if body is None or cond is None:
            self.unresolved.append(name)
            return []
        trips = self.trip_counts.get(name)
        if trips is None:
            trips = trip_count(op, cond, body)
        if trips is None:
            self.unknown_loops.append(name)
            trips = 1
        # The condition runs once more than the body (the test that ends the loop).
        return self.walk(body, name + "/", multiplier * trips) + self.walk(
            cond, name + "/", multiplier * (trips + 1)
        )

    def _record(self, op, name: str, multiplier: int) -> OpFlops | None:
        contraction = op.type in CONTRACTIONS
        formula = CONTRACTIONS.get(op.type) or _elementwise
        try:
            flops = formula(op)
        except _Unknown:
            if contraction:
                self.unresolved.append(name)
            return None
        if not flops:
            return None
        scopes = name.split("/")[:-1]
        phase, layer = self._phase(scopes), self.layers.path(scopes)
        return OpFlops(name, op.type, int(flops) * multiplier, contraction, phase, layer)

    def _phase(self, scopes: Sequence[str]) -> str:
        if any(scope in _BACKWARD_SCOPES for scope in scopes):
            return BACKWARD
        # The graph makes a scope unique with a suffix ("adam" -> "adam_1"), and the
        # optimizer's own name may carry one already ("adam_1", the second Adam made).
        if any(
            scope in self.optimizer_scopes or _SUFFIX.sub("", scope) in self.optimizer_scopes
            for scope in scopes
        ):
            return OPTIMIZER
        return FORWARD


def _total(ops: Sequence[OpFlops], contraction: bool) -> int:
    return sum(op.flops for op in ops if op.contraction == contraction)


def _live_ops(graph) -> list:
    """The ops that run: ancestors of the outputs and control outputs (TensorFlow prunes
    the rest of a function before running it)."""
    operations = graph.get_operations()
    roots = [t.op for t in getattr(graph, "outputs", ())]
    roots += list(getattr(graph, "control_outputs", ()))
    if not roots:
        return operations
    seen, stack = set(), roots
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return [op for op in operations if op in seen]


def _function_graph(graph, name: str):
    """The FuncGraph of a function the graph (or a graph it is nested in) defines.

    TensorFlow keeps the traced FuncGraph of every function it adds to a graph (private
    `_functions`); only there do the inner ops keep their static shapes.
    """
    while graph is not None:
        function = getattr(graph, "_functions", {}).get(name)
        if function is not None:
            return function.graph
        graph = getattr(graph, "outer_graph", None)
    return None


# ------------------------------------------------------------------ loop trip counts
_COMPARISONS = {"Less": 0, "LessEqual": 1, "Greater": 0, "GreaterEqual": 1}


def trip_count(while_op, cond_graph, body_graph) -> int | None:
    """The trips of a While loop whose condition compares a counted loop variable (a
    constant start, a constant step in the body) with a constant bound; the smallest such
    bound when several are combined (a `maximum_iterations` and the user's condition).
    None when the graph holds no such bound."""
    inputs = list(while_op.inputs)
    cond_args = list(cond_graph.inputs)
    bounds = []
    for op in _live_ops(cond_graph):
        if op.type not in _COMPARISONS:
            continue
        left, right = op.inputs
        if op.type.startswith("Greater"):  # bound > i  is  i < bound
            left, right = right, left
        index = _loop_var_index(left, cond_args)
        bound = _constant_value(right, cond_args, inputs, body_graph)
        if index is None or bound is None:
            continue
        start = _const(inputs[index])
        step = _step(body_graph, index)
        if start is None or not step or step < 0:
            continue
        trips = math.ceil((bound + _COMPARISONS[op.type] - start) / step)
        bounds.append(max(int(trips), 0))
    return min(bounds) if bounds else None


def _skip_identity(tensor):
    while tensor.op.type in ("Identity", "Cast"):
        tensor = tensor.op.inputs[0]
    return tensor


def _loop_var_index(tensor, args) -> int | None:
    tensor = _skip_identity(tensor)
    return next((i for i, arg in enumerate(args) if arg is tensor), None)


def _constant_value(tensor, cond_args, while_inputs, body_graph) -> float | None:
    """A constant in the condition, or a loop variable that starts constant and that the
    body passes on unchanged."""
    value = _const(tensor)
    if value is not None:
        return value
    index = _loop_var_index(tensor, cond_args)
    if index is None:
        return None
    body_out = _skip_identity(body_graph.outputs[index])
    if _loop_var_index(body_out, body_graph.inputs) != index:
        return None
    return _const(while_inputs[index])


def _step(body_graph, index: int) -> float | None:
    out = _skip_identity(body_graph.outputs[index])
    if out.op.type not in ("Add", "AddV2"):
        return None
    a, b = out.op.inputs
    if _loop_var_index(a, body_graph.inputs) == index:
        return _const(b)
    if _loop_var_index(b, body_graph.inputs) == index:
        return _const(a)
    return None


def _const(tensor) -> float | None:
    tensor = _skip_identity(tensor)
    if tensor.op.type != "Const":
        return None
    value = tf.make_ndarray(tensor.op.get_attr("value"))
    return float(value) if value.size == 1 else None


# ------------------------------------------------------------------ per-op formulas
class _Unknown(Exception):
    """A shape the formula needs is not static."""


def _dims(tensor) -> tuple[int, ...]:
    shape = tensor.shape
    if shape.rank is None or None in shape.as_list():
        raise _Unknown
    return tuple(shape.as_list())


def _size(tensor) -> int:
    return math.prod(_dims(tensor))


def _matmul(op) -> int:
    a = _dims(op.inputs[0])
    transpose = op.get_attr("transpose_a")
    return 2 * _size(op.outputs[0]) * (a[0] if transpose else a[1])


def _batch_matmul(op) -> int:
    x = _dims(op.inputs[0])
    adjoint = op.get_attr("adj_x")
    return 2 * _size(op.outputs[0]) * (x[-2] if adjoint else x[-1])


def _einsum(op) -> int:
    """2 * product of every index size (operands broadcast under `...`)."""
    operands, _, _ = op.get_attr("equation").decode().replace(" ", "").partition("->")
    specs = operands.split(",")
    if len(specs) != 2:
        return 0  # a transpose or reduction: no multiply-add
    shapes = [_dims(t) for t in op.inputs]
    sizes: dict[str, int] = {}
    ranks = [len(s) - len(spec) + 3 if "..." in spec else 0 for spec, s in zip(specs, shapes)]
    width = max(ranks)  # broadcast dims under `...` align from the right
    for spec, shape, rank in zip(specs, shapes, ranks):
        head, _, tail = spec.partition("...")
        labels = [*head, *(f"...{width - rank + i}" for i in range(rank)), *tail]
        for label, size in zip(labels, shape, strict=True):
            sizes[label] = max(sizes.get(label, 1), size)
    return 2 * math.prod(sizes.values())


def _conv(op) -> int:
    """Conv2D / Conv3D / Conv: each output element is a dot over the filter's
    spatial x input-channels-per-group."""
    return 2 * _size(op.outputs[0]) * math.prod(_dims(op.inputs[1])[:-1])


def _conv_backprop_input(op) -> int:
    return 2 * _size(op.inputs[2]) * math.prod(_dims(op.inputs[1])[:-1])


def _conv_backprop_filter(op) -> int:
    return 2 * _size(op.inputs[2]) * math.prod(_dims(op.outputs[0])[:-1])


def _depthwise(op) -> int:
    return 2 * _size(op.outputs[0]) * math.prod(_dims(op.inputs[1])[:-2])


def _depthwise_backprop_input(op) -> int:
    return 2 * _size(op.inputs[2]) * math.prod(_dims(op.inputs[1])[:-2])


def _depthwise_backprop_filter(op) -> int:
    return 2 * _size(op.inputs[2]) * math.prod(_dims(op.outputs[0])[:-2])


CONTRACTIONS: dict[str, Callable] = {
    "MatMul": _matmul,
    "_FusedMatMul": _matmul,
    "BatchMatMul": _batch_matmul,
    "BatchMatMulV2": _batch_matmul,
    "BatchMatMulV3": _batch_matmul,
    "Einsum": _einsum,
    "Conv2D": _conv,
    "_FusedConv2D": _conv,
    "Conv3D": _conv,
    "Conv": _conv,
    "Conv2DBackpropInput": _conv_backprop_input,
    "Conv2DBackpropInputV2": _conv_backprop_input,
    "Conv3DBackpropInputV2": _conv_backprop_input,
    "Conv2DBackpropFilter": _conv_backprop_filter,
    "Conv2DBackpropFilterV2": _conv_backprop_filter,
    "Conv3DBackpropFilterV2": _conv_backprop_filter,
    "DepthwiseConv2dNative": _depthwise,
    "DepthwiseConv2dNativeBackpropInput": _depthwise_backprop_input,
    "DepthwiseConv2dNativeBackpropFilter": _depthwise_backprop_filter,
}

# Elementwise estimates: FLOPs per output element of float ops (unlisted ops: 0).
_ARITHMETIC = """Add AddV2 Sub Mul RealDiv Div DivNoNan MulNoNan Neg Maximum Minimum BiasAdd
SquaredDifference Square Abs Sign Floor Reciprocal Relu Relu6 LeakyRelu Elu Selu ReluGrad
Relu6Grad LeakyReluGrad EluGrad SeluGrad Exp Expm1 Log Log1p Sqrt Rsqrt Tanh Sigmoid Erf
Softplus Pow TanhGrad SigmoidGrad RsqrtGrad SqrtGrad Select SelectV2 ClipByValue"""
_PER_OUTPUT = {**dict.fromkeys(_ARITHMETIC.split(), 1), "Softmax": 5, "LogSoftmax": 5}
_PER_INPUT = {  # reductions and fused ops: per element of their first input
    **dict.fromkeys(["Sum", "Mean", "Max", "Min", "Prod", "BiasAddGrad", "L2Loss"], 1),
    "SoftmaxCrossEntropyWithLogits": 5,
    "SparseSoftmaxCrossEntropyWithLogits": 5,
}
_UPDATES = frozenset({"AssignAddVariableOp", "AssignSubVariableOp"})  # value: input 1


def _elementwise(op) -> int:
    if op.type in _PER_OUTPUT and op.outputs and op.outputs[0].dtype.is_floating:
        return _PER_OUTPUT[op.type] * _size(op.outputs[0])
    if op.type in _PER_INPUT and op.inputs and op.inputs[0].dtype.is_floating:
        return _PER_INPUT[op.type] * _size(op.inputs[0])
    if op.type == "AddN" and op.outputs[0].dtype.is_floating:
        return (len(op.inputs) - 1) * _size(op.outputs[0])
    if op.type in _UPDATES and op.inputs[1].dtype.is_floating:
        return _size(op.inputs[1])
    return 0
