"""Fused gradient reductions: buckets of flattened tensors, the fp16 wire format, and
sparse (IndexedSlices) gradients reduced by gathering rows."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from epl_trainer.core.comm.group import CollectiveGroup


def plan_buckets(sizes: Sequence[int], dtypes: Sequence, max_splits: int) -> list[list[int]]:
    """Groups tensors into at most `max_splits` buckets per dtype, balanced by size.

    Buckets are contiguous runs in the given order (so the first gradients ready in
    backward can be sent first) with cut points chosen to even out the byte counts.

    Returns:
      Lists of indices into `sizes`, one list per bucket.
    """
    if max_splits < 1:
        raise ValueError(f"max_splits must be >= 1. Received: {max_splits}")
    by_dtype: dict[str, list[int]] = {}
    for i, dtype in enumerate(dtypes):
        by_dtype.setdefault(str(dtype), []).append(i)
    buckets = []
    for indices in by_dtype.values():
        buckets.extend(_balanced_runs(indices, [sizes[i] for i in indices], max_splits))
    return buckets


def _balanced_runs(indices: list[int], sizes: list[int], parts: int) -> list[list[int]]:
    parts = min(parts, len(indices))
    total = sum(sizes)
    runs, current, filled = [], [], 0
    for index, size in zip(indices, sizes):
        current.append(index)
        filled += size
        runs_left = parts - len(runs) - 1
        items_left = len(indices) - sum(len(r) for r in runs) - len(current)
        # Close the run once it holds its share of the bytes, keeping one item per
        # remaining run; close it anyway when only one item per remaining run is left
        # (otherwise every later item lands in this run).
        reached = filled >= total * (len(runs) + 1) / parts
        if runs_left > 0 and items_left >= runs_left and (reached or items_left == runs_left):
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def fused_all_reduce(
    group: CollectiveGroup,
    per_member: Sequence[Sequence[tf.Tensor]],
    buckets: Sequence[Sequence[int]],
    reduction: str,
    num_chains: int = 1,
    wire_fp16_scale: float | None = None,
) -> list[list[tf.Tensor]]:
    """All-reduces lists of tensors, one collective per bucket of flattened tensors.

    Args:
      group: the collective group.
      per_member: `per_member[i]` is the list of tensors of local member i (same
        shapes and dtypes on every member).
      buckets: index lists from `plan_buckets`.
      reduction: "mean" or "sum".
      num_chains: buckets are spread round-robin over this many ordering chains.
      wire_fp16_scale: `communication.fp16`: float32 buckets travel as float16 after
        being multiplied by this scale (so small gradients do not underflow), and are
        divided by it again after the reduction. None sends buckets as they are.

    Returns:
      The reduced tensors, same structure as `per_member`.
    """
    if group.size == 1:
        return [list(tensors) for tensors in per_member]
    results = [list(tensors) for tensors in per_member]
    for bucket_index, bucket in enumerate(buckets):
        flats = []
        for device, tensors in zip(group.local_devices, per_member):
            with tf.device(device):
                flats.append(tf.concat([tf.reshape(tensors[i], [-1]) for i in bucket], axis=0))
        dtype = flats[0].dtype
        compress = wire_fp16_scale is not None and dtype == tf.float32
        if compress:
            flats = [_to_fp16_wire(flat, wire_fp16_scale) for flat in flats]
        reduced = group.all_reduce(flats, reduction, chain=bucket_index % num_chains)
        if compress:
            reduced = [_from_fp16_wire(flat, wire_fp16_scale, dtype) for flat in reduced]
        for member, (device, flat) in enumerate(zip(group.local_devices, reduced)):
            template = per_member[member]
            with tf.device(device):
                pieces = tf.split(flat, _split_sizes([template[i] for i in bucket]))
                for i, piece in zip(bucket, pieces):
                    results[member][i] = tf.reshape(piece, tf.shape(template[i]))
    return results


def reduce_scatter(
    group: CollectiveGroup,
    buffers: Sequence[tf.Tensor],
    reduction: str,
    chain: int = 0,
    wire_fp16_scale: float | None = None,
) -> list[tf.Tensor]:
    """`group.reduce_scatter` of flat buffers, optionally on the float16 wire
    (`communication.fp16`, as `fused_all_reduce`): each member gets its reduced chunk."""
    dtype = buffers[0].dtype
    compress = wire_fp16_scale is not None and dtype == tf.float32 and group.size > 1
    if compress:
        buffers = [_to_fp16_wire(flat, wire_fp16_scale) for flat in buffers]
    chunks = group.reduce_scatter(list(buffers), reduction, chain=chain)
    if compress:
        chunks = [_from_fp16_wire(chunk, wire_fp16_scale, dtype) for chunk in chunks]
    return chunks


def all_gather_slices(
    group: CollectiveGroup, per_member: Sequence[tf.IndexedSlices], reduction: str
) -> list[tf.IndexedSlices]:
    """Reduces sparse (IndexedSlices) gradients as one device would hold them.

    Rows looked up per sample (token ids): the result holds every member's (index, row)
    pairs, as one device's gradient of the whole batch holds every sample's, without
    moving a dense [vocabulary, dim] tensor. Rows looked up at indices that do not
    depend on the batch (ViT's position embedding at `arange(num_positions)`): one
    device holds each of those rows once, summed over the batch, so the members' rows
    are all-reduced. The two differ for an optimizer that is not linear in the rows:
    Keras's Adam squares each row before repeated indices are summed, so gathered
    copies of a summed row gave it a different second moment than one device's
    (tests/test_comm_options.py: 5.2e-3 after two steps). "mean" divides the rows by the
    group size.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum'. Received: {reduction!r}")
    if group.size == 1:
        return list(per_member)
    if batch_independent(per_member[0].indices):
        values = group.all_reduce([g.values for g in per_member], reduction)
        return [tf.IndexedSlices(v, g.indices, g.dense_shape) for v, g in zip(values, per_member)]
    row_shape = per_member[0].values.shape[1:]
    flat_values = []
    for device, g in zip(group.local_devices, per_member):
        with tf.device(device):
            flat_values.append(tf.reshape(g.values, [-1]))
    row_size = int(np.prod(row_shape)) if row_shape.is_fully_defined() else 1
    values = group.all_gather(flat_values, length_unit=row_size)
    indices = group.all_gather([g.indices for g in per_member])
    results = []
    for device, v, i, g in zip(group.local_devices, values, indices, per_member):
        with tf.device(device):
            rows = tf.reshape(v, [-1, *row_shape])
            if reduction == "mean":
                rows = rows / tf.cast(group.size, rows.dtype)
            results.append(tf.IndexedSlices(rows, i, g.dense_shape))
    return results


def _to_fp16_wire(flat, scale: float):
    with tf.device(flat.device):
        return tf.cast(flat * scale, tf.float16)


def _from_fp16_wire(flat, scale: float, dtype):
    with tf.device(flat.device):
        return tf.cast(flat, dtype) * (1.0 / scale)


def _split_sizes(tensors):
    """Element counts for `tf.split`: Python ints when static, else a tensor."""
    static = [t.shape.num_elements() for t in tensors]
    if all(n is not None for n in static):
        return static
    return tf.stack([tf.size(t, out_type=tf.int64) for t in tensors])


def batch_independent(tensor) -> bool:
    """Whether a traced tensor is computed from constants only: no function argument (the
    batch), no variable, no random op reaches it. Captured eager constants count as
    constants (a layer's `arange` made at build time). False outside a traced function.

    The walk goes through function calls: an output of a call (an XLA-compiled stage's
    backward, a compiled lane) is followed to the function graph's output, and that
    graph's inputs back to the call's. Gradients that leave a compiled function are such
    outputs, and their indices are as constant as they were inside it."""
    if tf.executing_eagerly() or not hasattr(tensor, "op"):
        return False
    seen, stack = set(), [(tensor, ())]
    while stack:
        t, calls = stack.pop()
        key = (id(t), tuple(id(call) for call in calls))
        if key in seen:
            continue
        seen.add(key)
        if t.dtype == tf.resource or t.dtype == tf.variant:
            return False
        op = t.op
        if op.type == "Placeholder":
            source = _placeholder_source(t, calls)
            if source is None:  # an argument of the function
                return False
            if not hasattr(source[0], "op"):
                continue  # an eager constant
            stack.append(source)
            continue
        inner = _call_output(t, calls)
        if inner is not None:
            stack.append(inner)
            continue
        stateful = op.type.startswith(("Random", "Stateless", "ReadVariable"))
        if op.type != "Const" and (stateful or not op.inputs):
            return False
        stack.extend((i, calls) for i in op.inputs)
    return True


def constant_value(tensor):
    """The value of a traced tensor computed from constants only (`batch_independent`),
    evaluated while tracing, or None (not provably constant, or not evaluable here).

    Two micro-batches' lookups at such indices hold the same rows, so their gradients
    can be summed row by row (pipeline/executor.py's `accumulate`); a tensor made from
    the value (`tf.constant`) stays provably constant where the original's graph (a
    loop's body) is out of reach.
    """
    if not batch_independent(tensor):
        return None
    try:
        return _evaluate(tensor, ())
    except (tf.errors.OpError, ValueError, TypeError, KeyError):  # e.g. a loop inside
        return None


def _evaluate(tensor, calls: tuple):
    """Runs the constant subgraph that computes `tensor` in a graph of its own. Where it
    crosses a function boundary (a captured tensor, a function's argument, a call's
    output) the tensor beyond is evaluated first, in its own graph, and enters as a
    constant."""
    if tensor.op.type == "Placeholder":
        source, outer_calls = _placeholder_source(tensor, calls)
        return source.numpy() if not hasattr(source, "op") else _evaluate(source, outer_calls)
    inner = _call_output(tensor, calls)
    if inner is not None:
        return _evaluate(*inner)
    nodes: dict = {}
    boundaries: dict = {}  # id of a tensor beyond a boundary -> its constant's name
    stack = [tensor.op]
    while stack:
        op = stack.pop()
        if op.name in nodes:
            continue
        node = tf.compat.v1.NodeDef()
        node.CopyFrom(op.node_def)
        node.ClearField("device")
        if "_class" in node.attr:  # colocation with ops left out of this graph
            del node.attr["_class"]
        del node.input[:]  # control inputs dropped; data inputs in `op.inputs` order
        for t in op.inputs:
            if id(t) in boundaries:
                node.input.append(boundaries[id(t)])
            elif t.op.type == "Placeholder" or _call_output(t, calls) is not None:
                name = f"epl.boundary.{len(nodes)}"  # not a name TF gives (a clash: None)
                constant = tf.compat.v1.NodeDef(name=name, op="Const")
                constant.attr["dtype"].type = t.dtype.as_datatype_enum
                constant.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(_evaluate(t, calls)))
                nodes[name] = constant
                boundaries[id(t)] = name
                node.input.append(name)
            else:
                node.input.append(t.name[:-2] if t.name.endswith(":0") else t.name)
                stack.append(t.op)
        nodes[op.name] = node
    graph_def = tf.compat.v1.GraphDef()
    graph_def.node.extend(nodes.values())
    with tf.Graph().as_default() as graph:
        tf.graph_util.import_graph_def(graph_def, name="")
        with tf.compat.v1.Session(graph=graph) as session:
            return session.run(tensor.name)


