"""A static cost model of a Keras functional model: parameters, FLOPs and activation
bytes of every compute node, from shapes alone.

Nothing is executed and no TensorFlow op is built: the numbers come from the
`KerasTensor` shapes recorded in the functional graph and from the layers' weights.
The automatic pipeline partition (`core/graph/auto_partition.py`) balances stages on these
numbers; memory planning reads the same `NodeCost`s (parameter and activation bytes).

Conventions:

* One row per compute node in topological order (`core.partition.compute_nodes`, the
  same order as `strategies.model_nodes`). A shared layer has one node per call.
* The batch dimension (dim 0 of every tensor) counts as 1: FLOPs and bytes are *per
  sample*. Unknown non-batch dimensions (`None`, e.g. a variable sequence length) also
  count as 1, so such models are costed per position.
* `params` counts every weight element (trainable or not) of the layer, on the
  layer's first node only; later calls of a shared layer show 0. Weights of nested
  layers count on the outer layer.
* `flops` are forward FLOPs, a multiply-add counted as 2. The backward pass costs about
  twice the forward of the same layer, so it does not change which cut balances best.
* `activation_bytes` are the node's output bytes: what the next nodes keep for backward.
  `internal_bytes` is what the layer keeps inside besides (TensorFlow's gradients of
  Keras's layers): MultiHeadAttention its scaled query, key, value, attention
  probabilities and context; LayerNormalization its normalising factor (float32, plus a
  float32 copy of a 16-bit input); a GELU activation x/sqrt(2), 1+erf(.) and x/2
  (Keras's exact form). `core/plan/analytic.py` counts the same for its transformer layers.
* `NodeCost` is defined in `core/plan/estimate.py`, the TensorFlow-free estimator that turns
  these rows (via `auto_partition.model_cost`) into per-device memory and traffic.

Per-layer FLOPs (batch 1; `rows` = product of the non-batch dims except the last):

========================  ==========================================================
Dense                     2 * in_features * units * rows (bias, activation ignored)
EinsumDense, ops.einsum   2 * product of every index size of the equation
ops.matmul                2 * output elements * contracted dim
Conv1D/2D/3D              2 * kernel elements * output positions, where kernel
                          elements = kernel volume * in_ch / groups * out_ch;
                          Depthwise / Separable likewise with their kernels;
                          ConvTranspose uses the *input* positions
RNN (LSTM, GRU, ...)      2 * elements of all matrices * timesteps
MultiHeadAttention        query/key/value projections (2 * T * d * heads * key_dim
                          each) + Q.K^T (2 * Tq * Tk * heads * key_dim) + softmax
                          (5 * Tq * Tk * heads) + A.V (2 * Tq * Tk * heads *
                          value_dim) + output projection (2 * heads * value_dim *
                          output elements); T = query/key/value positions
Embedding                 output elements (a gather)
Pooling                   pool volume * output elements; global pooling: input elements
Normalisation, softmax,   a small multiple of the output elements
activations, elementwise  (`ELEMENTWISE_FLOPS`; 1 for unlisted weightless ops)
Reshape, concat, ...      0 (data movement, `DATA_MOVEMENT`)
Functional sub-model      the sum of its own nodes, recursively
Other layers with weights approximation for matmul-dominated blocks: 2 * kernel
(custom Layer subclasses) elements * rows for every sublayer with a `kernel`, plus
                          the attention terms of MultiHeadAttention sublayers
                          (self-attention over `rows` positions assumed), plus the
                          elementwise factor of normalisation sublayers and one
                          FLOP per output element for residual adds
========================  ==========================================================
"""

from __future__ import annotations

import math
import string
from collections import Counter
from collections.abc import Sequence

import keras
import numpy as np

from epl_trainer.core.graph.partition import compute_nodes
from epl_trainer.core.plan.analytic import Gemm
from epl_trainer.core.plan.estimate import NodeCost
from epl_trainer.core.plan.ir import format_count

__all__ = [
    "DATA_MOVEMENT",
    "ELEMENTWISE_FLOPS",
    "NodeCost",
    "model_cost_summary",
    "node_costs",
    "node_labels",
    "nodes_cost",
    "tensor_bytes",
]

