"""Megatron's tensor-parallel operators on `LaneCollectives`, lane by lane on logical CPUs.

Each lane is traced on its own, in turn, inside one `tf.function` (all members must run
for a collective to complete), as the engine traces a split replica's lanes. The devices
are listed in reverse order, so a lane's rank is TensorFlow's, not its position.

Gradients follow Megatron: a value replicated over the members stands for one tensor.
Where an operator's input is replicated, each lane's loss is its share of one loss and
the lanes' gradients of the input are the one gradient; where its output is replicated,
the lanes compute the same loss (the same weights `w` on every lane).
"""

import numpy as np
import pytest
import tensorflow as tf

from epl_trainer.core import comm

TOLERANCE = dict(rtol=1e-6, atol=1e-6)


def _lane_maker(n, limit=100):
    """A function returning one fresh `LaneCollectives` per lane of a group of n CPUs,
    listed in reverse order, all from one key range. Steps build their lanes while they
    trace, as the engine does: a function traced again (its first trace creates the
    ordering-token variables) must start from the first key again."""
    devices = tuple(f"/device:CPU:{i}" for i in reversed(range(n)))
    first = comm.reserve_local_instance_keys(limit)

    def make():
        return [
            comm.LaneCollectives(comm.CollectiveGroup(devices, (d,)), first, limit=limit)
            for d in devices
        ]

    return make


def _lanes(n):
    return _lane_maker(n)()


def _by_rank(lanes, per_lane):
    """`per_lane` (one entry per lane) reordered by the lanes' ranks."""
    return [per_lane[j] for j in sorted(range(len(lanes)), key=lambda j: lanes[j].rank)]


def _chunk(array, axis, index, count):
    return np.split(array, count, axis=axis)[index]


def _run(make_lanes, operator, xs, ws, dtype=tf.float32):
    """Lane j: out_j = operator(lane_j, x_j), loss_j = sum(w_j * out_j); returns every
    lane's out_j and d loss_j / d x_j (lanes traced in turn, forwards then gradients),
    and the lanes of the last trace."""
    traced = []

    @tf.function
    def step():
        lanes = make_lanes()
        traced.append(lanes)
        tapes = []
        for lane, x, w in zip(lanes, xs, ws):
            with tf.device(lane.device):
                x = tf.cast(x, dtype)
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    out = operator(lane, x)
                    loss = tf.reduce_sum(tf.cast(w, dtype) * out)
                tapes.append((tape, loss, x, out))
        return [(out, tape.gradient(loss, x)) for tape, loss, x, out in tapes]

    return step(), traced[-1]


# ---- each operator against the math ---------------------------------------------------


def _copy_case(lanes, rng, axis):
    """x replicated; w_j per lane: out_j = x, grad_j = sum_j w_j (f's all-reduce)."""
    x = rng.normal(size=(3, 4))
    ws = [rng.normal(size=(3, 4)) for _ in lanes]
    xs = [x] * len(lanes)
    return xs, ws, [x] * len(lanes), [np.sum(ws, axis=0)] * len(lanes)


def _reduce_case(lanes, rng, axis):
    """x_j per lane; w shared: out = sum_j x_j, grad_j = w (g's identity)."""
    xs = [rng.normal(size=(3, 4)) for _ in lanes]
    w = rng.normal(size=(3, 4))
    return xs, [w] * len(lanes), [np.sum(xs, axis=0)] * len(lanes), [w] * len(lanes)


def _scatter_case(lanes, rng, axis):
    """x replicated; w_j per lane: out_j = chunk rank_j of x, grad_j = the lanes' w
    concatenated by rank (the whole gradient of x)."""
    n = len(lanes)
    shape = [2 * n, 3 * n, n]
    x = rng.normal(size=shape)
    chunk_shape = list(shape)
    chunk_shape[axis] //= n
    ws = [rng.normal(size=chunk_shape) for _ in lanes]
    outs = [_chunk(x, axis, lane.rank, n) for lane in lanes]
    whole = np.concatenate(_by_rank(lanes, ws), axis=axis)
    return [x] * n, ws, outs, [whole] * n