_CALLS = ("PartitionedCall", "StatefulPartitionedCall")


def _called_graph(op):
    """The function graph a call op runs, or None (not a call, or its graph is not kept:
    a function loaded from a definition)."""
    if op.type not in _CALLS:
        return None
    name = op.get_attr("f").name
    graph = op.graph
    while graph is not None:  # a function called in a loop's body may be the outer's
        lookup = getattr(graph, "_get_function", None)  # no public lookup of a graph's
        function = lookup(name) if lookup is not None else None  # functions
        if function is not None:
            return getattr(function, "graph", None)
        graph = getattr(graph, "outer_graph", None)
    return None


def _call_output(tensor, calls: tuple):
    """(The function graph's output that `tensor`, an output of a call op, is; the
    calls it is inside), or None when `tensor` is not the output of a known call."""
    graph = _called_graph(tensor.op)
    if graph is None or len(graph.outputs) != len(tensor.op.outputs):
        return None
    return graph.outputs[tensor.value_index], (*calls, tensor.op)


def _placeholder_source(placeholder, calls: tuple):
    """(What a function graph's placeholder stands for, the calls that is inside): the
    input of the call being walked through, else the captured outer tensor (an eager
    tensor has no `op`). None: an argument of a function not entered through its call
    (the traced step's own inputs)."""
    if calls:
        call = calls[-1]
        inputs = _called_graph(call).inputs
        for position, internal in enumerate(inputs):
            if internal is placeholder and len(inputs) == len(call.inputs):
                return call.inputs[position], calls[:-1]
    external = _captured_from(placeholder)
    if external is None:
        return None
    if not hasattr(external, "op"):
        return external, ()
    # The captured tensor's graph is the function graph of one of the calls (a loop's
    # body captures from the function it is in) or one outside them all.
    while calls and _called_graph(calls[-1]) is not external.graph:
        calls = calls[:-1]
    return external, calls


def _captured_from(placeholder):
    """The outer tensor a function graph's placeholder captures, or None."""
    for external, internal in getattr(placeholder.graph, "captures", ()):
        if internal is placeholder:
            return external
    return None