# FLOPs per output element of cheap layers/ops (keyed by class name).
ELEMENTWISE_FLOPS = {
    "LayerNormalization": 8,  # mean, variance, normalise, scale, shift
    "GroupNormalization": 8,
    "RMSNormalization": 4,
    "BatchNormalization": 4,
    "UnitNormalization": 3,
    "Normalization": 2,
    "Softmax": 5,  # max, subtract, exp, sum, divide
    "Dropout": 1,
    "Activation": 1,
    "ReLU": 1,
    "LeakyReLU": 1,
    "PReLU": 1,
    "ELU": 1,
}
# Ops that move data without arithmetic.
DATA_MOVEMENT = frozenset(
    {
        "Reshape",
        "Flatten",
        "Permute",
        "RepeatVector",
        "Concatenate",
        "Identity",
        "Transpose",
        "ExpandDims",
        "Squeeze",
        "Stack",
        "GetItem",
        "Cropping1D",
        "Cropping2D",
        "Cropping3D",
        "ZeroPadding1D",
        "ZeroPadding2D",
        "ZeroPadding3D",
    }
)
_ATTENTION_SOFTMAX_FLOPS = 5


def node_costs(model: keras.Model) -> list[NodeCost]:
    """The cost of every compute node of a functional (or built Sequential) model, in
    topological order (`compute_nodes(model)`).

    Raises:
      PartitionError: a subclassed model (it has no layer graph to cost).
    """
    return nodes_cost(compute_nodes(model))


def nodes_cost(nodes: Sequence) -> list[NodeCost]:
    """`NodeCost`s of Keras nodes, in the given order; weights count on first sight."""
    seen: set[int] = set()
    return [
        _node_cost(node, label, seen) for node, label in zip(nodes, node_labels(nodes), strict=True)
    ]


def node_labels(nodes: Sequence) -> list[str]:
    """Layer names, with `[i]` on the i-th call of a layer called several times in
    `nodes` (calls made elsewhere, e.g. by sub-models cut from the graph, do not count)."""
    calls = Counter(id(node.operation) for node in nodes)
    seen: Counter = Counter()
    labels = []
    for node in nodes:
        key = id(node.operation)
        label = node.operation.name
        labels.append(f"{label}[{seen[key]}]" if calls[key] > 1 else label)
        seen[key] += 1
    return labels


def model_cost_summary(model: keras.Model) -> str:
    """A table of every node's cost with totals (what the partitioner balances)."""
    nodes = compute_nodes(model)
    costs = nodes_cost(nodes)
    header = ("#", "node", "type", "output shape", "params", "FLOPs", "activation")
    rows = [
        (
            str(i),
            cost.name,
            cost.kind,
            ", ".join(str(tuple(t.shape)) for t in node.output_tensors),
            format_count(cost.params),
            format_count(cost.flops),
            format_bytes(cost.activation_bytes),
        )
        for i, (node, cost) in enumerate(zip(nodes, costs, strict=True))
    ]
    rows.append(
        (
            "",
            "total",
            "",
            "",
            format_count(sum(c.params for c in costs)),
            format_count(sum(c.flops for c in costs)),
            format_bytes(sum(c.activation_bytes for c in costs)),
        )
    )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        f"Cost of model {model.name!r}: {len(nodes)} nodes, per sample (batch 1); "
        "FLOPs are forward FLOPs, activation = output bytes",
        "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip(),
        "  ".join("-" * w for w in widths),
    ]
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    return "\n".join(lines)


def tensor_bytes(tensor) -> int:
    """Bytes of a KerasTensor with batch 1 (unknown dims count as 1)."""
    return _elements(tensor.shape) * _dtype_bytes(tensor.dtype)


def format_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


# ------------------------------------------------------------------ per node
def _node_cost(node, label: str, seen: set[int]) -> NodeCost:
    operation = node.operation
    params = param_bytes = 0
    for weight in getattr(operation, "weights", ()):
        if id(weight) in seen:
            continue
        seen.add(id(weight))
        size = _size(weight.shape)
        params += size
        param_bytes += size * _dtype_bytes(weight.dtype)
    outputs = list(node.output_tensors)
    activation_bytes = sum(tensor_bytes(t) for t in outputs)
    internal, float32 = _internal_bytes(node)
    return NodeCost(
        name=label,
        params=params,
        flops=int(_flops(node)),
        activation_bytes=activation_bytes,
        kind=type(operation).__name__,
        param_bytes=param_bytes,
        internal_bytes=internal,
        float32_bytes=float32,
        gemms=_gemms(node),
        backward_reads_output=_backward_reads_output(operation),
        backward_reads_inputs=_backward_reads_inputs(operation),
    )