def _gather_case(lanes, rng, axis):
    """x_j per lane; w shared: out = the x_j concatenated by rank, grad_j = chunk rank_j of w."""
    n = len(lanes)
    xs = [rng.normal(size=(2, 3, 5)) for _ in lanes]
    gathered = np.concatenate(_by_rank(lanes, xs), axis=axis)
    w = rng.normal(size=gathered.shape)
    return xs, [w] * n, [gathered] * n, [_chunk(w, axis, lane.rank, n) for lane in lanes]


CASES = {
    "copy_to_group": (_copy_case, lambda lane, x, axis: lane.copy_to_group(x)),
    "reduce_from_group": (_reduce_case, lambda lane, x, axis: lane.reduce_from_group(x)),
    "scatter_to_group": (_scatter_case, lambda lane, x, axis: lane.scatter_to_group(x, axis)),
    "gather_from_group": (_gather_case, lambda lane, x, axis: lane.gather_from_group(x, axis)),
}


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize(
    "name, axis",
    [
        ("copy_to_group", None),
        ("reduce_from_group", None),
        ("scatter_to_group", 0),
        ("scatter_to_group", 1),
        ("scatter_to_group", -1),
        ("gather_from_group", 0),
        ("gather_from_group", 1),
        ("gather_from_group", -1),
    ],
)
def test_operator_forward_and_gradient(name, axis, n):
    build, operator = CASES[name]
    make_lanes = _lane_maker(n)
    xs, ws, outs, grads = build(make_lanes(), np.random.default_rng(n), axis)
    xs, ws = [a.astype("float32") for a in xs], [a.astype("float32") for a in ws]
    results, lanes = _run(make_lanes, lambda lane, x: operator(lane, x, axis), xs, ws)
    for (out, grad), expected_out, expected_grad in zip(results, outs, grads):
        np.testing.assert_allclose(out.numpy(), expected_out, **TOLERANCE)
        np.testing.assert_allclose(grad.numpy(), expected_grad, **TOLERANCE)
    # One collective each, forward (reduce, gather) or backward (copy, scatter): one key.
    assert [lane._issued for lane in lanes] == [1] * n


@pytest.mark.parametrize("name, axis", [(name, 1) for name in CASES])
def test_bfloat16_forward_and_gradient_are_exact_on_integers(name, axis):
    """Integer values are exact in bfloat16 (sums of a few small integers too), so bf16
    results must equal the math bit for bit; outputs and gradients stay bfloat16."""
    build, operator = CASES[name]
    make_lanes = _lane_maker(4)
    rng = np.random.default_rng(7)

    class IntegerRng:  # the cases' normal draws, as small integers
        def normal(self, size):
            return rng.integers(-8, 8, size=size).astype("float32")

    xs, ws, outs, grads = build(make_lanes(), IntegerRng(), axis)
    operate = lambda lane, x: operator(lane, x, axis)  # noqa: E731
    results, _ = _run(make_lanes, operate, xs, ws, tf.bfloat16)
    for (out, grad), expected_out, expected_grad in zip(results, outs, grads):
        assert out.dtype == grad.dtype == tf.bfloat16
        np.testing.assert_array_equal(tf.cast(out, tf.float32).numpy(), expected_out)
        np.testing.assert_array_equal(tf.cast(grad, tf.float32).numpy(), expected_grad)


