"""ZeRO shard layouts (plain data) and the sharded exchanges on 4 logical CPU devices."""

import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from epl_trainer.core import comm
from epl_trainer.core.engine import zero
from epl_trainer.core.engine.state import Lane

DEVICES = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(8)]
# Lanes listed in an order that is not TF's rank order, so lane index != shard.
LANE_DEVICES = (DEVICES[2], DEVICES[0], DEVICES[3], DEVICES[1])
SHAPES = [(3, 4), (7,), (2, 2, 2), (5, 1), (1,), (4, 6)]


# ---- owners and layouts (no collectives) --------------------------------------------------


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("seed", range(5))
def test_assign_owners_is_balanced_within_the_largest_item(num_shards, seed):
    rng = np.random.default_rng(seed)
    sizes = [int(s) for s in rng.integers(1, 10_000, size=rng.integers(1, 60))]
    owners = zero.assign_owners(sizes, num_shards)
    loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(num_shards)]
    assert sorted(set(owners)) == list(range(min(num_shards, len(sizes))))
    assert max(loads) <= min(loads) + max(sizes)
    assert owners == zero.assign_owners(list(sizes), num_shards)  # deterministic


def test_assign_owners_ties_go_to_the_lowest_shard():
    assert zero.assign_owners([5, 5, 5, 5], 4) == [0, 1, 2, 3]
    assert zero.assign_owners([1, 1, 1], 2) == [0, 1, 0]
    assert zero.assign_owners([1, 9, 4, 4], 2) == [1, 0, 1, 1]  # largest first
    assert zero.assign_owners([], 3) == []
    with pytest.raises(ValueError, match="num_shards must be >= 1"):
        zero.assign_owners([1], 0)


def test_layout_blocks_offsets_and_owned_indices():
    layout = zero.ShardLayout(SHAPES, num_shards=3, indices=[10, 11, 12, 13, 14, 15])
    sizes = [12, 7, 8, 5, 1, 24]
    assert layout.sizes == tuple(sizes)
    assert layout.owners == tuple(zero.assign_owners(sizes, 3))
    assert layout.block_size == max(layout.loads) and sum(layout.loads) == sum(sizes)
    owned = [i for r in range(3) for i in layout.owned_indices(r)]
    assert sorted(owned) == [10, 11, 12, 13, 14, 15]
    assert zero.owned_indices([layout], 0) == sorted(layout.owned_indices(0))
    assert zero.owner_of([layout]) == {10 + j: r for j, r in enumerate(layout.owners)}


def _values(shapes, seed=0, dtype="float32"):
    rng = np.random.default_rng(seed)
    return [tf.constant(rng.normal(size=s).astype(dtype)) for s in shapes]


@pytest.mark.parametrize("num_shards", [1, 2, 4, 5])
def test_pack_unpack_round_trips(num_shards):
    layout = zero.ShardLayout(SHAPES, num_shards)
    values = _values(SHAPES)
    buffer = layout.pack(values)
    assert buffer.shape == (num_shards * layout.block_size,)
    block = layout.block_size
    for r in range(num_shards):
        chunk = buffer[r * block : (r + 1) * block]
        np.testing.assert_array_equal(chunk[layout.loads[r] :].numpy(), 0.0)  # padding
        owned = layout.unpack_owned(chunk, r)
        for j, value in zip(layout.owned[r], owned):
            np.testing.assert_array_equal(value.numpy(), values[j].numpy())
        repacked = layout.pack_owned([values[j] for j in layout.owned[r]], r)
        np.testing.assert_array_equal(repacked.numpy(), chunk.numpy())
    for original, value in zip(values, layout.unpack_all(buffer)):
        assert value.shape == original.shape
        np.testing.assert_array_equal(value.numpy(), original.numpy())


def test_more_shards_than_variables_pads_the_empty_shards():
    layout = zero.ShardLayout([(2,), (3,)], num_shards=4)
    assert layout.loads == (3, 2, 0, 0) and layout.block_size == 3
    assert layout.owned_indices(3) == [] and layout.unpack_owned(tf.zeros([3]), 3) == []
    buffer = layout.pack([tf.ones([2]), tf.fill([3], 2.0)])
    np.testing.assert_array_equal(buffer.numpy(), [2, 2, 2, 1, 1, 0] + [0] * 6)


