"""ZeRO partitions (plain data), their buffers, and the sharded exchanges on 4 logical CPU
devices."""

import math
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from epl_trainer.core import comm
from epl_trainer.core.engine.state import Lane
from epl_trainer.core.engine.zero import exchange as zero_exchange
from epl_trainer.core.engine.zero import layout as zl
from epl_trainer.core.engine.zero import update as zero

DEVICES = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(8)]
# Lanes listed in an order that is not TF's rank order, so lane index != shard.
LANE_DEVICES = (DEVICES[2], DEVICES[0], DEVICES[3], DEVICES[1])
SHAPES = [(3, 4), (7,), (2, 2, 2), (5, 1), (1,), (4, 6)]


# ---- partitions (no collectives) ----------------------------------------------------------


def _random_shapes(rng):
    shapes = []
    for _ in range(int(rng.integers(1, 30))):
        rank = int(rng.integers(0, 4))
        shapes.append(tuple(int(d) for d in rng.integers(1, 40, size=rank)))
    return shapes


def _assert_pieces_cover_each_variable_once(layout):
    spans = {j: [] for j in range(len(layout.shapes))}
    for r in range(layout.num_shards):
        for p in layout.pieces[r]:
            spans[p.position].append((p.start, p.stop))
            assert p.size == math.prod(p.shape)
    for j, found in spans.items():
        edges = [0] + [e for span in sorted(found) for e in span] + [layout.sizes[j]]
        assert edges[::2] == edges[1::2], (layout.shapes[j], found)


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("seed", range(5))
def test_each_shard_owns_total_over_n(num_shards, seed):
    """Cut by elements: blocks of ceil(total / N), the last one short by < N elements;
    cut by rows: within one row of total / N."""
    shapes = _random_shapes(np.random.default_rng(seed))
    total = sum(math.prod(s) for s in shapes)
    largest_row = max(zl.row_size(s) for s in shapes)
    for cut, unit in (("elements", num_shards), ("rows", largest_row)):
        layout = zl.FlatLayout(shapes, num_shards, cut=cut)
        assert sum(layout.loads) == total
        for load in layout.loads:
            assert abs(load - total / num_shards) <= unit, (cut, layout.loads, unit)
        _assert_pieces_cover_each_variable_once(layout)
        assert layout.pieces == zl.FlatLayout(list(shapes), num_shards, cut=cut).pieces


def test_element_cuts_make_blocks_of_consecutive_elements():
    layout = zl.FlatLayout([(10, 3), (4,)], num_shards=2)  # 34 elements: 17 each
    assert layout.loads == (17, 17)
    (first,), (second, bias) = layout.pieces
    assert (first.start, first.stop, first.shape, first.whole) == (0, 17, (17,), False)
    assert (second.start, second.stop, second.shape) == (17, 30, (13,))
    assert bias.whole and bias.shape == (4,)


def test_row_cuts_fall_on_row_boundaries_and_pieces_keep_trailing_axes():
    layout = zl.FlatLayout([(10, 3), (4,)], num_shards=2, cut="rows")  # 17 -> row 6
    assert layout.loads == (18, 16)
    (first,), (second, bias) = layout.pieces
    assert (first.start, first.stop, first.shape, first.whole) == (0, 18, (6, 3), False)
    assert (second.start, second.stop, second.shape) == (18, 30, (4, 3))
    assert bias.whole and bias.shape == (4,)
    with pytest.raises(ValueError, match="cut must be one of"):
        zl.FlatLayout([(2,)], 2, cut="bytes")


def test_whole_variables_for_optimizers_that_are_not_element_wise():
    sizes = [12, 7, 8, 5, 1, 24]
    layout = zl.FlatLayout(SHAPES, num_shards=3, cut="whole")
    assert all(p.whole for pieces in layout.pieces for p in pieces)
    owners = zl.assign_owners(sizes, 3)
    assert [[p.position for p in pieces] for pieces in layout.pieces] == [
        [j for j, o in enumerate(owners) if o == r] for r in range(3)
    ]
    assert max(layout.loads) <= min(layout.loads) + max(sizes)
    assert zl.assign_owners([5, 5, 5, 5], 4) == [0, 1, 2, 3]
    assert zl.assign_owners([1, 9, 4, 4], 2) == [1, 0, 1, 1]  # largest first
    with pytest.raises(ValueError, match="num_shards must be >= 1"):
        zl.assign_owners([1], 0)