def test_integer_inputs_run_the_forward_alone():
    make_lanes = _lane_maker(2)
    values = [np.arange(8, dtype="int32").reshape(2, 4) + 100 * j for j in range(2)]
    traced = []

    @tf.function
    def step():
        lanes = make_lanes()
        traced.append(lanes)
        results = []
        for lane, value in zip(lanes, values):
            with tf.device(lane.device):
                x = tf.constant(value)
                results.append(
                    (
                        lane.copy_to_group(x),
                        lane.reduce_from_group(x),
                        lane.scatter_to_group(x, 1),
                        lane.gather_from_group(x, 1),
                    )
                )
        return results

    results = step()
    lanes = traced[-1]
    gathered = np.concatenate(_by_rank(lanes, values), axis=1)
    for lane, value, (copied, reduced, scattered, gathered_out) in zip(lanes, values, results):
        assert copied.dtype == reduced.dtype == scattered.dtype == gathered_out.dtype == tf.int32
        np.testing.assert_array_equal(copied.numpy(), value)
        np.testing.assert_array_equal(reduced.numpy(), values[0] + values[1])
        np.testing.assert_array_equal(scattered.numpy(), _chunk(value, 1, lane.rank, 2))
        np.testing.assert_array_equal(gathered_out.numpy(), gathered)
    # reduce and gather only: the integer forward issues no backward collective
    assert [lane._issued for lane in lanes] == [2, 2]


def test_scatter_then_gather_round_trips_with_a_length_known_at_run_time():
    """Lane r: y = gather(scatter(x)) = x, replicated; one loss sum(y^2)/2 whose gradient
    is x: gather's backward keeps the own slice, scatter's gathers the slices back."""
    make_lanes = _lane_maker(2)
    value = np.arange(12, dtype="float32").reshape(4, 3)

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32)])
    def step(x_in):
        tapes = []
        for lane in make_lanes():
            with tf.device(lane.device):
                x = tf.identity(x_in)
                with tf.GradientTape() as tape:
                    tape.watch(x)
                    y = lane.gather_from_group(lane.scatter_to_group(x, 0), 0)
                    loss = tf.reduce_sum(y * y) / 2
                tapes.append((tape, loss, x, y))
        return [(y, tape.gradient(loss, x)) for tape, loss, x, y in tapes]

    for y, grad in step(tf.constant(value)):
        np.testing.assert_array_equal(y.numpy(), value)
        np.testing.assert_array_equal(grad.numpy(), value)


def test_group_of_one_returns_the_input_and_issues_no_collective():
    (lane,) = _lanes(1)
    x = tf.constant(np.arange(6, dtype="float32").reshape(2, 3))
    assert lane.copy_to_group(x) is x
    assert lane.reduce_from_group(x) is x
    assert lane.scatter_to_group(x, 1) is x
    assert lane.gather_from_group(x, -1) is x
    assert lane._issued == 0


def test_bad_inputs_are_named():
    lane = _lanes(2)[0]
    with pytest.raises(
        ValueError,
        match=r"axis 1 to divide by the group size. Received: shape \(3, 5\), axis=1, "
        r"group_size=2",
    ):
        lane.scatter_to_group(tf.zeros([3, 5]), 1)
    with pytest.raises(ValueError, match=r"Received: shape \(4, 5\), axis=1, group_size=2"):
        lane.scatter_to_group(tf.zeros([4, 5]), -1)  # a negative axis is named as its dim
    with pytest.raises(
        ValueError,
        match=r"scatter_to_group: axis 2 is out of range for a tensor of rank 2. "
        r"Received: shape \(4, 4\), axis=2",
    ):
        lane.scatter_to_group(tf.zeros([4, 4]), 2)
    with pytest.raises(ValueError, match=r"gather_from_group: axis -3 is out of range"):
        lane.gather_from_group(tf.zeros([4, 4]), -3)
    with pytest.raises(ValueError, match=r"gather_from_group needs a tensor of known rank"):
        tf.function(lambda x: lane.gather_from_group(x, 0)).get_concrete_function(
            tf.TensorSpec(None, tf.float32)
        )
    assert lane._issued == 0  # a refused call takes no key

    # A length known only at run time is checked then.
    scatter = tf.function(
        lambda x: lane.scatter_to_group(x, 0),
        input_signature=[tf.TensorSpec([None, 2], tf.float32)],
    )
    np.testing.assert_array_equal(scatter(tf.reshape(tf.range(8.0), [4, 2])).numpy().shape, [2, 2])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"axis 0 to divide by the group size"):
        scatter(tf.zeros([3, 2]))