# Layers whose backward reads neither their inputs nor their output: an add's, a
# concatenation's and an average's gradients are the upstream gradient, split or scaled.
_GRADIENT_PASSES_THROUGH = (
    keras.layers.Add,
    keras.layers.Subtract,
    keras.layers.Average,
    keras.layers.Concatenate,
    keras.layers.GlobalAveragePooling1D,
    keras.layers.GlobalAveragePooling2D,
)
# Activations whose gradient reads the activation's input (inside the layer), not its
# output: a linear layer's backward reads only its inputs and weights.
_INPUT_READING_ACTIVATIONS = ("linear", "gelu")


def _backward_reads_output(operation) -> bool:
    """Whether the layer's backward reads its forward output (conservative: True unless
    known not to). A Dense or EinsumDense layer's does only through its activation (a
    ReLU's, sigmoid's or tanh's gradient reads the activation's output)."""
    if isinstance(operation, _GRADIENT_PASSES_THROUGH):
        return False
    if isinstance(operation, (keras.layers.Dense, keras.layers.EinsumDense)):
        activation = getattr(operation.activation, "__name__", "")
        return activation not in _INPUT_READING_ACTIVATIONS
    return True


def _backward_reads_inputs(operation) -> bool:
    """Whether the layer's backward reads its forward inputs (True unless known not to)."""
    return not isinstance(operation, _GRADIENT_PASSES_THROUGH)


def _gemms(node) -> tuple:
    """The node's forward matmuls by shape (`analytic.Gemm`, per sample), for the layers
    whose products are known: Dense, EinsumDense, MultiHeadAttention (its projections,
    and per head its scores and context: each sample's own products). () for the rest,
    which are timed by their FLOPs."""
    operation = node.operation
    inputs = list(node.input_tensors)
    if isinstance(operation, keras.layers.MultiHeadAttention):
        return _attention_gemms(operation, node)
    if isinstance(operation, keras.layers.EinsumDense):
        return (_einsum_dense_gemm(operation.equation, inputs[0].shape, operation.kernel.shape),)
    if isinstance(operation, keras.layers.Dense) and inputs:
        shape = inputs[0].shape
        return (Gemm(_rows(shape), operation.units, shape[-1] or 1),)
    return ()


def _einsum_dense_gemm(equation: str, input_shape, kernel_shape) -> Gemm:
    """An EinsumDense as one product: the input's indices that the kernel lacks are its
    rows (the batch's first excluded), the kernel's it shares with the input the inner
    size, the kernel's in the output its columns."""
    operands, _, output = equation.replace(" ", "").partition("->")
    source, _, kernel = operands.partition(",")
    sizes = dict(zip(kernel, (1 if d is None else d for d in kernel_shape), strict=False))
    dims = [1 if d is None else d for d in tuple(input_shape)]
    for index, (letter, size) in enumerate(zip(source, dims, strict=False)):
        sizes.setdefault(letter, 1 if index == 0 else size)
    rows = math.prod(sizes[c] for c in source if c not in kernel and c in output)
    inner = math.prod(sizes[c] for c in kernel if c in source and c not in output)
    cols = math.prod(sizes[c] for c in kernel if c in output and c not in source)
    return Gemm(rows, cols, inner)


def _attention_sizes(layer, node) -> tuple:
    """(query, key, value, heads, key_dim, value_dim) of a MultiHeadAttention call (key
    defaults to value, as Keras's does)."""
    args, kwargs = node.arguments.args, node.arguments.kwargs
    query = args[0] if args else kwargs["query"]
    value = args[1] if len(args) > 1 else kwargs["value"]
    key = args[2] if len(args) > 2 else kwargs.get("key")
    key = value if key is None else key
    return query, key, value, layer.num_heads, layer.key_dim, layer.value_dim or layer.key_dim


def _attention_gemms(layer, node) -> tuple:
    query, key, value, heads, key_dim, value_dim = _attention_sizes(layer, node)
    q_len, k_len, v_len = _rows(query.shape), _rows(key.shape), _rows(value.shape)
    out_dim = node.output_tensors[0].shape[-1] or 1
    return (
        Gemm(q_len, heads * key_dim, query.shape[-1] or 1),
        Gemm(k_len, heads * key_dim, key.shape[-1] or 1),
        Gemm(v_len, heads * value_dim, value.shape[-1] or 1),
        Gemm(q_len, k_len, key_dim, heads, stacked=False),
        Gemm(q_len, value_dim, k_len, heads, stacked=False),
        Gemm(q_len, out_dim, heads * value_dim),
    )


_GELU_KEPT = 3  # x/sqrt(2), 1 + erf(.), x/2; the output is counted as the node's output


