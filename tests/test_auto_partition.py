"""Static cost model (core/graph/cost.py) and automatic pipeline partition
(core/graph/auto_partition.py).

Every automatic cut is checked numerically too: the stages built by `partition_model`
from `node_stage` compute what the unpartitioned model computes. Run with `-s` to see
the stage tables.
"""

import itertools

import keras
import numpy as np
import pytest
from _models import TiedLogits

from epl_trainer.annotations.strategies import model_nodes
from epl_trainer.core.graph.auto_partition import (
    auto_partition,
    balanced_cuts,
    boundary_bytes,
    cut_candidates,
    find_repeated_blocks,
)
from epl_trainer.core.graph.cost import model_cost_summary, node_costs, nodes_cost
from epl_trainer.core.graph.partition import PartitionError, compute_nodes, partition_model
from epl_trainer.core.plan.planner import build_plan

HIDDEN, HEADS, SEQ, VOCAB, BLOCKS = 32, 2, 16, 100, 12
BLOCK_NODES = 7  # MHA, add, LN, Dense, Dense, add, LN
ATOL = 1e-5


def transformer(blocks=BLOCKS, pre_norm=False, seed=0) -> keras.Model:
    """embedding -> blocks x [self-attention + residual + LN + Dense(4h) + Dense(h) +
    residual + LN] -> Dense head (post-norm); or pre-norm blocks with a final LN."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(VOCAB, HIDDEN, name="embed")(tokens)
    for i in range(blocks):
        h = keras.layers.LayerNormalization(name=f"pre_ln1_{i}")(x) if pre_norm else x
        a = keras.layers.MultiHeadAttention(HEADS, HIDDEN // HEADS, name=f"attn_{i}")(h, h)
        x = x + a
        x = x if pre_norm else keras.layers.LayerNormalization(name=f"ln1_{i}")(x)
        h = keras.layers.LayerNormalization(name=f"pre_ln2_{i}")(x) if pre_norm else x
        f = keras.layers.Dense(4 * HIDDEN, activation="gelu", name=f"ff1_{i}")(h)
        f = keras.layers.Dense(HIDDEN, name=f"ff2_{i}")(f)
        x = x + f
        x = x if pre_norm else keras.layers.LayerNormalization(name=f"ln2_{i}")(x)
    if pre_norm:
        x = keras.layers.LayerNormalization(name="final_ln")(x)
    return keras.Model(tokens, keras.layers.Dense(VOCAB, name="head")(x))


class TransformerBlock(keras.layers.Layer):
    """The same block as one custom Layer (one node per call)."""

    def __init__(self, hidden, heads, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(heads, hidden // heads)
        self.norm1 = keras.layers.LayerNormalization()
        self.ff1 = keras.layers.Dense(4 * hidden, activation="gelu")
        self.ff2 = keras.layers.Dense(hidden)
        self.norm2 = keras.layers.LayerNormalization()

    def call(self, x):
        x = self.norm1(x + self.attention(x, x))
        return self.norm2(x + self.ff2(self.ff1(x)))


def custom_block_transformer(seed=0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(VOCAB, HIDDEN, name="embed")(tokens)
    for i in range(BLOCKS):
        x = TransformerBlock(HIDDEN, HEADS, name=f"block_{i}")(x)
    return keras.Model(tokens, keras.layers.Dense(VOCAB, name="head")(x))


@pytest.fixture(scope="module")
def gpt():
    return transformer()


@pytest.fixture(scope="module")
def custom_gpt():
    return custom_block_transformer()


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, VOCAB, size=(3, SEQ)).astype("int32")


def assert_valid_partition(model, result, num_stages):
    """Contiguous, complete, and numerically the same model once cut."""
    nodes = compute_nodes(model)
    stage_of = result.node_stage
    assert list(stage_of) == nodes  # every node, in node order
    stages = [stage_of[node] for node in nodes]
    assert stages == sorted(stages)  # contiguous in topological order
    assert set(stages) == set(range(num_stages))
    assert [stages.index(k) for k in range(1, num_stages)] == list(result.cuts)
    assert len(result.stage_costs) == num_stages
    assert sum(result.stage_costs) == sum(c.flops for c in node_costs(model))


def bottleneck(costs, cuts):
    """The largest stage cost when stages start at `cuts`."""
    bounds = (0, *cuts, len(costs))
    return max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))


def assert_forward_matches(model, result, num_stages, x):
    staged = partition_model(model, result.node_stage, num_stages)
    np.testing.assert_allclose(
        np.asarray(staged.forward(x)), np.asarray(model(x)), atol=ATOL, rtol=0
    )


# ------------------------------------------------------------------ transformer
def test_nodes_are_costed_in_model_nodes_order(gpt):
    nodes = compute_nodes(gpt)
    assert nodes == model_nodes(gpt)
    names = [c.name for c in node_costs(gpt)][:4]
    # `x + a` is an auto-named op ("add", "add_4", ... depending on what ran before).
    assert names[:2] == ["embed", "attn_0"] and names[2].startswith("add")
    assert names[3] == "ln1_0"


def test_repeated_transformer_blocks_are_found_by_structure(gpt):
    nodes = compute_nodes(gpt)
    runs = find_repeated_blocks(nodes)
    assert len(runs) == 1
    run = runs[0]
    assert (run.start, run.period, run.count) == (1, BLOCK_NODES, BLOCKS)
    assert run.kinds == (
        "MultiHeadAttention",
        "Add",
        "LayerNormalization",
        "Dense",
        "Dense",
        "Add",
        "LayerNormalization",
    )


@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_transformer_cut_into_balanced_contiguous_stages(gpt, tokens, num_stages):
    result = auto_partition(gpt, num_stages)
    print(f"\n{result.describe()}")
    assert_valid_partition(gpt, result, num_stages)
    block_boundaries = {1 + BLOCK_NODES * i for i in range(1, BLOCKS)}
    assert set(result.cuts) <= block_boundaries
    # Equal blocks, 12 divisible by S: each stage holds 12/S blocks; the embedding and
    # head are the only imbalance.
    blocks_per_stage = [
        sum(1 for b in range(BLOCKS) if start <= 1 + BLOCK_NODES * b < stop)
        for start, stop in result.stage_ranges
    ]
    assert blocks_per_stage == [BLOCKS // num_stages] * num_stages
    assert result.spread <= 1.25
    assert f"spread max/min = {result.spread:.3f}" in result.describe()
    assert all(b == SEQ * HIDDEN * 4 for b in result.boundary_bytes)  # one tensor crosses
    assert_forward_matches(gpt, result, num_stages, tokens)


def test_cut_description_names_the_cut_nodes(gpt):
    result = auto_partition(gpt, 3)
    assert result.cut_names == ("attn_4", "attn_8")
    assert "node 29 'attn_4', node 57 'attn_8'" in result.cut_description
    assert "12 blocks of 7 nodes" in result.cut_description
    assert [spec.name for spec in result.taskgraph_specs()] == ["stage_0", "stage_1", "stage_2"]
    assert {spec.device_count for spec in result.taskgraph_specs()} == {1}


def test_plan_summary_shows_the_cut_and_stage_costs(gpt):
    result = auto_partition(gpt, 4)
    devices = [[f"/job:worker/replica:0/task:0/device:CPU:{d}" for d in range(8)]]
    plan = build_plan(
        result.taskgraph_specs(),
        devices,
        0,
        num_micro_batch=4,
        stage_costs=result.stage_costs,
        cut_description=result.cut_description,
    )
    text = plan.summary()
    print(f"\n{text}")
    assert plan.num_replicas == 2
    assert f"spread max/min = {result.spread:.3f}" in text
    assert "Pipeline: 4 TaskGraphs, strategy PreferBackward" in text
    assert "node 22 'attn_3', node 43 'attn_6', node 64 'attn_9'" in text
    assert plan.stage_cost_spread == pytest.approx(result.spread)


def test_more_stages_than_blocks_is_an_error_naming_the_values(gpt):
    with pytest.raises(ValueError, match=r"Cannot cut 13 stages .* with 12 blocks.*at most 12"):
        auto_partition(gpt, 13)
    result = auto_partition(gpt, 12)
    assert result.num_stages == 12
    # Cutting inside blocks is possible when asked for.
    assert auto_partition(gpt, 13, cut_at="nodes").num_stages == 13


@pytest.mark.parametrize("num_stages", [0, -1])
def test_num_stages_below_one_is_an_error(gpt, num_stages):
    with pytest.raises(ValueError, match=rf"num_stages must be >= 1.*Received: {num_stages}"):
        auto_partition(gpt, num_stages)


@pytest.mark.parametrize("num_stages", [None, 2.0, "2", True])
def test_num_stages_must_be_an_int(gpt, num_stages):
    with pytest.raises(ValueError, match=r"num_stages must be an int >= 1.*Received"):
        auto_partition(gpt, num_stages)


def test_unknown_cut_at_is_an_error(gpt):
    with pytest.raises(ValueError, match=r"cut_at must be one of .*Received: cut_at='layers'"):
        auto_partition(gpt, 2, cut_at="layers")


def test_one_stage_has_no_cut(gpt):
    result = auto_partition(gpt, 1)
    assert result.cuts == ()
    assert result.spread == 1.0
    assert set(result.node_stage.values()) == {0}


def test_pre_norm_blocks_start_where_one_tensor_crosses():
    # The final LayerNormalization looks like a block's first LN, so the repeats could be
    # read with several offsets; the one whose boundaries carry one tensor (not the
    # residual pair) is chosen.
    model = transformer(blocks=4, pre_norm=True)
    result = auto_partition(model, 2)
    print(f"\n{result.describe()}")
    run = result.candidates.runs[0]
    assert (run.start, run.period, run.count) == (1, 7, 4)
    assert result.cut_names == ("pre_ln1_2",)
    assert result.boundary_bytes == (SEQ * HIDDEN * 4,)


# ------------------------------------------------------------------ custom layers
def test_custom_layer_blocks_are_repeated_single_nodes(custom_gpt, tokens):
    model = custom_gpt
    nodes = compute_nodes(model)
    runs = find_repeated_blocks(nodes)
    assert [(r.start, r.period, r.count) for r in runs] == [(1, 1, BLOCKS)]
    for num_stages in (2, 3, 4):
        result = auto_partition(model, num_stages)
        print(f"\n{result.describe()}")
        assert_valid_partition(model, result, num_stages)
        assert result.spread <= 1.25
        assert len({stop - start for start, stop in result.stage_ranges[1:-1]}) <= 1
    assert_forward_matches(model, result, 4, tokens)


def test_custom_block_cost_approximates_the_same_block_built_from_layers(gpt, custom_gpt):
    costs = {c.name: c for c in node_costs(custom_gpt)}
    plain = node_costs(gpt)[1 : 1 + BLOCK_NODES]
    assert costs["block_0"].params == sum(c.params for c in plain)
    assert costs["block_0"].flops == pytest.approx(sum(c.flops for c in plain), rel=0.05)


# ------------------------------------------------------------------ no repetition
def mlp(widths=(48, 96, 24, 64, 40, 3)) -> keras.Model:
    keras.utils.set_random_seed(0)
    x = inputs = keras.Input((16,), name="x")
    for i, width in enumerate(widths):
        x = keras.layers.Dense(width, activation="relu" if i < 5 else None, name=f"d{i}")(x)
    return keras.Model(inputs, x)


def test_mlp_without_repetition_is_balanced_over_every_boundary():
    model = mlp()
    nodes = compute_nodes(model)
    costs = nodes_cost(nodes)
    candidates = cut_candidates(nodes, costs)
    assert candidates.runs == ()
    assert candidates.positions == (1, 2, 3, 4, 5)
    result = auto_partition(model, 3)
    print(f"\n{result.describe()}")
    assert_valid_partition(model, result, 3)
    flops = [c.flops for c in costs]
    best = min(bottleneck(flops, cuts) for cuts in itertools.combinations(range(1, 6), 2))
    assert max(result.stage_costs) == best
    assert bottleneck(flops, result.cuts) == best
    x = np.random.default_rng(1).normal(size=(4, 16)).astype("float32")
    assert_forward_matches(model, result, 3, x)


def test_more_stages_than_nodes_is_an_error():
    with pytest.raises(ValueError, match=r"Cannot cut 7 stages .* with 6 compute nodes"):
        auto_partition(mlp(), 7)


def test_small_repeats_do_not_restrict_cuts():
    # Two equal Dense(8) layers repeat but carry a tiny share of the FLOPs.
    model = mlp(widths=(256, 8, 8, 8, 300, 3))
    nodes = compute_nodes(model)
    runs = find_repeated_blocks(nodes)
    assert [(r.start, r.period, r.count) for r in runs] == [(2, 1, 2)]  # found ...
    assert cut_candidates(nodes, nodes_cost(nodes)).positions == (1, 2, 3, 4, 5)  # ... not used


def test_sequential_models_are_partitioned():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,))] + [keras.layers.Dense(8, activation="tanh") for _ in range(4)]
    )
    result = auto_partition(model, 2)
    assert result.cuts == (2,)
    x = np.random.default_rng(2).normal(size=(3, 8)).astype("float32")
    assert_forward_matches(model, result, 2, x)


def test_a_stage_never_reads_the_output_of_a_layer_it_calls_again():
    """A shared layer may be called in two stages (its weights are tied: a copy per
    stage), but no stage may start between its first call and the layer reading that
    call's output when the layer is called again later (Keras cannot cut that stage)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    shared = keras.layers.Dense(8, activation="tanh", name="shared")
    x = shared(inputs)
    for i, width in enumerate((12, 20, 8)):
        x = keras.layers.Dense(width, activation="tanh", name=f"d{i}")(x)
    x = shared(x)
    model = keras.Model(inputs, keras.layers.Dense(2, name="out")(x))
    nodes = compute_nodes(model)
    candidates = cut_candidates(nodes, nodes_cost(nodes))
    assert candidates.positions == (2, 3, 4, 5)  # not before d0, which reads shared's output
    assert candidates.excluded_shared == 1
    result = auto_partition(model, 3)
    assert result.num_stages == 3
    with pytest.raises(
        ValueError,
        match=r"Cannot cut 6 stages.*a layer it calls again.*: layer 'shared' \(called 2 times\)",
    ):
        auto_partition(model, 6)
    x = np.random.default_rng(3).normal(size=(2, 8)).astype("float32")
    assert_forward_matches(model, result, 3, x)