# ---- a Megatron MLP pair ----------------------------------------------------------------

ROWS, HIDDEN, INTERMEDIATE = 4, 6, 8


def _mlp_arrays():
    rng = np.random.default_rng(47)
    return {
        "x": rng.normal(size=(ROWS, HIDDEN)).astype("float32"),
        "a": (rng.normal(size=(HIDDEN, INTERMEDIATE)) / np.sqrt(HIDDEN)).astype("float32"),
        "b": (rng.normal(size=(INTERMEDIATE, HIDDEN)) / np.sqrt(INTERMEDIATE)).astype("float32"),
        "w": rng.normal(size=(ROWS, HIDDEN)).astype("float32"),
    }


def _mlp_step(make_lanes, arrays, traced):
    """Lane r holds x, A's column chunk r and B's row chunk r; it computes
    y = reduce_from_group(gelu(copy_to_group(x) @ A_r) @ B_r) and the gradients of
    sum(w * y) (one loss, computed alike on every lane). Each trace's lanes go to `traced`."""

    @tf.function
    def step():
        lanes = make_lanes()
        traced.append(lanes)
        n = len(lanes)
        tapes = []
        for lane in lanes:
            with tf.device(lane.device):
                x = tf.constant(arrays["x"])
                a = tf.constant(_chunk(arrays["a"], 1, lane.rank, n))
                b = tf.constant(_chunk(arrays["b"], 0, lane.rank, n))
                with tf.GradientTape() as tape:
                    tape.watch([x, a, b])
                    hidden = tf.nn.gelu(tf.matmul(lane.copy_to_group(x), a))
                    y = lane.reduce_from_group(tf.matmul(hidden, b))
                    loss = tf.reduce_sum(arrays["w"] * y)
                tapes.append((tape, loss, [x, a, b], y))
        return [(y, tape.gradient(loss, sources)) for tape, loss, sources, y in tapes]

    return step


@pytest.mark.parametrize("n", [2, 4])
def test_megatron_mlp_pair_equals_one_device(n):
    arrays = _mlp_arrays()
    x, a, b = (tf.constant(arrays[k]) for k in "xab")
    with tf.GradientTape() as tape:
        tape.watch([x, a, b])
        y = tf.matmul(tf.nn.gelu(tf.matmul(x, a)), b)
        loss = tf.reduce_sum(arrays["w"] * y)
    dx, da, db = (g.numpy() for g in tape.gradient(loss, [x, a, b]))

    traced = []
    results = _mlp_step(_lane_maker(n), arrays, traced)()
    for lane, (lane_y, (lane_dx, lane_da, lane_db)) in zip(traced[-1], results):
        np.testing.assert_allclose(lane_y.numpy(), y.numpy(), **TOLERANCE)
        np.testing.assert_allclose(lane_dx.numpy(), dx, **TOLERANCE)
        np.testing.assert_allclose(lane_da.numpy(), _chunk(da, 1, lane.rank, n), **TOLERANCE)
        np.testing.assert_allclose(lane_db.numpy(), _chunk(db, 0, lane.rank, n), **TOLERANCE)


def _ancestors(tensors):
    """Every op the tensors' values are computed from (data inputs: control edges order
    the collectives of a device, they do not feed values)."""
    seen, stack = set(), [t.op for t in tensors]
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
    return seen