def test_which_optimizers_may_be_cut_into_pieces():
    assert zl.splits_variables(keras.optimizers.Adam())
    assert zl.splits_variables(keras.optimizers.AdamW(global_clipnorm=1.0))
    assert not zl.splits_variables(keras.optimizers.AdamW(clipnorm=1.0))  # a norm per variable
    assert not zl.splits_variables(keras.optimizers.Lamb())  # trust ratio per variable
    assert not zl.splits_variables(keras.optimizers.Adafactor())  # factored moments

    class Custom(keras.optimizers.Adam):
        def update_step(self, gradient, variable, learning_rate):
            variable.assign(variable / tf.norm(variable))

    assert not zl.splits_variables(Custom())


def _values(shapes, seed=0, dtype="float32"):
    rng = np.random.default_rng(seed)
    return [tf.constant(rng.normal(size=s).astype(dtype)) for s in shapes]


def _rows(value, piece):
    return zero_exchange.elements_of(value, piece).numpy()


@pytest.mark.parametrize("num_shards", [1, 2, 4, 5])
@pytest.mark.parametrize("excluded", [(), (5,)], ids=["all", "without_one"])
@pytest.mark.parametrize("cut", ["elements", "rows"])
def test_pack_unpack_round_trips(num_shards, excluded, cut):
    layout = zl.FlatLayout(SHAPES, num_shards, cut=cut)
    values = _values(SHAPES)
    buffer = layout.pack(values, set(excluded))
    block = layout.exchange_block_size(set(excluded))
    assert buffer.shape == (num_shards * block,)
    for r in range(num_shards):
        chunk = buffer[r * block : (r + 1) * block]
        pieces = layout.pieces_of(r, set(excluded))
        np.testing.assert_array_equal(chunk[sum(p.size for p in pieces) :].numpy(), 0.0)
        for p, value in zip(pieces, layout.unpack_block(chunk, r, set(excluded))):
            assert p.position not in excluded
            np.testing.assert_array_equal(value.numpy(), _rows(values[p.position], p))
    blocks = [
        layout.pack_block([zero_exchange.elements_of(values[p.position], p) for p in pieces], r)
        for r, pieces in enumerate(layout.pieces)
    ]
    for original, value in zip(values, layout.unpack_all(tf.concat(blocks, 0))):
        assert value.shape == original.shape
        np.testing.assert_array_equal(value.numpy(), original.numpy())


def test_more_shards_than_elements_pads_the_empty_shards():
    layout = zl.FlatLayout([(2,), (3,)], num_shards=8)
    assert sum(layout.loads) == 5 and layout.block_size == 1
    assert [len(p) for p in layout.pieces].count(0) == 3
    buffer = layout.pack([tf.ones([2]), tf.fill([3], 2.0)])
    assert sorted(buffer.numpy().tolist()) == [0, 0, 0, 1, 1, 2, 2, 2]


def test_make_layouts_one_per_dtype_and_byte_reports():
    dtypes = ["float32", "float16", "float32", "float16", "float32", "float32"]
    layouts = zl.make_layouts(SHAPES, dtypes, num_shards=2, indices=range(20, 26))
    assert [layout.dtype for layout in layouts] == ["float32", "float16"]
    assert layouts[0].indices == (20, 22, 24, 25) and layouts[1].indices == (21, 23)
    per_shard = zl.shard_bytes(layouts)
    assert sum(per_shard) == (12 + 8 + 1 + 24) * 4 + (7 + 5) * 2
    stats = zl.balance(layouts)
    assert stats["max_bytes"] == max(per_shard) and stats["min_bytes"] == min(per_shard)
    split = zl.make_layouts(SHAPES, dtypes, num_shards=2, max_splits=2)
    assert [x.dtype for x in split] == ["float32"] * 2 + ["float16"] * 2  # 2 buckets per dtype
    with pytest.raises(ValueError, match="one dtype per shape"):
        zl.make_layouts(SHAPES, dtypes[:2], num_shards=2)