def test_a_layer_called_for_every_block_is_named_when_no_cut_is_left():
    """ALBERT (KerasHub's AlbertBackbone) calls one transformer layer for every block, so
    no cut between its blocks can be made: the error names that layer. Before, it only
    said that cuts 'would give a stage the output of a layer it calls again, or split the
    users of a non-trainable weight (BatchNorm statistics)', of a model without one."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    x = keras.layers.Dense(8, name="embed")(inputs)  # not a block: another kernel shape
    shared = keras.layers.Dense(8, activation="tanh", name="shared_block")
    for _ in range(3):
        x = shared(x)
    model = keras.Model(inputs, keras.layers.Dense(2, name="out")(x))
    nodes = compute_nodes(model)
    candidates = cut_candidates(nodes, nodes_cost(nodes))
    assert candidates.positions == () and candidates.excluded_shared == 2
    assert candidates.excluded_layers == ("layer 'shared_block' (called 3 times)",)
    assert candidates.excluded_weights == ()
    with pytest.raises(ValueError, match=r"Cannot cut 2 stages") as error:
        auto_partition(model, 2)
    message = str(error.value)
    assert "a layer it calls again, which Keras cannot cut: layer 'shared_block'" in message
    assert "non-trainable" not in message
    # The hints hold (KerasHub's ALBERT, 2 stages by `stages=`, ended 0.0 from Keras).
    assert "cut_at='nodes'" in message and "EPLTrainer stages=" in message
    assert auto_partition(model, 2, cut_at="nodes").num_stages == 2


def test_users_of_a_tied_weight_may_be_cut_apart():
    """A nested model embeds the tokens; a later layer reads the same embedding matrix
    (GPT-2's tied embeddings in a KerasHub task): cuts may fall between them (each stage
    holds a copy). Before, every such cut was excluded."""
    keras.utils.set_random_seed(0)
    embedding = keras.layers.Embedding(20, 8, name="embed")
    inner_tokens = keras.Input((5,), dtype="int32")
    backbone = keras.Model(inner_tokens, embedding(inner_tokens), name="backbone")
    tokens = keras.Input((5,), dtype="int32")
    x = backbone(tokens)
    for i, width in enumerate((12, 8)):  # different widths: no repeated blocks
        x = keras.layers.Dense(width, activation="tanh", name=f"d{i}")(x)
    x = TiedLogits(embedding, name="tied")(x)
    model = keras.Model(tokens, keras.layers.Dense(3, name="out")(x))
    nodes = compute_nodes(model)
    candidates = cut_candidates(nodes, nodes_cost(nodes))
    assert candidates.positions == (1, 2, 3, 4)
    assert candidates.excluded_shared == 0
    result = auto_partition(model, 3)
    assert result.num_stages == 3
    x = np.random.default_rng(3).integers(0, 20, size=(2, 5)).astype("int32")
    assert_forward_matches(model, result, 3, x)


def test_users_of_a_non_trainable_weight_stay_in_one_stage():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    norm = keras.layers.BatchNormalization(name="bn")
    x = norm(inputs)
    for i, width in enumerate((12, 8)):
        x = keras.layers.Dense(width, activation="tanh", name=f"d{i}")(x)
    model = keras.Model(inputs, keras.layers.Dense(2, name="out")(norm(x)))
    nodes = compute_nodes(model)
    candidates = cut_candidates(nodes, nodes_cost(nodes))
    assert candidates.positions == (4,)  # before "out" only
    assert "non-trainable weight 'bn/moving_mean'" in candidates.excluded_weights
    assert auto_partition(model, 2).cut_names == ("out",)


def test_subclassed_model_cannot_be_cut():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    with pytest.raises(PartitionError, match="subclassed"):
        auto_partition(Net(), 2)


# ------------------------------------------------------------------ the DP alone
def test_balanced_cuts_is_exact_on_random_costs():
    rng = np.random.default_rng(0)
    for _ in range(20):
        costs = rng.integers(1, 100, size=9).tolist()
        candidates = sorted(rng.choice(np.arange(1, 9), size=5, replace=False).tolist())
        for stages in (2, 3, 4):
            cuts = balanced_cuts(costs, [0] * 9, candidates, stages)
            assert set(cuts) <= set(candidates) and len(cuts) == stages - 1
            options = itertools.combinations(candidates, stages - 1)
            best = min(bottleneck(costs, c) for c in options)
            assert bottleneck(costs, cuts) == best


def test_balanced_cuts_breaks_ties_by_parameter_balance():
    # Cutting at 1 or 3 gives the same largest cost (3); at 3 the params split 10/10,
    # at 1 they split 0/20.
    costs = [1, 1, 1, 1]
    params = [0, 10, 0, 10]
    assert balanced_cuts(costs, params, [1, 3], 2) == (3,)
    assert balanced_cuts(costs, [0, 0, 0, 0], [1, 3], 2) == (1,)  # earliest otherwise
    with pytest.raises(ValueError, match=r"num_stages must be in \[1, 3\].*Received"):
        balanced_cuts(costs, params, [1, 3], 4)


# ------------------------------------------------------------------ FLOP counts
def costs_by_name(model):
    return {c.name: c for c in node_costs(model)}


def test_dense_conv_embedding_and_norm_costs_by_hand():
    image = keras.Input((8, 8, 3))
    conv = keras.layers.Conv2D(4, 3, strides=1, padding="valid", name="conv")(image)
    strided = keras.layers.Conv2D(5, 3, strides=2, padding="same", name="strided")(conv)
    seq = keras.Input((5, 6))
    dense = keras.layers.Dense(7, name="dense")(seq)
    norm = keras.layers.LayerNormalization(name="norm")(dense)
    ids = keras.Input((5,), dtype="int32")
    embed = keras.layers.Embedding(50, 7, name="embed")(ids)
    model = keras.Model([image, seq, ids], [strided, norm, embed])
    costs = costs_by_name(model)
    # Conv2D: 2 * kernel volume * in_ch * out_ch * output positions (6x6, then 3x3).
    assert costs["conv"].flops == 2 * 3 * 3 * 3 * 4 * 6 * 6
    assert costs["strided"].flops == 2 * 3 * 3 * 4 * 5 * 3 * 3
    assert costs["conv"].params == 3 * 3 * 3 * 4 + 4
    # Dense: 2 * in * out per row, 5 rows.
    assert costs["dense"].flops == 2 * 6 * 7 * 5
    assert costs["dense"].params == 6 * 7 + 7
    assert costs["norm"].flops == 8 * 5 * 7
    assert costs["embed"].flops == 5 * 7
    assert costs["embed"].params == 50 * 7
    assert costs["embed"].activation_bytes == 5 * 7 * 4
    assert costs["conv"].activation_bytes == 6 * 6 * 4 * 4


def test_multi_head_attention_cost_by_hand():
    query, value = keras.Input((4, 8)), keras.Input((6, 10))
    attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3, value_dim=5, name="mha")
    model = keras.Model([query, value], attention(query, value))
    cost = costs_by_name(model)["mha"]
    heads, key_dim, value_dim, tq, tk = 2, 3, 5, 4, 6
    projections = 2 * heads * (tq * 8 * key_dim + tk * 10 * key_dim + tk * 10 * value_dim)
    scores = 2 * tq * tk * heads * key_dim
    softmax = 5 * tq * tk * heads
    weighted = 2 * tq * tk * heads * value_dim
    output = 2 * heads * value_dim * tq * 8
    assert cost.flops == projections + scores + softmax + weighted + output == 3952
    assert cost.params == sum(int(np.prod(w.shape)) for w in attention.weights)


def test_shared_layer_params_count_once_and_submodels_sum_their_nodes():
    inner_in = keras.Input((6,))
    inner = keras.Model(inner_in, keras.layers.Dense(4)(keras.layers.Dense(5)(inner_in)))
    inputs = keras.Input((6,))
    shared = keras.layers.Dense(6, name="shared")
    x = shared(shared(inputs))
    model = keras.Model(inputs, inner(x))
    costs = node_costs(model)
    assert [c.name for c in costs] == ["shared[0]", "shared[1]", inner.name]
    assert [c.params for c in costs] == [42, 0, 6 * 5 + 5 + 5 * 4 + 4]
    assert costs[1].flops == 2 * 6 * 6
    assert costs[2].flops == 2 * 6 * 5 + 2 * 5 * 4


def test_cost_summary_lists_every_node_and_totals(gpt):
    text = model_cost_summary(gpt)
    print(f"\n{text}")
    lines = text.splitlines()
    assert len(lines) == 3 + len(compute_nodes(gpt)) + 1
    assert lines[-1].split()[0] == "total"
    assert "MultiHeadAttention" in text and "head" in text


def test_boundary_bytes_count_residual_pairs(gpt):
    crossing = boundary_bytes(compute_nodes(gpt))
    one = SEQ * HIDDEN * 4
    assert crossing[1] == one  # after the embedding
    assert crossing[2] == 2 * one  # after attention: its output and the residual
    assert crossing[8] == one  # after the first block


def test_trainer_with_auto_parallel_matches_keras():
    """auto.auto_parallel + pipeline.num_stages: the trainer cuts, plans and trains."""
    import epl_trainer as epl

    rng = np.random.default_rng(1)
    x = rng.integers(0, VOCAB, size=(32, SEQ)).astype("int32")
    y = rng.integers(0, VOCAB, size=(32, SEQ)).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = transformer(blocks=4, seed=3)
    reference.compile(keras.optimizers.SGD(0.1), loss)
    reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)

    model = transformer(blocks=4, seed=3)
    trainer = epl.EPLTrainer(
        model,
        loss,
        keras.optimizers.SGD(0.1),
        config={
            "auto.auto_parallel": True,
            "pipeline.num_stages": 2,
            "pipeline.num_micro_batch": 2,
            "cluster.virtual_devices": 2,
        },
    )
    assert "Stage costs" in trainer.plan.summary() and "spread" in trainer.plan.summary()
    trainer.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(reference.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL)


def test_auto_parallel_refuses_manual_annotations_and_needs_num_stages():
    import epl_trainer as epl

    config = {"auto.auto_parallel": True, "cluster.virtual_devices": 2}
    with pytest.raises(ValueError, match=r"needs pipeline\.num_stages"):
        epl.EPLTrainer(transformer(blocks=2), "mse", "sgd", config=config)
    with pytest.raises(ValueError, match="do not also annotate"):
        epl.EPLTrainer(
            transformer(blocks=2),
            "mse",
            "sgd",
            stages={"embed": 0},
            config={**config, "pipeline.num_stages": 2},
        )