@pytest.mark.parametrize("n", [2, 4])
def test_megatron_mlp_pair_traces_one_all_reduce_forward_and_one_backward(n):
    """In the traced forward+backward of all lanes, each lane's device holds two
    CollectiveReduceV2: the forward one (an ancestor of y: g's sum of [rows, hidden]) with
    the group's first key, and the backward one (an ancestor of dx, not of y: f's sum of
    dx) with the next key. The weights' gradients need none."""
    traced = []
    graph = _mlp_step(_lane_maker(n), _mlp_arrays(), traced).get_concrete_function().graph
    lanes = traced[-1]
    outputs = graph.structured_outputs
    forward = _ancestors([y for y, _ in outputs])
    input_grads = _ancestors([dx for _, (dx, _, _) in outputs])
    weight_grads = _ancestors([g for _, (_, da, db) in outputs for g in (da, db)])
    reduces = [op for op in graph.get_operations() if op.type == "CollectiveReduceV2"]
    first = lanes[0]._first_key
    assert len(reduces) == 2 * n
    for lane in lanes:
        mine = [op for op in reduces if op.device == lane.device]
        forward_ops = [op for op in mine if op in forward]
        backward_ops = [op for op in mine if op not in forward]
        assert len(forward_ops) == len(backward_ops) == 1
        for op, key in ((forward_ops[0], first), (backward_ops[0], first + 1)):
            assert op.inputs[0].shape == (ROWS, HIDDEN)
            assert tf.get_static_value(op.inputs[3]) == key  # instance_key
            assert tf.get_static_value(op.inputs[2]) == lane.group.key  # group_key
        assert backward_ops[0] in input_grads and backward_ops[0] not in weight_grads
        assert lane._issued == 2
    gathers = [op for op in graph.get_operations() if "Collective" in op.type]
    assert len(gathers) == len(reduces)  # no other collective


def test_consumers_of_one_copy_share_its_backward_all_reduce():
    """A gated MLP, y = g((gelu(f(x) @ G_r) * (f(x) @ U_r)) @ B_r) with f(x) computed once:
    the tape sums both consumers' gradients before f's, so each device still holds one
    all-reduce forward and one backward, and dx equals one device's."""
    n = 2
    rng = np.random.default_rng(3)
    x = rng.normal(size=(ROWS, HIDDEN)).astype("float32")
    gate, up = (
        (rng.normal(size=(HIDDEN, INTERMEDIATE)) / np.sqrt(HIDDEN)).astype("float32")
        for _ in range(2)
    )
    down = (rng.normal(size=(INTERMEDIATE, HIDDEN)) / np.sqrt(INTERMEDIATE)).astype("float32")

    def mlp(x, gate, up, down, copy=tf.identity, reduce=tf.identity):
        copied = copy(x)
        return reduce(tf.matmul(tf.nn.gelu(copied @ gate) * (copied @ up), down))

    x_whole = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x_whole)
        loss = tf.reduce_sum(mlp(x_whole, gate, up, down))
    dx = tape.gradient(loss, x_whole).numpy()

    make_lanes = _lane_maker(n)

    @tf.function
    def step():
        grads = []
        for lane in make_lanes():
            with tf.device(lane.device):
                lane_x = tf.constant(x)
                with tf.GradientTape() as tape:
                    tape.watch(lane_x)
                    y = mlp(
                        lane_x,
                        _chunk(gate, 1, lane.rank, n),
                        _chunk(up, 1, lane.rank, n),
                        _chunk(down, 0, lane.rank, n),
                        lane.copy_to_group,
                        lane.reduce_from_group,
                    )
                    loss = tf.reduce_sum(y)
                grads.append((tape, loss, lane_x))
        return [tape.gradient(loss, lane_x) for tape, loss, lane_x in grads]

    for lane_dx in step():
        np.testing.assert_allclose(lane_dx.numpy(), dx, **TOLERANCE)
    graph = step.get_concrete_function().graph
    devices = [op.device for op in graph.get_operations() if op.type == "CollectiveReduceV2"]
    assert sorted(devices) == sorted(2 * [f"/device:CPU:{i}" for i in range(n)])