def _internal_bytes(node) -> tuple[int, int]:
    """(bytes a layer keeps for backward besides its outputs, the float32 part of them)."""
    operation = node.operation
    outputs = list(node.output_tensors)
    if not outputs:
        return 0, 0
    out = outputs[0]
    if isinstance(operation, keras.layers.MultiHeadAttention):
        args, kwargs = node.arguments.args, node.arguments.kwargs
        query = args[0] if args else kwargs["query"]
        value = args[1] if len(args) > 1 else kwargs["value"]
        key = args[2] if len(args) > 2 else kwargs.get("key")
        key = value if key is None else key
        heads, key_dim = operation.num_heads, operation.key_dim
        value_dim = operation.value_dim or key_dim
        q_len, k_len, v_len = _rows(query.shape), _rows(key.shape), _rows(value.shape)
        elements = heads * (
            q_len * key_dim
            + k_len * key_dim
            + v_len * value_dim
            + q_len * k_len
            + q_len * value_dim
        )
        return elements * _dtype_bytes(out.dtype), 0
    if isinstance(operation, keras.layers.LayerNormalization):
        elements = _elements(out.shape)
        copies = 1 if _dtype_bytes(out.dtype) >= 4 else 2  # factor (+ float32 input copy)
        return 4 * elements * copies, 4 * elements * copies
    activation = getattr(operation, "activation", None)
    if getattr(activation, "__name__", "") == "gelu":
        return _GELU_KEPT * tensor_bytes(out), 0
    return 0, 0


def _flops(node) -> float:
    operation = node.operation
    kind = type(operation).__name__
    inputs, outputs = list(node.input_tensors), list(node.output_tensors)
    out_elements = sum(_elements(t.shape) for t in outputs)
    layers = keras.layers
    if isinstance(operation, keras.Model):
        return _submodel_flops(operation, inputs, outputs)
    if isinstance(operation, layers.MultiHeadAttention):
        return _attention_flops(operation, node)
    if isinstance(operation, layers.EinsumDense):
        return _einsum_flops(operation.equation, inputs[0].shape, operation.kernel.shape)
    if isinstance(operation, layers.Dense):
        return 2 * inputs[0].shape[-1] * operation.units * _rows(inputs[0].shape)
    if isinstance(operation, layers.Embedding):
        return out_elements
    if _is_conv(operation):
        return _conv_flops(operation, inputs, outputs)
    if isinstance(operation, layers.RNN):
        timesteps = inputs[0].shape[1] if len(inputs[0].shape) > 2 else 1
        return 2 * _matrix_elements(operation.weights) * (timesteps or 1)
    if "Pool" in kind:
        if kind.startswith("Global") or kind.startswith("Adaptive"):
            return _elements(inputs[0].shape)
        return _size(getattr(operation, "pool_size", (1,))) * out_elements
    if kind == "Matmul":
        return 2 * out_elements * (inputs[0].shape[-1] or 1)
    if kind == "Einsum" and len(inputs) == 2:
        return _einsum_flops(operation.subscripts, inputs[0].shape, inputs[1].shape, True)
    if kind in DATA_MOVEMENT:
        return 0
    if kind in ELEMENTWISE_FLOPS:
        return ELEMENTWISE_FLOPS[kind] * out_elements
    if getattr(operation, "weights", None):
        return _block_flops(operation, outputs)
    return out_elements * max(len(inputs) - 1, 1)


def _submodel_flops(model, inputs, outputs) -> float:
    """A functional sub-model: its own nodes, unless its graph lost shapes we know."""
    try:
        inner = compute_nodes(model)
    except ValueError:  # subclassed model used as a layer
        return _block_flops(model, outputs)
    graph_inputs = getattr(getattr(model, "_functional", model), "inputs", None) or []
    unknown = any(None in tuple(t.shape)[1:] for t in graph_inputs)
    known_outside = all(None not in tuple(t.shape)[1:] for t in inputs)
    if unknown and known_outside:
        return _block_flops(model, outputs)
    return sum(_flops(node) for node in inner)


def _attention_flops(layer, node) -> float:
    query, key, value, heads, key_dim, value_dim = _attention_sizes(layer, node)
    q_len, k_len, v_len = _rows(query.shape), _rows(key.shape), _rows(value.shape)
    projections = (
        2
        * heads
        * (
            q_len * query.shape[-1] * key_dim
            + k_len * key.shape[-1] * key_dim
            + v_len * value.shape[-1] * value_dim
        )
    )
    scores = 2 * q_len * k_len * heads * key_dim
    softmax = _ATTENTION_SOFTMAX_FLOPS * q_len * k_len * heads
    weighted = 2 * q_len * k_len * heads * value_dim
    output = 2 * heads * value_dim * _elements(node.output_tensors[0].shape)
    return projections + scores + softmax + weighted + output