def test_make_layouts_one_per_dtype_and_byte_reports():
    dtypes = ["float32", "float16", "float32", "float16", "float32", "float32"]
    layouts = zero.make_layouts(SHAPES, dtypes, num_shards=2, indices=range(20, 26))
    assert [layout.dtype for layout in layouts] == ["float32", "float16"]
    assert layouts[0].indices == (20, 22, 24, 25) and layouts[1].indices == (21, 23)
    per_shard = zero.shard_bytes(layouts)
    assert sum(per_shard) == (12 + 8 + 1 + 24) * 4 + (7 + 5) * 2
    stats = zero.balance(layouts)
    assert stats["max_bytes"] == max(per_shard) and stats["min_bytes"] == min(per_shard)
    assert stats["padding_bytes"] == sum(
        (x.buffer_size - sum(x.loads)) * np.dtype(x.dtype).itemsize for x in layouts
    )
    split = zero.make_layouts(SHAPES, dtypes, num_shards=2, max_splits=2)
    assert [x.dtype for x in split] == ["float32"] * 2 + ["float16"] * 2  # 2 buckets per dtype
    with pytest.raises(ValueError, match="one dtype per shape"):
        zero.make_layouts(SHAPES, dtypes[:2], num_shards=2)


def test_layout_balance_on_a_transformer_like_stage():
    """Owned bytes per shard for 12 blocks of (q, k, v, o, ffn_in, ffn_out, 2 norms)."""
    shapes = []
    for _ in range(12):
        shapes += [(256, 256)] * 4 + [(256, 1024), (1024, 256), (256,), (256,)]
    layouts = zero.make_layouts(shapes, ["float32"] * len(shapes), num_shards=4)
    stats = zero.balance(layouts)
    assert stats["max_over_min"] < 1.01, stats


# ---- exchanges in a tf.function on 4 lanes ------------------------------------------------


def _lane_grads(dtypes):
    rng = np.random.default_rng(1)
    return [[rng.normal(size=s).astype(dt) for s, dt in zip(SHAPES, dtypes)] for _ in LANE_DEVICES]


def _placed(group, lane_arrays):
    placed = []
    for device, arrays in zip(group.local_devices, lane_arrays):
        with tf.device(device):
            placed.append([tf.constant(a) for a in arrays])
    return placed


@pytest.mark.parametrize("level", ["v0", "v1"])
@pytest.mark.parametrize("mixed", [False, True], ids=["float32", "mixed_dtypes"])
def test_exchanges_give_each_lane_its_mean_gradients_and_every_variable(level, mixed):
    dtypes = ["float32", "float64", "float32", "float32", "float64", "float32"] if mixed else None
    dtypes = dtypes or ["float32"] * len(SHAPES)
    group = comm.CollectiveGroup(LANE_DEVICES, LANE_DEVICES)
    layouts = zero.make_layouts(SHAPES, dtypes, group.size)
    shards = zero.lane_shards(group, layouts)
    assert shards == [2, 0, 3, 1]
    lane_arrays = _lane_grads(dtypes)
    exchange = zero.zero_reduce_scatter if level == "v1" else zero.zero_all_reduce

    @tf.function
    def step():
        owned = exchange(group, layouts, _placed(group, lane_arrays), "mean")
        # Every lane then gathers its owned (here: reduced) values back to all lanes.
        return owned, zero.zero_all_gather(group, layouts, owned)

    owned, gathered = step()
    mean = [np.mean([lane[i] for lane in lane_arrays], axis=0) for i in range(len(SHAPES))]
    covered = []
    for li, shard in enumerate(shards):
        indices = zero.owned_indices(layouts, shard)
        covered += indices
        assert len(owned[li]) == len(indices)
        for i, value in zip(indices, owned[li]):
            assert value.dtype == tf.as_dtype(dtypes[i]) and value.shape == SHAPES[i]
            np.testing.assert_allclose(value.numpy(), mean[i], rtol=1e-6, atol=1e-6)
        assert sorted(gathered[li]) == list(range(len(SHAPES)))
        for i, value in gathered[li].items():
            np.testing.assert_allclose(value.numpy(), mean[i], rtol=1e-6, atol=1e-6)
    assert sorted(covered) == list(range(len(SHAPES)))  # each variable owned exactly once


def test_exchanges_on_a_group_of_one():
    group = comm.CollectiveGroup(DEVICES[:1], DEVICES[:1])
    layouts = zero.make_layouts(SHAPES, ["float32"] * len(SHAPES), 1)
    (grads,) = [_values(SHAPES, seed=3)]
    (owned,) = zero.zero_reduce_scatter(group, layouts, [grads], "mean")
    (full,) = zero.zero_all_gather(group, layouts, [owned])
    for i, g in enumerate(grads):
        np.testing.assert_array_equal(owned[i].numpy(), g.numpy())
        np.testing.assert_array_equal(full[i].numpy(), g.numpy())


