"""Collectives on logical CPU devices: results per member against numpy, and TF's ranks."""

import itertools
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from epl_trainer.core import comm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(8)]


def _scrambled(n: int, seed: int = 0) -> tuple[str, ...]:
    """The first n devices listed in a shuffled order that is never the sorted one."""
    rng = np.random.default_rng(seed)
    order = list(range(n))
    while order == sorted(order):
        order = list(rng.permutation(n))
    return tuple(DEVICES[i] for i in order)


def _group(members) -> comm.CollectiveGroup:
    return comm.CollectiveGroup(devices=tuple(members), local_devices=tuple(members))


def _place(group, arrays):
    values = []
    for device, array in zip(group.local_devices, arrays):
        with tf.device(device):
            values.append(tf.constant(array))
    return values


# ---- all-reduce ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_reduce_matches_numpy(n, reduction):
    group = _group(_scrambled(n))
    arrays = np.random.default_rng(n).normal(size=(n, 3, 5)).astype("float32")

    @tf.function
    def step():
        return group.all_reduce(_place(group, arrays), reduction)

    expected = arrays.mean(0) if reduction == "mean" else arrays.sum(0)
    for result in step():
        np.testing.assert_allclose(result.numpy(), expected, rtol=1e-6, atol=1e-6)


# ---- rank order ---------------------------------------------------------------------------


def test_rank_rule_sorts_device_index_numerically_and_task_names_as_strings():
    cpus = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in (10, 2, 1, 0)]
    assert comm.collective_rank_order(cpus) == [cpus[3], cpus[2], cpus[1], cpus[0]]
    tasks = [f"/job:worker/replica:0/task:{t}/device:CPU:0" for t in (2, 10, 1, 0)]
    assert comm.collective_rank_order(tasks) == [tasks[3], tasks[2], tasks[1], tasks[0]]
    two_per_task = [
        f"/job:worker/replica:0/task:{t}/device:GPU:{d}" for t in (1, 0) for d in (1, 0)
    ]
    assert comm.collective_rank_order(two_per_task) == [
        two_per_task[3],
        two_per_task[2],
        two_per_task[1],
        two_per_task[0],
    ]


@pytest.mark.parametrize("n", [4, 8])
def test_rank_of_is_the_rank_tf_uses(n):
    """Each member contributes its position in the (scrambled) member list; the gather
    returns them in TF's rank order, which must be what rank_of says."""
    members = _scrambled(n, seed=n)
    group = _group(members)

    @tf.function
    def step():
        positions = _place(group, [np.array([i], "int32") for i in range(n)])
        return group.all_gather(positions)

    for gathered in step():
        positions = gathered.numpy().tolist()
        assert [members[p] for p in positions] == comm.collective_rank_order(members)
        assert [group.rank_of(members[p]) for p in positions] == list(range(n))
    # measure_ranks observes the same ranks as the rule.
    assert group.measure_ranks() == [comm.collective_rank_order(members).index(d) for d in members]