@pytest.mark.parametrize("max_splits", [1, 4])
def test_balance_when_an_embedding_is_half_the_model(max_splits):
    """The issue's case: one variable decides the peak when variables are dealt out whole
    (BERT's vocabulary embedding); cut into row pieces every shard is within 1%."""
    shapes = [(30522, 64), (512, 64)]
    for _ in range(4):
        shapes += [(64, 64)] * 4 + [(64,)] * 4 + [(64, 256), (256,), (256, 64), (64,)] * 8
    dtypes = ["float32"] * len(shapes)
    layouts = zl.make_layouts(shapes, dtypes, 4, max_splits=max_splits, row_aligned={0})
    assert [x.cut for x in layouts] == ["elements"] * max_splits + ["rows"]
    assert layouts[-1].indices == (0,)  # the embedding, cut on rows in its own layout
    per_shard = zl.shard_bytes(layouts)
    total = sum(per_shard)
    assert max(abs(b - total / 4) for b in per_shard) <= 0.01 * total / 4, per_shard
    whole = zl.make_layouts(shapes, dtypes, 4, split_variables=False)
    assert max(zl.shard_bytes(whole)) > 1.5 * total / 4  # what exact balance fixes


# ---- exchanges in a tf.function on 4 lanes ------------------------------------------------


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
    layouts = zl.make_layouts(SHAPES, dtypes, group.size)
    shards = zero_exchange.member_shards(group, layouts)
    assert shards == [2, 0, 3, 1]
    rng = np.random.default_rng(1)
    micro_batches = 2 if level == "v1" else 1  # v1 sums a reduce-scatter per micro-batch
    arrays = [
        [[rng.normal(size=s).astype(dt) for s, dt in zip(SHAPES, dtypes)] for _ in LANE_DEVICES]
        for _ in range(micro_batches)
    ]
    sparse = {5}  # left out of the buffers (its rows travel apart)

    @tf.function
    def step():
        per_mb = [[dict(enumerate(g)) for g in _placed(group, mb)] for mb in arrays]
        if level == "v1":
            owned = zero_exchange.reduce_scatter_pieces(group, layouts, per_mb, sparse)
        else:
            owned = zero_exchange.all_reduce_pieces(group, layouts, per_mb[0], sparse)
        # Every lane then gathers pieces (here: the reduced ones, zeros for the sparse).
        pieces = [
            {
                (b, p.position): owned[m].get((b, p.position), tf.zeros(p.shape, layout.dtype))
                for b, layout in enumerate(layouts)
                for p in layout.pieces[shards[m]]
            }
            for m in range(group.size)
        ]
        for m, device in enumerate(group.local_devices):
            with tf.device(device):
                pieces[m] = {k: tf.identity(v) for k, v in pieces[m].items()}
        return owned, zero_exchange.gather_pieces(group, layouts, pieces)

    owned, gathered = step()
    mean = [
        sum(np.mean([lane[i] for lane in mb], axis=0) for mb in arrays) for i in range(len(SHAPES))
    ]
    for m, shard in enumerate(shards):
        for b, layout in enumerate(layouts):
            for p in layout.pieces[shard]:
                if p.index in sparse:
                    assert (b, p.position) not in owned[m]
                    continue
                value = owned[m][(b, p.position)]
                assert value.dtype == tf.as_dtype(dtypes[p.index]) and value.shape == p.shape
                expected = _rows(tf.constant(mean[p.index]), p)
                np.testing.assert_allclose(value.numpy(), expected, rtol=1e-6, atol=1e-6)
        assert sorted(gathered[m]) == list(range(len(SHAPES)))
        for i, value in gathered[m].items():
            expected = 0 * mean[i] if i in sparse else mean[i]
            np.testing.assert_allclose(value.numpy(), expected, rtol=1e-6, atol=1e-6)