def test_layouts_must_have_one_shard_per_member():
    group = comm.CollectiveGroup(LANE_DEVICES, LANE_DEVICES)
    layouts = zero.make_layouts(SHAPES, ["float32"] * len(SHAPES), 2)
    with pytest.raises(ValueError, match="one shard per group member"):
        zero.lane_shards(group, layouts)


# ---- ZeroUpdate against one optimizer on the mean gradients --------------------------------


def _fake_layout(lane_devices, clip_global_norm=None):
    """The few StepLayout and GradientReduction attributes an update pass reads."""
    rng = np.random.default_rng(7)
    initial = [rng.normal(size=s).astype("float32") for s in SHAPES]
    lanes = [Lane(i, (device,)) for i, device in enumerate(lane_devices)]
    trainable = []
    for lane in lanes:
        with tf.device(lane.devices[0]):
            trainable.append([keras.Variable(v, name=f"w{i}") for i, v in enumerate(initial)])
    layout = types.SimpleNamespace(
        lanes=lanes,
        num_stages=1,
        stage_groups=[comm.CollectiveGroup(tuple(lane_devices), tuple(lane_devices))],
        trainable_idx=[list(range(len(SHAPES)))],
        state=types.SimpleNamespace(trainable=trainable, model_trainable=trainable[0]),
        stage_lanes=[tuple(range(len(lanes)))],
        local_stages=lambda li: [0],
    )
    reduction = types.SimpleNamespace(
        method="mean",
        num_communicators=2,
        clip_before=False,
        clip_after=clip_global_norm is not None,
        clip_global_norm=clip_global_norm,
    )
    return layout, reduction, initial


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.05),
    "adamw_clipnorm": lambda: keras.optimizers.AdamW(0.05, weight_decay=0.1, clipnorm=0.5),
}


@pytest.mark.parametrize("level", ["v0", "v1"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("clip", [None, 0.3])
def test_zero_update_equals_one_optimizer_on_mean_gradients(level, optimizer, clip):
    program, reduction, initial = _fake_layout(LANE_DEVICES, clip_global_norm=clip)
    built = []

    def make_optimizer(device, variables):
        with tf.device(device):
            opt = OPTIMIZERS[optimizer]()
            opt.build(variables)
        built.append((device, variables))
        return opt

    update = zero.ZeroUpdate(program, reduction, make_optimizer, level, measure_ranks=level == "v1")
    # Slots exist only for owned variables: each variable is in exactly one optimizer.
    owned_vars = [
        id(program.state.trainable[li][i])
        for li, owned in enumerate(update.owned[0])
        for i in owned
    ]
    assert sorted(id(v) for _, vs in built for v in vs) == sorted(owned_vars)
    for li, (lane_optimizer,) in enumerate(update.optimizers):
        slots = [v for v in lane_optimizer.variables if v.shape.rank]
        assert {v.value.device for v in slots} == {LANE_DEVICES[li]}
        assert len(slots) == 2 * len(update.owned[0][li])  # momentum, velocity
    reference = [keras.Variable(v) for v in initial]
    ref_optimizer = OPTIMIZERS[optimizer]()
    step = tf.function(update)
    rng = np.random.default_rng(11)
    for _ in range(3):
        lane_arrays = [[rng.normal(size=s).astype("float32") for s in SHAPES] for _ in LANE_DEVICES]
        step(_placed(program.stage_groups[0], lane_arrays))
        mean = [np.mean([lane[i] for lane in lane_arrays], axis=0) for i in range(len(SHAPES))]
        if clip:  # the program's global_clipnorm, after the reduction
            norm = np.sqrt(sum(np.sum(np.square(g, dtype="float64")) for g in mean))
            mean = [g * np.float32(clip / max(norm, clip)) for g in mean]
        ref_optimizer.apply([tf.constant(g) for g in mean], reference)
    for lane_vars in program.state.trainable:
        for variable, expected in zip(lane_vars, reference):
            np.testing.assert_allclose(variable.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)
    shard_bytes = update.optimizer_shard_bytes()[0]
    assert sum(shard_bytes) == sum(int(np.prod(s)) for s in SHAPES) * 4
    # Checkpoints save each variable's slots from the lane that owns it, and only there.
    owners = update.slot_owners()
    for li, _, variables in update.local_optimizers():
        for v in variables:
            i = [id(w) for w in program.state.trainable[li]].index(id(v))
            assert owners[i] == LANE_DEVICES[li]
    assert sorted(owners) == list(range(len(SHAPES)))