def _einsum_flops(equation: str, left_shape, right_shape, right_has_batch=False) -> float:
    """2 * product of every index size; the batch dim of each operand counts as 1."""
    operands, _, _ = equation.replace(" ", "").partition("->")
    left, _, right = operands.partition(",")
    spare = iter(c for c in string.ascii_letters if c not in equation)
    sizes: dict[str, int] = {}
    for spec, shape, has_batch in ((left, left_shape, True), (right, right_shape, right_has_batch)):
        dims = [1 if d is None else d for d in tuple(shape)]
        if has_batch and dims:
            dims[0] = 1
        if "..." in spec:
            head, _, tail = spec.partition("...")
            spec = head + "".join(next(spare) for _ in range(len(dims) - len(head) - len(tail)))
            spec += tail
        for letter, size in zip(spec, dims, strict=False):
            sizes[letter] = max(sizes.get(letter, 1), size)
    return 2 * math.prod(sizes.values())


def _is_conv(layer) -> bool:
    layers = keras.layers
    return isinstance(
        layer,
        layers.Conv1D
        | layers.Conv2D
        | layers.Conv3D
        | layers.Conv1DTranspose
        | layers.Conv2DTranspose
        | layers.Conv3DTranspose
        | layers.DepthwiseConv1D
        | layers.DepthwiseConv2D
        | layers.SeparableConv1D
        | layers.SeparableConv2D,
    )


def _conv_flops(layer, inputs, outputs) -> float:
    layers = keras.layers
    transpose = isinstance(
        layer, layers.Conv1DTranspose | layers.Conv2DTranspose | layers.Conv3DTranspose
    )
    # Positions where the kernel is applied: output positions, or input positions for a
    # transposed convolution (it scatters each input position through the kernel).
    shape = tuple(inputs[0].shape if transpose else outputs[0].shape)
    channels_first = getattr(layer, "data_format", "channels_last") == "channels_first"
    spatial = shape[2:] if channels_first else shape[1:-1]
    kernels = sum(_size(w.shape) for w in layer.weights if len(w.shape) >= 3)
    return 2 * kernels * _size(spatial)


def _block_flops(layer, outputs) -> float:
    """Approximation for a custom layer (or subclassed model) called as one node."""
    out_shape = outputs[0].shape if outputs else (None,)
    rows = _rows(out_shape)
    out_elements = sum(_elements(t.shape) for t in outputs)
    sublayers = list(layer._flatten_layers(include_self=False, recursive=True))
    if not sublayers:
        return 2 * _matrix_elements(layer.weights) * rows + out_elements
    flops = out_elements  # residual adds and the like
    for sub in sublayers:
        kernel = getattr(sub, "kernel", None)
        if (
            kernel is not None
            and hasattr(kernel, "shape")
            and not isinstance(sub, keras.layers.Embedding)
        ):
            flops += 2 * _size(kernel.shape) * rows
        if isinstance(sub, keras.layers.MultiHeadAttention):
            value_dim = sub.value_dim or sub.key_dim
            flops += rows * rows * sub.num_heads * (2 * sub.key_dim + 2 * value_dim)
            flops += _ATTENTION_SOFTMAX_FLOPS * rows * rows * sub.num_heads
        flops += ELEMENTWISE_FLOPS.get(type(sub).__name__, 0) * out_elements
    return flops


# ------------------------------------------------------------------ shapes
def _size(shape) -> int:
    return math.prod(1 if d is None else int(d) for d in tuple(shape))


def _elements(shape) -> int:
    """Elements with batch 1 (dim 0 dropped; unknown dims count as 1)."""
    return _size(tuple(shape)[1:])


def _rows(shape) -> int:
    """Positions a last-dim matmul runs over: non-batch dims except the last."""
    return _size(tuple(shape)[1:-1])


def _matrix_elements(weights) -> int:
    return sum(_size(w.shape) for w in weights if len(w.shape) >= 2)


_ITEMSIZE = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "string": 8}


def _dtype_bytes(dtype) -> int:
    name = str(getattr(dtype, "name", dtype))
    if name in _ITEMSIZE:
        return _ITEMSIZE[name]
    try:
        return np.dtype(name).itemsize
    except TypeError:
        return 4
