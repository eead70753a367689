"""Cutting a Keras functional graph into one sub-model per stage (core/graph/partition.py).

Every cut is checked numerically against the unpartitioned model (`forward(x)` equals
`model(x)`), and structurally through the routing keys of each stage.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from epl_trainer.annotations.strategies import replicate, reset_annotations, resolve_annotation
from epl_trainer.core.graph.partition import (
    PartitionError,
    compute_nodes,
    partition_model,
    tensor_key,
    whole_model,
)

ATOL = 1e-6


@pytest.fixture(autouse=True)
def clean_annotations():
    # Scope recording is process-global: keep scopes of one test out of the next.
    reset_annotations()
    yield
    reset_annotations()


def data(*shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype("float32")


def assign(model, stage_by_name):
    """node -> stage from {operation name: stage, or [stage per call] for a shared layer}."""
    calls: dict[str, int] = {}
    mapping = {}
    for node in compute_nodes(model):
        stage = stage_by_name[node.operation.name]
        if isinstance(stage, list):
            call = calls.get(node.operation.name, 0)
            calls[node.operation.name] = call + 1
            stage = stage[call]
        mapping[node] = stage
    return mapping


def by_output(model, stages_of_tensors, default):
    """node -> stage from [(output tensor, stage)]; every other node goes to `default`.

    For Keras ops on KerasTensors, whose auto-generated names are not stable."""
    stage_of = {id(tensor): stage for tensor, stage in stages_of_tensors}
    return {node: stage_of.get(id(node.outputs[0]), default) for node in compute_nodes(model)}


def skeleton(structure):
    """The containers of a structure (dict keys, list vs tuple) without its leaves."""
    return keras.tree.map_structure(lambda _: None, structure)


def assert_forward_matches(staged, model, x):
    expected, actual = model(x), staged.forward(x)
    assert skeleton(actual) == skeleton(expected)
    for got, want in zip(keras.tree.flatten(actual), keras.tree.flatten(expected), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=ATOL)
    return actual


def ids(variables):
    return [id(v) for v in variables]


# ------------------------------------------------------------------- routing
def skip_model():
    inputs = keras.Input((4,), name="x")
    h0 = keras.layers.Dense(8, activation="relu", name="d0")(inputs)
    h1 = keras.layers.Dense(8, activation="relu", name="d1")(h0)
    h2 = keras.layers.Dense(8, name="d2")(h1)
    outputs = keras.layers.Dense(3, name="head")(h2 + h0)  # h0 skips stage 1
    return keras.Model(inputs, outputs), {"h0": h0, "h1": h1, "h2": h2, "outputs": outputs}


def test_skip_connection_is_routed_directly_to_the_consuming_stage():
    model, t = skip_model()
    staged = partition_model(model, by_output(model, [(t["h0"], 0), (t["h1"], 1)], 2), 3)

    assert_forward_matches(staged, model, data(5, 4))
    h0, h1 = tensor_key(t["h0"]), tensor_key(t["h1"])
    stage0, stage1, stage2 = staged.stages
    assert stage0.input_keys == staged.input_keys
    assert stage0.output_keys == (h0,)
    # Stage 1 neither receives nor returns h0: no pass-through.
    assert stage1.input_keys == (h0,)
    assert stage1.output_keys == (h1,)
    assert set(stage2.input_keys) == {h0, h1}
    assert stage2.output_keys == staged.output_keys == (tensor_key(t["outputs"]),)
    assert [layer.name for layer in stage1.model.layers if layer.weights] == ["d1"]


def test_callable_node_stage():
    model, _ = skip_model()
    order = {node: i for i, node in enumerate(compute_nodes(model))}
    staged = partition_model(model, lambda node: min(order[node], 1), 2)
    assert staged.stages[0].layer_names == ("d0",)
    assert_forward_matches(staged, model, data(3, 4))


# ------------------------------------------------------------------- shared layers
def shared_model():
    inputs = keras.Input((4,))
    shared = keras.layers.Dense(4, activation="tanh", name="shared")
    h = keras.layers.Dense(4, name="pre")(inputs)
    outputs = keras.layers.Dense(2, name="head")(shared(shared(h)))
    return keras.Model(inputs, outputs)


def test_shared_layer_called_twice_in_one_stage():
    model = shared_model()
    assert [n.operation.name for n in compute_nodes(model)] == ["pre", "shared", "shared", "head"]
    staged = partition_model(model, assign(model, {"pre": 0, "shared": [1, 1], "head": 1}), 2)
    assert_forward_matches(staged, model, data(3, 4))
    shared = model.get_layer("shared")
    stage1_vars = ids(staged.stages[1].model.trainable_variables)
    assert stage1_vars.count(id(shared.kernel)) == 1
    assert id(shared.kernel) not in ids(staged.stages[0].model.trainable_variables)


def test_a_trainable_weight_used_by_two_stages_is_listed_by_both():
    """Tied weights: a layer called in stage 0 and again in stage 1 (on an output of
    another layer) gives both sub-models its kernel; the engine holds a copy per stage.
    Before: "Weight 'shared/kernel' is used by stage 0 and stage 1" (PartitionError)."""
    inputs = keras.Input((4,))
    shared = keras.layers.Dense(4, activation="tanh", name="shared")
    h = keras.layers.Dense(4, name="mid")(shared(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(shared(h)))
    staged = partition_model(model, assign(model, {"shared": [0, 1], "mid": 0, "head": 1}), 2)
    kernel = id(model.get_layer("shared").kernel)
    for stage in staged.stages:
        assert kernel in ids(stage.model.trainable_variables)
    assert_forward_matches(staged, model, data(3, 4))


def test_a_layer_whose_output_feeds_its_call_in_the_next_stage_is_refused():
    model = shared_model()  # shared(shared(h)): stage 1 would read the first call's output
    mapping = assign(model, {"pre": 0, "shared": [0, 1], "head": 1})
    with pytest.raises(
        PartitionError, match=r"Layer 'shared' is called in stage 0 and again in stage 1"
    ):
        partition_model(model, mapping, 2)


def test_a_non_trainable_weight_used_by_two_stages_names_the_weight():
    inputs = keras.Input((4,))
    norm = keras.layers.BatchNormalization(name="bn")
    h = keras.layers.Dense(4, name="mid")(norm(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(norm(h)))
    mapping = assign(model, {"bn": [0, 1], "mid": 0, "head": 1})
    with pytest.raises(
        PartitionError, match=r"Non-trainable weight 'bn/moving_mean' is used by stage 0 and"
    ):
        partition_model(model, mapping, 2)


def test_weightless_shared_layer_across_stages_is_a_partition_error():
    # Keras cannot cut a stage whose input comes from a layer it also calls.
    inputs = keras.Input((4,))
    act = keras.layers.Activation("tanh", name="act")
    h = act(keras.layers.Dense(4, name="d0")(inputs))
    model = keras.Model(inputs, act(keras.layers.Dense(4, name="d1")(h)))
    mapping = assign(model, {"d0": 0, "act": [0, 1], "d1": 1})
    with pytest.raises(
        PartitionError, match=r"Layer 'act' is called in stage 0 and again in stage 1"
    ):
        partition_model(model, mapping, 2)


# ------------------------------------------------------------------- structures
def test_dict_inputs_and_dict_outputs_from_two_stages():
    a = keras.Input((3,), name="a")
    b = keras.Input((2,), name="b")
    ha = keras.layers.Dense(4, name="ha")(a)
    hb = keras.layers.Dense(4, name="hb")(b)
    joined = ha + hb
    first = keras.layers.Dense(1, name="first")(joined)
    second = keras.layers.Dense(2, name="second")(keras.ops.concatenate([joined, ha], axis=-1))
    # Keys in non-sorted order on purpose: structures are flattened by sorted key.
    model = keras.Model({"b": b, "a": a}, {"y": second, "x": first})
    stage0 = [(ha, 0), (hb, 0), (joined, 0), (first, 0)]
    staged = partition_model(model, by_output(model, stage0, 1), 2)

    x = {"a": data(5, 3, seed=1), "b": data(5, 2, seed=2)}
    out = assert_forward_matches(staged, model, x)
    assert set(out) == {"x", "y"}
    assert out["x"].shape == (5, 1) and out["y"].shape == (5, 2)
    assert tensor_key(first) in staged.stages[0].output_keys
    assert tensor_key(second) in staged.stages[1].output_keys


def test_list_inputs_with_a_model_input_used_only_by_the_last_stage():
    a = keras.Input((3,), name="a")
    b = keras.Input((2,), name="b")
    h = keras.layers.Dense(4, name="h")(a)
    early = keras.layers.Dense(2, name="early")(h)
    late = keras.layers.Dense(2, name="late")(keras.ops.concatenate([h, b], axis=-1))
    model = keras.Model([a, b], [early, late])
    staged = partition_model(model, by_output(model, [(h, 0), (early, 0)], 1), 2)

    out = assert_forward_matches(staged, model, [data(4, 3, seed=3), data(4, 2, seed=4)])
    assert isinstance(out, list) and len(out) == 2
    assert tensor_key(b) not in staged.stages[0].input_keys
    assert tensor_key(b) in staged.stages[1].input_keys
    # Cutting a stage that mixes a model Input with intermediate tensors makes Keras
    # rewrite that Input's history; keys must not change, even over repeated cuts.
    again = partition_model(model, by_output(model, [(h, 0), (early, 0)], 1), 2)
    assert again.input_keys == staged.input_keys == (("a", 0, 0), ("b", 0, 0))
    assert [s.input_keys for s in again.stages] == [s.input_keys for s in staged.stages]
    assert_forward_matches(again, model, [data(4, 3, seed=5), data(4, 2, seed=6)])


def test_keras_ops_inside_and_across_stages():
    inputs = keras.Input((4,))
    h = keras.layers.Dense(6, name="h")(inputs)
    left, right = keras.ops.split(h, 2, axis=-1)  # one op, two outputs
    q = keras.layers.Dense(3, name="q")(left)
    r = keras.layers.Dense(3, name="r")(right)
    mixed = keras.ops.concatenate([q * r, q + r], axis=-1)
    outputs = keras.ops.tanh(mixed) * 2.0
    model = keras.Model(inputs, outputs)
    staged = partition_model(model, by_output(model, [(h, 0), (left, 0), (q, 0)], 1), 2)

    assert_forward_matches(staged, model, data(3, 4))
    # The second output of `split` crosses the boundary, the first stays in stage 0.
    assert tensor_key(right) in staged.stages[1].input_keys
    assert tensor_key(left) not in staged.stages[1].input_keys
    assert tensor_key(right)[2] == 1


# ------------------------------------------------------------------- annotations
def test_sequential_cut_by_regex_stages():
    model = keras.Sequential(
        [keras.Input((4,))]
        + [keras.layers.Dense(5, activation="relu", name=f"block_{i}") for i in range(4)]
        + [keras.layers.Dense(2, name="head")]
    )
    annotation = resolve_annotation(model, stages={"block_[01]": 0, "block_[23]|head": 1})
    staged = partition_model(model, annotation.node_taskgraph, len(annotation.taskgraphs))
    assert [s.layer_names for s in staged.stages] == [
        ("block_0", "block_1"),
        ("block_2", "block_3", "head"),
    ]
    assert_forward_matches(staged, model, data(3, 4))


def test_stages_from_replicate_scopes():
    inputs = keras.Input((4,))
    with replicate(1, name="stage_0"):
        a = keras.layers.Dense(8, name="s0")(inputs)
    with replicate(1, name="stage_1"):
        b = keras.layers.Dense(8, name="s1")(a)
        c = b + a
    with replicate(1, name="stage_2"):
        outputs = keras.layers.Dense(2, name="s2")(keras.ops.relu(c))
    model = keras.Model(inputs, outputs)

    annotation = resolve_annotation(model)
    assert [spec.name for spec in annotation.taskgraphs] == ["stage_0", "stage_1", "stage_2"]
    staged = partition_model(model, annotation.node_taskgraph, len(annotation.taskgraphs))
    assert [s.layer_names[0] for s in staged.stages] == ["s0", "s1", "relu"]
    assert staged.stages[1].output_keys == (tensor_key(c),)
    assert_forward_matches(staged, model, data(3, 4))


# ------------------------------------------------------------------- errors
def chain_model(n=3):
    inputs = keras.Input((4,))
    x = inputs
    for i in range(n):
        x = keras.layers.Dense(4, name=f"d{i}")(x)
    return keras.Model(inputs, x)


def test_backward_edge_is_rejected():
    model = chain_model()
    mapping = assign(model, {"d0": 1, "d1": 0, "d2": 1})
    with pytest.raises(
        PartitionError,
        match=r"Stage 0 \(layer 'd1'\) consumes 'd0', an output of the later stage 1",
    ):
        partition_model(model, mapping, 2)


def test_empty_stage_is_rejected():
    model = chain_model()
    mapping = assign(model, {"d0": 0, "d1": 2, "d2": 2})
    with pytest.raises(PartitionError, match=r"Stage 1 of 3 has no layers"):
        partition_model(model, mapping, 3)


@pytest.mark.parametrize("bad", [2, -1])
def test_out_of_range_stage_is_rejected(bad):
    model = chain_model()
    mapping = assign(model, {"d0": 0, "d1": 1, "d2": bad})
    with pytest.raises(
        PartitionError,
        match=rf"'d2' was assigned to stage {bad}, but there are 2 stages \(0\.\.1\)",
    ):
        partition_model(model, mapping, 2)


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__(name="subclassed")
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


def test_subclassed_model_is_rejected_but_runs_as_one_stage():
    model = Subclassed()
    x = data(3, 4)
    model(x)
    with pytest.raises(PartitionError, match=r"'subclassed' \(Subclassed\) is a subclassed model"):
        partition_model(model, {}, 1)
    staged = whole_model(model)
    assert len(staged.stages) == 1
    np.testing.assert_allclose(staged.forward(x), model(x), atol=ATOL)


# ------------------------------------------------------------------- variables and engine use
def stateful_model():
    """Three stages with a shared layer, BatchNorm (non-trainable state), a frozen layer."""
    inputs = keras.Input((4,))
    h = keras.layers.Dense(6, name="d0")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    shared = keras.layers.Dense(6, activation="tanh", name="shared")
    h = shared(shared(h))
    frozen = keras.layers.Dense(6, name="frozen")
    frozen.trainable = False
    h = frozen(h) + h
    outputs = keras.layers.Dense(2, name="head")(h)
    model = keras.Model(inputs, outputs)
    bn = model.get_layer("bn")  # non-trivial statistics so BN is not an identity
    bn.moving_mean.assign(np.linspace(-1, 1, 6).astype("float32"))
    bn.moving_variance.assign(np.linspace(0.5, 2, 6).astype("float32"))
    mapping = {}
    for node in compute_nodes(model):
        name = node.operation.name
        mapping[node] = 0 if name in ("d0", "bn") else 1 if name in ("shared", "frozen") else 2
    return model, partition_model(model, mapping, 3), mapping


def test_stage_variables_are_their_layers_disjoint_and_complete():
    model, staged, mapping = stateful_model()
    expected = [{}, {}, {}]
    for node, stage in mapping.items():
        for v in getattr(node.operation, "trainable_variables", ()):
            expected[stage][id(v)] = v
    seen = []
    for stage in staged.stages:
        got = ids(stage.model.trainable_variables)
        assert len(got) == len(set(got)), f"stage {stage.index} lists a variable twice"
        assert set(got) == set(expected[stage.index]), f"stage {stage.index}"
        seen += got
    assert len(seen) == len(set(seen))  # disjoint across stages
    assert sorted(seen) == sorted(ids(model.trainable_variables))
    non_trainable = [v for s in staged.stages for v in ids(s.model.non_trainable_variables)]
    assert sorted(non_trainable) == sorted(ids(model.non_trainable_variables))
    assert {v.path for v in staged.stages[1].model.non_trainable_variables} == {
        "frozen/kernel",
        "frozen/bias",
    }


def test_stateless_call_per_stage_reproduces_forward():
    model, staged, _ = stateful_model()
    x = data(5, 4)
    expected = staged.forward(x)
    np.testing.assert_allclose(expected, model(x), atol=ATOL)

    values = dict(zip(staged.input_keys, staged.flatten_inputs(x)))
    for stage in staged.stages:
        sub = stage.model
        trainable = [v.value for v in sub.trainable_variables]
        non_trainable = [v.value for v in sub.non_trainable_variables]
        with tf.device(f"/device:CPU:{stage.index}"):  # as the engine places stages
            outputs, new_non_trainable = sub.stateless_call(
                trainable, non_trainable, staged.stage_arguments(stage, values), training=False
            )
        assert len(new_non_trainable) == len(non_trainable)
        values.update(staged.stage_results(stage, outputs))
    actual = staged.pack_outputs([values[k] for k in staged.output_keys])
    np.testing.assert_allclose(actual, expected, atol=ATOL)

    # The call really uses the values it is given, not the variables.
    head = staged.stages[2].model
    zeros = [tf.zeros_like(v.value) for v in head.trainable_variables]
    outputs, _ = head.stateless_call(zeros, [], staged.stage_arguments(staged.stages[2], values))
    np.testing.assert_allclose(keras.tree.flatten(outputs)[0], 0.0, atol=ATOL)