def test_sparse_rows_of_a_piece_keep_their_count_and_land_locally():
    piece = zl.Piece(0, 0, 4, 10, (3, 2), whole=False)  # rows 2..5 of a (6, 2) table
    slices = tf.IndexedSlices(
        tf.constant([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [4.0, 4.0]]),
        tf.constant([0, 2, 4, 2]),
        tf.constant([6, 2]),
    )
    mine = zero_exchange.piece_of_slices(slices, piece)
    assert mine.values.shape == (4, 2)  # static row count (XLA-compiled updates)
    np.testing.assert_array_equal(tf.convert_to_tensor(mine).numpy(), [[6, 6], [0, 0], [3, 3]])


def test_layouts_must_have_one_shard_per_member():
    group = comm.CollectiveGroup(LANE_DEVICES, LANE_DEVICES)
    layouts = zl.make_layouts(SHAPES, ["float32"] * len(SHAPES), 2)
    with pytest.raises(ValueError, match="one shard per group member"):
        zero_exchange.member_shards(group, layouts)


# ---- ZeroUpdate against one optimizer on the mean gradients --------------------------------


class _State(types.SimpleNamespace):
    def adopt(self, copy, original):
        self.originals[id(copy)] = original

    def original_of(self, copy):
        return self.originals.get(id(copy), copy)


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
        state=_State(trainable=trainable, model_trainable=trainable[0], originals={}, sharded={}),
        stage_lanes=[tuple(range(len(lanes)))],
        local_stages=lambda li: [0],
    )
    reduction = types.SimpleNamespace(
        method="mean",
        num_communicators=2,
        max_splits=1,
        clip_before=False,
        clip_after=clip_global_norm is not None,
        clip_global_norm=clip_global_norm,
    )
    return layout, reduction, initial


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.05),
    "adamw_clipnorm": lambda: keras.optimizers.AdamW(0.05, weight_decay=0.1, clipnorm=0.5),
}


@pytest.mark.parametrize("level", ["v0", "v1", "v1_micro_batches"])
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

    split = zl.splits_variables(OPTIMIZERS[optimizer]())
    update = zero.ZeroUpdate(
        program, reduction, make_optimizer, level[:2], measure_ranks=level == "v1",
        split_variables=split,
    )  # fmt: skip
    # Slots exist only for owned pieces: every element is in exactly one optimizer.
    total = sum(math.prod(s) for s in SHAPES)
    assert sum(math.prod(v.shape) for _, vs in built for v in vs) == total
    for li, ((lane_optimizer,),) in enumerate(update.optimizers):
        slots = [v for v in lane_optimizer.variables if v.shape.rank]
        assert {v.value.device for v in slots} == {LANE_DEVICES[li]}
        owned = sum(p.size for p in update.owned_pieces(0, li))
        assert sum(math.prod(v.shape) for v in slots) == 2 * owned  # momentum, velocity
    assert any(not p.whole for li in range(4) for p in update.owned_pieces(0, li)) == split
    reference = [keras.Variable(v) for v in initial]
    ref_optimizer = OPTIMIZERS[optimizer]()

    @tf.function
    def step(lane_grads):
        if level == "v1_micro_batches":  # as the lane executors hand them over
            for half in (0.25, 0.75):  # as the program flushes after each backward
                for li, grads in enumerate(lane_grads):
                    update.micro_batch_grads.add(li, 0, {i: g * half for i, g in enumerate(grads)})
                assert sorted(update.micro_batch_grads.flush(0)) == [0, 1, 2, 3]
            lane_grads = [[None] * len(SHAPES) for _ in lane_grads]
        update(lane_grads)

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
    assert sum(shard_bytes) == total * 4
    if split:
        assert max(shard_bytes) - min(shard_bytes) <= 4 * 4  # within one row (4 floats)
    # Checkpoints save each piece's slots from the one lane holding it; a variable owned
    # whole is listed with its owner's device.
    owners, pieces = update.slot_owners(), update.piece_spans()
    for li, _, variables in update.local_optimizers():
        for v in variables:
            lane, i, start, _ = pieces[id(v)]
            assert lane == li
            if start is None:
                assert owners[i] == LANE_DEVICES[li]
    assert sorted({i for _, i, _, _ in pieces.values()}) == list(range(len(SHAPES)))