@pytest.mark.slow
def test_rank_of_on_twelve_devices_orders_cpu_10_after_cpu_9():
    """A fresh process with 12 logical devices (CPU:10 and CPU:11 sort before CPU:2 as
    strings but not in TF's rank order)."""
    script = textwrap.dedent(
        """
        import numpy as np
        from epl_trainer.runtime.cluster import configure_tensorflow
        configure_tensorflow(12)
        import tensorflow as tf
        from epl_trainer.core import comm
        names = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(12)]
        members = tuple(names[i] for i in np.random.default_rng(1).permutation(12))
        group = comm.CollectiveGroup(members, members)

        @tf.function
        def step():
            values = []
            for i, device in enumerate(members):
                with tf.device(device):
                    values.append(tf.constant([i]))
            return group.all_gather(values)[0]

        order = [members[p] for p in step().numpy()]
        assert order == names, order
        assert [group.rank_of(d) for d in order] == list(range(12))
        print("RANKS_OK")
        """
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": ROOT}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert "RANKS_OK" in result.stdout, result.stdout + result.stderr


def test_rank_of_rejects_a_non_member():
    group = _group(DEVICES[:2])
    with pytest.raises(ValueError, match="is not a member of the group"):
        group.rank_of(DEVICES[5])


# ---- reduce-scatter and all-gather --------------------------------------------------------


@pytest.mark.parametrize("path", ["in_process", "collective"])
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reduce_scatter_gives_each_member_the_chunk_of_its_rank(n, reduction, path):
    """In one process on CPU the members sum each other's blocks one at a time (no
    [size, B] all-to-all buffer); with an instance key (how members on several workers
    meet) the collective all-to-all runs."""
    members = _scrambled(n, seed=10 + n)
    group = _group(members)
    block = 3
    arrays = np.random.default_rng(n).normal(size=(n, n * block)).astype("float32")
    key = None if path == "in_process" else comm.next_instance_key(group.key)

    @tf.function
    def step():
        return group.reduce_scatter(_place(group, arrays), reduction, instance_key=key)

    ops = {op.type for op in step.get_concrete_function().graph.get_operations()}
    assert ("CollectiveAllToAllV2" in ops) == (path == "collective")

    reduced = arrays.mean(0) if reduction == "mean" else arrays.sum(0)
    for device, chunk in zip(members, step()):
        rank = group.rank_of(device)
        assert chunk.shape == (block,)
        np.testing.assert_allclose(
            chunk.numpy(), reduced[rank * block : (rank + 1) * block], rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize("n", [2, 4, 8])
def test_all_gather_concatenates_members_by_rank(n):
    members = _scrambled(n, seed=20 + n)
    group = _group(members)
    arrays = np.random.default_rng(n).normal(size=(n, 5)).astype("float32")

    @tf.function
    def step():
        return group.all_gather(_place(group, arrays))

    by_rank = sorted(range(n), key=lambda i: group.rank_of(members[i]))
    expected = np.concatenate([arrays[i] for i in by_rank])
    for gathered in step():
        np.testing.assert_array_equal(gathered.numpy(), expected)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_reduce_scatter_then_all_gather_round_trips_other_dtypes(dtype):
    """All-gather has no bfloat16 kernel; it travels bit-cast as float16."""
    group = _group(_scrambled(4, seed=3))
    arrays = np.arange(4 * 8, dtype="float32").reshape(4, 8) / 8

    @tf.function
    def step():
        values = [tf.cast(v, dtype) for v in _place(group, arrays)]
        return group.all_gather(group.reduce_scatter(values, "sum"))

    for gathered in step():
        assert gathered.dtype == tf.as_dtype(dtype)
        np.testing.assert_allclose(tf.cast(gathered, tf.float32).numpy(), arrays.sum(0), rtol=1e-2)


def test_group_of_one_returns_the_inputs():
    group = _group(DEVICES[:1])
    value = tf.range(6, dtype=tf.float32)
    (scattered,) = group.reduce_scatter([value], "mean")
    (gathered,) = group.all_gather([value])
    np.testing.assert_array_equal(scattered.numpy(), value.numpy())
    np.testing.assert_array_equal(gathered.numpy(), value.numpy())
    assert group.rank_of(DEVICES[0]) == 0
    assert group.measure_ranks() == [0]


def test_reduce_scatter_and_all_gather_check_their_inputs():
    group = _group(DEVICES[:2])
    with pytest.raises(ValueError, match="divisible by the group size"):
        group.reduce_scatter([tf.zeros([3]), tf.zeros([3])])
    with pytest.raises(ValueError, match="one value per local member"):
        group.all_gather([tf.zeros([2])])
    with pytest.raises(ValueError, match="flat"):
        group.all_gather([tf.zeros([2, 2]), tf.zeros([2, 2])])
    with pytest.raises(ValueError, match="same length"):
        group.all_gather([tf.zeros([2]), tf.zeros([4])])
    with pytest.raises(ValueError, match="reduction must be"):
        group.reduce_scatter([tf.zeros([2]), tf.zeros([2])], "max")


MULTIWORKER_SCRIPT = """
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np
import epl_trainer as epl
env = epl.init({})
import tensorflow as tf
from epl_trainer.core import comm
cluster = env.cluster
# Every worker lists the members in the same scrambled (reversed) order.
devices = tuple(d for w in reversed(cluster.devices_by_worker) for d in reversed(w))
group = comm.CollectiveGroup(devices, cluster.local_devices)
n = group.size
arrays = np.arange(n * n * 3, dtype="float32").reshape(n, n * 3) ** 1.5

@tf.function
def step():
    values = []
    for d in group.local_devices:
        with tf.device(d):
            values.append(tf.constant(arrays[devices.index(d)]))
    chunks = group.reduce_scatter(values, "mean")
    return chunks, group.all_gather(chunks), group.all_gather(values)

chunks, gathered, raw = step()
mean = arrays.mean(0)
by_rank = sorted(range(n), key=lambda i: group.rank_of(devices[i]))
for d, c, g, r in zip(group.local_devices, chunks, gathered, raw):
    rank = group.rank_of(d)
    np.testing.assert_allclose(c.numpy(), mean[rank * 3 : (rank + 1) * 3], rtol=1e-6)
    np.testing.assert_allclose(g.numpy(), mean, rtol=1e-6)
    np.testing.assert_array_equal(r.numpy(), np.concatenate([arrays[i] for i in by_rank]))
rule = [comm.collective_rank_order(devices).index(d) for d in group.local_devices]
assert group.measure_ranks() == rule
print("WORKER_OK", cluster.worker_index, rule, flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_reduce_scatter_and_all_gather_across_two_workers(tmp_path):
    """2 worker processes x 2 devices on 127.0.0.1: ranks follow task order, then device."""
    script = tmp_path / "collectives.py"
    script.write_text(MULTIWORKER_SCRIPT)
    command = [sys.executable, "-m", "epl_trainer.runtime.launcher", "--num_workers", "2"]
    command += ["--gpu_per_worker", "2", "--log_dir", str(tmp_path / "logs"), str(script)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPL_")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    result = subprocess.run(command, capture_output=True, text=True, timeout=200, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WORKER_OK 0 [0, 1]" in result.stdout  # worker 0's output is streamed


# ---- fusion -------------------------------------------------------------------------------


def test_fused_all_reduce_with_several_buckets_and_mixed_dtypes():
    group = _group(_scrambled(4, seed=7))
    rng = np.random.default_rng(0)
    shapes = [(3, 4), (7,), (2, 2, 2), (5,), (1,), (6, 2)]
    dtypes = ["float32", "float64", "float32", "float16", "float64", "float32"]
    arrays = [[rng.normal(size=s).astype(dt) for s, dt in zip(shapes, dtypes)] for _ in range(4)]
    sizes = [int(np.prod(s)) * np.dtype(dt).itemsize for s, dt in zip(shapes, dtypes)]
    buckets = comm.plan_buckets(sizes, dtypes, max_splits=2)
    assert len(buckets) == 5  # float32: 2, float64: 2, float16: 1
    for bucket in buckets:
        assert len({dtypes[i] for i in bucket}) == 1

    @tf.function
    def step():
        per_member = []
        for device, member_arrays in zip(group.local_devices, arrays):
            with tf.device(device):
                per_member.append([tf.constant(a) for a in member_arrays])
        return comm.fused_all_reduce(group, per_member, buckets, "mean", num_chains=2)

    results = step()
    for member in results:
        for i, result in enumerate(member):
            expected = np.mean([a[i].astype("float64") for a in arrays], axis=0)
            assert result.dtype == tf.as_dtype(dtypes[i]) and result.shape == shapes[i]
            tolerance = 2e-3 if dtypes[i] == "float16" else 1e-6
            np.testing.assert_allclose(result.numpy(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("max_splits", [1, 5, 60])
def test_plan_buckets_counts_contiguity_and_balance(max_splits, record_property):
    rng = np.random.default_rng(42)
    sizes = [int(s) for s in rng.integers(1, 1000, size=100) * 4]
    dtypes = ["float32"] * 70 + ["float16"] * 30
    buckets = comm.plan_buckets(sizes, dtypes, max_splits)
    stats = {}
    for dtype in ("float32", "float16"):
        mine = [b for b in buckets if dtypes[b[0]] == dtype]
        indices = [i for i, d in enumerate(dtypes) if d == dtype]
        assert 1 <= len(mine) <= max_splits
        # Contiguous runs covering every tensor of the dtype exactly once, in order.
        assert [i for b in mine for i in b] == indices
        for b in mine:
            assert b == list(range(b[0], b[-1] + 1)) and all(dtypes[i] == dtype for i in b)
        loads = [sum(sizes[i] for i in b) for b in mine]
        total, largest = sum(loads), max(sizes[i] for i in indices)
        # Each cut closes a run once it holds its share: overshoot < one tensor.
        assert max(loads) <= total / len(mine) + largest
        stats[dtype] = (len(mine), max(loads), min(loads))
    record_property("bucket_stats", stats)
    print(f"max_splits={max_splits}: (buckets, max bytes, min bytes) per dtype {stats}")
    if max_splits == 1:
        assert stats["float32"][0] == stats["float16"][0] == 1
    if max_splits == 5:
        assert stats["float32"][0] == stats["float16"][0] == 5


# ---- lane-by-lane collectives (split layers) and their gradients --------------------------


def _lane_collectives(n):
    devices = tuple(f"/device:CPU:{i}" for i in range(n))
    first = comm.reserve_local_instance_keys(1000)
    return [
        comm.LaneCollectives(comm.CollectiveGroup(devices, (d,)), first, limit=1000)
        for d in devices
    ]


def test_gather_rows_and_its_reduce_scatter_gradient():
    """Lane j: y_j = gather(x)_all-rows * w_j, loss_j = sum(y_j). d loss_total / d x_m =
    sum_j w_j (the rows of x_m appear in every lane's gather)."""
    n, rows = 4, 3
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(rows, 2)).astype("float32") for _ in range(n)]
    ws = [rng.normal(size=(n * rows, 2)).astype("float32") for _ in range(n)]

    @tf.function
    def step():
        lanes = _lane_collectives(n)
        gathered, grads = [], []
        tapes = []
        for lane, x, w in zip(lanes, xs, ws):  # each lane traced on its own, in turn
            with tf.device(lane.device):
                x = tf.constant(x)
                tape = tf.GradientTape()
                with tape:
                    tape.watch(x)
                    g = lane.gather_rows(x)
                    loss = tf.reduce_sum(g * w)
                gathered.append(g)
                tapes.append((tape, loss, x))
        for tape, loss, x in tapes:
            grads.append(tape.gradient(loss, x))
        return gathered, grads

    gathered, grads = step()
    full = np.concatenate(xs)
    for g in gathered:
        np.testing.assert_allclose(g.numpy(), full)
    total_w = np.sum(ws, axis=0)
    for m, g in enumerate(grads):
        np.testing.assert_allclose(g.numpy(), total_w[m * rows : (m + 1) * rows], rtol=1e-6)


def test_all_to_all_and_its_gradient_is_the_reverse_exchange():
    n = 4
    rng = np.random.default_rng(1)
    xs = [rng.normal(size=(n * 2, 3)).astype("float32") for _ in range(n)]
    ws = [rng.normal(size=(n * 2, 3)).astype("float32") for _ in range(n)]

    @tf.function
    def step():
        lanes = _lane_collectives(n)
        outs, tapes = [], []
        for lane, x, w in zip(lanes, xs, ws):
            with tf.device(lane.device):
                x = tf.constant(x)
                tape = tf.GradientTape()
                with tape:
                    tape.watch(x)
                    out = lane.all_to_all(x)
                    loss = tf.reduce_sum(out * w)
                outs.append(out)
                tapes.append((tape, loss, x))
        return outs, [tape.gradient(loss, x) for tape, loss, x in tapes]

    outs, grads = step()
    for r, out in enumerate(outs):  # block m of lane r's output = block r of lane m's input
        for m in range(n):
            np.testing.assert_allclose(out.numpy()[2 * m : 2 * m + 2], xs[m][2 * r : 2 * r + 2])
    for m, g in enumerate(grads):  # d/dx_m[block r] = w_r[block m]
        for r in range(n):
            np.testing.assert_allclose(g.numpy()[2 * r : 2 * r + 2], ws[r][2 * m : 2 * m + 2])


def test_lane_reduce_max_and_sum():
    n = 4

    @tf.function
    def step():
        lanes = _lane_collectives(n)
        results = []
        for j, lane in enumerate(lanes):
            with tf.device(lane.device):
                value = tf.constant([float(j), -float(j)])
                results.append((lane.reduce(value, "max"), lane.reduce(value, "sum")))
        return results

    for maximum, total in step():
        np.testing.assert_array_equal(maximum.numpy(), [3.0, 0.0])
        np.testing.assert_array_equal(total.numpy(), [6.0, -6.0])


def test_instance_key_ranges_of_one_group_are_disjoint(monkeypatch):
    """Counted, dynamic-length and process-local instance keys share a group when a split
    replica is also the data-parallel group of a replicated Embedding (its sparse rows
    gathered with a dynamic length): every key each allocator can hand out, over its whole
    cycle, lies in its own range, and no two ranges meet."""
    from epl_trainer.core.comm import keys

    # The allocators' cycles run to their wrap-around here: the process's later tests must
    # not start again from keys its earlier tests' collectives used (TF keeps an
    # instance's op type per key: "expected type 2 ... but got type 4").
    monkeypatch.setattr(keys, "_local_key_offset", keys._local_key_offset)
    monkeypatch.setattr(keys, "_dynamic_counters", {})
    group = comm.group_key(["/device:CPU:0", "/device:CPU:1", "test-key-ranges"])
    counted = [keys.next_instance_key(group) for _ in range(3)]
    # the last key next_instance_key hands out (it refuses the next: test below)
    counted_range = (counted[0], keys.INSTANCE_KEY_RANGES["counted"][1] - 1)
    dynamic = []  # every block's first and last key, until the blocks wrap around
    while True:
        first = int(keys.length_keyed_instance(tf.constant(0), group))
        if dynamic and first == dynamic[0][0]:
            break
        dynamic.append((first, first + keys.DYNAMIC_BLOCK - 1))
    last = int(keys.length_keyed_instance(tf.constant(keys.DYNAMIC_BLOCK - 1), group))
    assert last == dynamic[1][1]  # the largest length accepted ends its block
    local = []  # the split lanes' reservations, until they wrap around
    while True:
        first = keys.reserve_local_instance_keys(keys.KEYS_PER_LANE_GROUP)
        if local and first < local[-1][0]:
            break
        local.append((first, first + keys.KEYS_PER_LANE_GROUP - 1))
    spans = {
        "counted": counted_range,
        "dynamic": (min(a for a, _ in dynamic), max(b for _, b in dynamic)),
        "local": (min(a for a, _ in local), max(b for _, b in local)),
    }
    for name, (low, high) in spans.items():
        declared_low, declared_end = keys.INSTANCE_KEY_RANGES[name]
        assert declared_low <= low <= high < declared_end, (name, hex(low), hex(high))
        assert high < 2**31  # an int32 key
    ordered = sorted(spans.values())
    assert all(a[1] < b[0] for a, b in itertools.pairwise(ordered)), {
        k: (hex(a), hex(b)) for k, (a, b) in spans.items()
    }


def test_counted_instance_keys_refuse_to_leave_their_range():
    from epl_trainer.core.comm import keys

    group = comm.group_key(["/device:CPU:0", "test-counted-end"])
    end = keys.INSTANCE_KEY_RANGES["counted"][1]
    keys._instance_counters[group] = iter(range(end - 1, end + 1))
    assert keys.next_instance_key(group) == end - 1
    with pytest.raises(RuntimeError, match="instance keys"):
        keys.next_instance_key(group)
