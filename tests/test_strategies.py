"""Annotations: replicate/split scopes, set_default_strategy, the Strategy data form."""

import logging

import keras
import pytest

from epl_trainer.annotations.strategies import (
    NODE_ATTR,
    Strategy,
    current_scope,
    model_nodes,
    replicate,
    reset_annotations,
    resolve_annotation,
    set_default_strategy,
    split,
)
from epl_trainer.core.plan.ir import StrategySpec
from epl_trainer.core.plan.planner import build_plan


@pytest.fixture(autouse=True)
def _fresh_annotations():
    reset_annotations()
    yield
    reset_annotations()


def dense(name, units=4):
    return keras.layers.Dense(units, name=name)


def by_name(annotation) -> dict[str, list[int]]:
    """Layer name (or "add" for the `+` op) -> TaskGraph of each of its nodes, in order."""
    out: dict[str, list[int]] = {}
    for node, index in annotation.node_taskgraph.items():
        op = node.operation
        name = op.name if isinstance(op, keras.layers.Layer) else type(op).__name__.lower()
        out.setdefault(name, []).append(index)
    return out


def plain_model():
    """embed -> enc_1 -> enc_10 -> (enc_1 out + enc_10 out) -> head."""
    inputs = keras.Input((4,), name="x")
    h = dense("embed")(inputs)
    a = dense("enc_1")(h)
    b = dense("enc_10")(a)
    c = a + b
    outputs = dense("head", 2)(c)
    return keras.Model(inputs, outputs, name="plain")


# ------------------------------------------------------------------------- scopes
def test_scopes_record_nodes_with_skip_connection_and_shared_layer():
    shared = dense("shared")
    inputs = keras.Input((4,), name="x")
    with replicate(1, name="stage_0"):
        h = dense("d0")(inputs)
        h1 = shared(h)
    with replicate(1, name="stage_1"):
        h2 = dense("d1")(h1)
        h3 = shared(h2)
        outputs = dense("out")(h3 + h)  # skip connection from stage 0; an op in stage 1
    model = keras.Model(inputs, outputs)

    annotation = resolve_annotation(model)
    assert annotation.taskgraphs == (
        StrategySpec("replicate", 1, "stage_0"),
        StrategySpec("replicate", 1, "stage_1"),
    )
    assert by_name(annotation) == {"d0": [0], "shared": [0, 1], "d1": [1], "add": [1], "out": [1]}
    assert annotation.source == "scopes"
    assert len(annotation.node_taskgraph) == len(model_nodes(model)) == 6
    text = annotation.describe()
    assert "shared[0]" in text and "shared[1]" in text
    assert "1 stage_1" in text


def test_layers_before_any_scope_belong_to_the_first_taskgraph():
    inputs = keras.Input((4,))
    h = dense("early")(inputs)
    with split(2, name="body"):
        h = dense("d0")(h)
    with replicate(1, name="head"):
        outputs = dense("d1")(h)
    annotation = resolve_annotation(keras.Model(inputs, outputs))
    assert by_name(annotation) == {"early": [0], "d0": [0], "d1": [1]}
    assert annotation.taskgraphs[0] == StrategySpec("split", 2, "body")


def test_nodes_after_a_scope_join_the_last_replicate_taskgraph():
    inputs = keras.Input((4,))
    with replicate(1, name="s0"):
        h = dense("d0")(inputs)
    with replicate(1, name="s1"):
        h = dense("d1")(h)
    outputs = dense("loss_head")(h)
    annotation = resolve_annotation(keras.Model(inputs, outputs))
    assert by_name(annotation) == {"d0": [0], "d1": [1], "loss_head": [1]}


def test_reentering_a_scope_reuses_its_taskgraph():
    inputs = keras.Input((4,))
    stage_0 = replicate(1)
    with stage_0:
        h = dense("a")(inputs)
    with replicate(1, name="s1"):
        h = dense("b")(h)
    with stage_0:
        h = dense("c")(h)
    with replicate(1, name="s1"):
        h = dense("d")(h)
    annotation = resolve_annotation(keras.Model(inputs, h))
    assert by_name(annotation) == {"a": [0], "b": [1], "c": [0], "d": [1]}
    assert len(annotation.taskgraphs) == 2


def test_same_name_with_another_strategy_is_an_error():
    with replicate(1, name="s"):
        pass
    reopened = r"'s' was opened as replicate\(device_count=1, name='s'\).*split\(device_count=2"
    with pytest.raises(ValueError, match=reopened), split(2, name="s"):
        pass


def test_set_default_strategy_twice_gives_two_taskgraphs():
    inputs = keras.Input((4,))
    set_default_strategy(replicate(1))
    h = dense("stage0_layer")(inputs)
    set_default_strategy(replicate(1))
    outputs = dense("stage1_layer")(h)
    annotation = resolve_annotation(keras.Model(inputs, outputs))
    assert annotation.taskgraphs == (StrategySpec("replicate", 1, None),) * 2
    assert by_name(annotation) == {"stage0_layer": [0], "stage1_layer": [1]}
    plan = build_plan(
        annotation.taskgraphs, [[f"/device:CPU:{i}" for i in range(4)]], 0, num_micro_batch=2
    )
    assert [tg.name for tg in plan.taskgraphs] == ["taskgraph_0", "taskgraph_1"]
    assert plan.num_replicas == 2


def test_default_strategy_with_split_scope_moe_pattern():
    inputs = keras.Input((4,))
    set_default_strategy(replicate(8))
    h = dense("attention")(inputs)
    with split(8, name="moe"):
        h = dense("experts")(h)
    assert current_scope() == replicate(8)
    outputs = dense("combine")(h)
    annotation = resolve_annotation(keras.Model(inputs, outputs))
    assert by_name(annotation) == {"attention": [0], "experts": [1], "combine": [0]}


def test_strategies_do_not_nest():
    outer = replicate(1, name="outer")
    with outer:
        assert current_scope() is outer
        nested = r"do not nest.*split\(device_count=2\).*replicate\(device_count=1, name='outer'\)"
        with pytest.raises(ValueError, match=nested), split(2):
            pass
        with pytest.raises(ValueError, match="inside the `with replicate"):
            set_default_strategy(replicate(1))
    assert current_scope() is outer  # after exit: the last replicate TaskGraph


def test_untagged_model_is_plain_data_parallelism():
    annotation = resolve_annotation(plain_model())
    assert annotation.taskgraphs == (StrategySpec("replicate", 1, None),)
    assert set(annotation.node_taskgraph.values()) == {0}
    assert annotation.source == "default"


def test_reset_clears_recording_but_not_recorded_tags():
    inputs = keras.Input((4,))
    with replicate(1, name="s0"):
        h = dense("a")(inputs)
    reset_annotations()
    assert current_scope() is None
    outputs = dense("b")(h)
    assert getattr(outputs._keras_history.operation._inbound_nodes[0], NODE_ATTR) is None
    annotation = resolve_annotation(keras.Model(inputs, outputs))
    assert by_name(annotation) == {"a": [0], "b": [0]}


def test_model_built_from_intermediate_tensors_keeps_scope_tags():
    inputs = keras.Input((4,))
    with replicate(1, name="s0"):
        h = dense("a")(inputs)
    with replicate(1, name="s1"):
        h2 = dense("b")(h)
        outputs = dense("c")(h2)
    set_default_strategy(replicate(1, name="later"))  # must not leak into the clone
    sub = keras.Model(h, outputs)
    annotation = resolve_annotation(sub)
    assert annotation.taskgraphs == (StrategySpec("replicate", 1, "s1"),)
    assert by_name(annotation) == {"b": [0], "c": [0]}


@pytest.mark.parametrize("cls", [replicate, split])
def test_device_count_validation(cls):
    with pytest.raises(TypeError, match=r"device_count=1.5 of type float"):
        cls(1.5)
    with pytest.raises(TypeError, match=r"device_count=True"):
        cls(True)
    with pytest.raises(ValueError, match=r"must be >= 1. Received: device_count=0"):
        cls(0)
    with pytest.raises(TypeError, match="name=3"):
        cls(1, name=3)
    assert cls().device_count is None
    assert repr(cls(2, name="x")) == f"{cls.__name__}(device_count=2, name='x')"


def test_set_default_strategy_rejects_other_values():
    with pytest.raises(TypeError, match="Strategy mapping is passed to the trainer"):
        set_default_strategy(Strategy(stages={"a": 0}))
    with pytest.raises(TypeError, match="Received: 1"):
        set_default_strategy(1)


# ---------------------------------------------------------------------- data form
def test_strategy_stages_use_fullmatch():
    annotation = resolve_annotation(plain_model(), stages={"embed|enc_1": 0, "enc_10|head": 1})
    # "enc_1" does not match "enc_10"; the add op follows its latest input (stage 1).
    assert by_name(annotation) == {
        "embed": [0],
        "enc_1": [0],
        "enc_10": [1],
        "add": [1],
        "head": [1],
    }
    assert annotation.taskgraphs == (
        StrategySpec("replicate", 1, "stage_0"),
        StrategySpec("replicate", 1, "stage_1"),
    )
    assert annotation.source == "strategy"


def test_keras_op_inherits_the_latest_input_taskgraph():
    annotation = resolve_annotation(plain_model(), stages={"embed|enc_1|enc_10": 0, "head": 1})
    assert by_name(annotation)["add"] == [0]


def test_unmatched_layer_is_an_error():
    with pytest.raises(ValueError, match=r"Layer 'head' matches no stage or split pattern"):
        resolve_annotation(plain_model(), stages={"embed|enc_1": 0, "enc_10": 1})


def test_doubly_matched_layer_is_an_error():
    both = r"Layer 'enc_10' matches several patterns: stage 0 \('embed\|enc_.\*'\), stage 1"
    with pytest.raises(ValueError, match=both + r" \('enc_10\|head'\)"):
        resolve_annotation(plain_model(), stages={"embed|enc_.*": 0, "enc_10|head": 1})


def test_stage_matching_no_layer_is_an_error():
    with pytest.raises(ValueError, match=r"stage 1 \('encoder_9'\) matches no layer"):
        resolve_annotation(plain_model(), stages={".*": 0, "encoder_9": 1})


def test_stage_indices_must_be_contiguous():
    with pytest.raises(ValueError, match=r"stage 1 is missing"):
        Strategy(stages={"a": 0, "b": 2})
    with pytest.raises(ValueError, match=r"ints >= 0. Received: 'a': -1"):
        Strategy(stages={"a": -1})
    with pytest.raises(ValueError, match=r"Invalid regex 'enc\(' in stages"):
        Strategy(stages={"enc(": 0})
    with pytest.raises(ValueError, match=r"Invalid regex '\[' in split"):
        Strategy(split=["["])


def test_strategy_is_printable_and_matchable_without_a_model():
    strategy = Strategy(stages={"embed|enc_1": 0, "enc_10|head": 1}, split=["logits"])
    assert repr(strategy) == (
        "Strategy(default=replicate(device_count=None), stages={'embed|"
        "enc_1': 0, 'enc_10|head': 1}, split=('logits',))"
    )
    assert strategy.match("enc_10") == (("stage 1 ('enc_10|head')", 1),)
    assert strategy.match("logits") == (("split ('logits')", 2),)
    assert strategy.match("enc_100") == ()
    assert [s.name for s in strategy.taskgraph_specs()] == ["stage_0", "stage_1", "split"]
    assert strategy == Strategy(stages={"embed|enc_1": 0, "enc_10|head": 1}, split="logits")
    assert hash(strategy) == hash(
        Strategy(stages={"enc_10|head": 1, "embed|enc_1": 0}, split=["logits"])
    )


def test_bare_replicate_is_one_taskgraph():
    annotation = resolve_annotation(plain_model(), replicate(2))
    assert annotation.taskgraphs == (StrategySpec("replicate", 2, None),)
    assert set(annotation.node_taskgraph.values()) == {0}


def test_split_list_forms_a_split_taskgraph_after_the_default():
    annotation = resolve_annotation(plain_model(), split=["head"])
    # replicate(None): one device, or the split's devices when colocated (below).
    assert annotation.taskgraphs == (
        StrategySpec("replicate", None, None),
        StrategySpec("split", None, "split"),
    )
    assert by_name(annotation) == {
        "embed": [0],
        "enc_1": [0],
        "enc_10": [0],
        "add": [0],
        "head": [1],
    }
    plan = build_plan(
        annotation.taskgraphs,
        [[f"/device:CPU:{i}" for i in range(4)]],
        0,
        num_micro_batch=1,
        colocate_split_and_replicate=True,
    )
    assert plan.num_replicas == 1 and plan.taskgraphs[1].device_count == 4
    assert plan.taskgraphs[0].device_count == 4  # data parallel on the split's devices


def test_stages_and_split_together():
    annotation = resolve_annotation(
        plain_model(),
        Strategy(default=replicate(2), split=["head"]),
        stages={"embed|enc_1": 0, "enc_10": 1},
    )
    assert annotation.taskgraphs == (
        StrategySpec("replicate", 2, "stage_0"),
        StrategySpec("replicate", 2, "stage_1"),
        StrategySpec("split", None, "split"),
    )
    assert by_name(annotation)["head"] == [2]


def test_stages_given_twice_is_an_error():
    with pytest.raises(ValueError, match="Stages were given twice"):
        resolve_annotation(plain_model(), Strategy(stages={".*": 0}), stages={".*": 0})


def two_scoped_submodels():
    """EPL's `with replicate(...): model_part1()` in Keras: a sub-model built per scope."""
    with replicate(1, name="s0"):
        part1 = keras.Sequential([keras.Input((4,)), dense("a"), dense("b")], name="part1")
    with replicate(1, name="s1"):
        part2 = keras.Sequential([keras.Input((4,)), dense("c", 2)], name="part2")
    return part1, part2


def test_submodels_built_in_scopes_and_composed_outside_keep_their_taskgraphs():
    """Composed outside any scope, both calls inherited the last replicate TaskGraph: the
    model resolved to one TaskGraph 's1' and trained data parallel, the two stages
    silently dropped (before: taskgraphs == (s1,), nodes {'part1': [0], 'part2': [0]})."""
    part1, part2 = two_scoped_submodels()
    annotation = resolve_annotation(keras.Sequential([part1, part2]))
    assert [spec.name for spec in annotation.taskgraphs] == ["s0", "s1"]
    assert by_name(annotation) == {"part1": [0], "part2": [1]}
    # A call made inside a scope stays in that scope's TaskGraph.
    part1, part2 = two_scoped_submodels()
    inputs = keras.Input((4,))
    with replicate(1, name="s1"):
        outputs = part2(part1(inputs))
    assert by_name(resolve_annotation(keras.Model(inputs, outputs))) == {
        "part1": [0],
        "part2": [0],
    }


def test_a_nested_model_built_over_several_scopes_and_called_outside_is_refused():
    inputs = keras.Input((4,))
    with replicate(1, name="s0"):
        h = dense("a")(inputs)
    with replicate(1, name="s1"):
        inner = keras.Model(inputs, dense("b")(h), name="inner")
    outer_inputs = keras.Input((4,))
    outer = keras.Model(outer_inputs, inner(outer_inputs))
    with pytest.raises(ValueError, match=r"Nested model 'inner' .* several TaskGraphs"):
        resolve_annotation(outer)


def test_layers_constructed_in_a_scope_but_called_outside_warn(caplog):
    with replicate(1, name="s0"):
        a = dense("a")
    with replicate(1, name="s1"):
        b = dense("b")
    model = keras.Sequential([keras.Input((4,)), a, b])  # both called here: in s1
    with caplog.at_level(logging.WARNING, logger="epl_trainer.annotations.strategies"):
        annotation = resolve_annotation(model)
    assert [spec.name for spec in annotation.taskgraphs] == ["s1"]
    assert "name='s0')> were opened by replicate/split scopes but hold no layer" in caplog.text


def test_data_form_wins_over_scope_tags_with_a_warning(caplog):
    inputs = keras.Input((4,))
    with replicate(1, name="s0"):
        h = dense("a")(inputs)
    with replicate(1, name="s1"):
        outputs = dense("b")(h)
    with caplog.at_level(logging.WARNING, logger="epl_trainer.annotations.strategies"):
        annotation = resolve_annotation(keras.Model(inputs, outputs), stages={"a|b": 0})
    assert by_name(annotation) == {"a": [0], "b": [0]}
    assert "data form wins" in caplog.text


def test_sequential_and_subclassed_models():
    model = keras.Sequential([keras.Input((4,)), dense("s_a"), dense("s_b")])
    annotation = resolve_annotation(model, stages={"s_a": 0, "s_b": 1})
    assert by_name(annotation) == {"s_a": [0], "s_b": [1]}

    class Sub(keras.Model):
        def call(self, x):
            return x

    # A subclassed model has no layer graph: fine as one TaskGraph, an error with stages.
    whole = resolve_annotation(Sub())
    assert [spec.kind for spec in whole.taskgraphs] == ["replicate"]
    assert resolve_annotation(Sub(), strategy=replicate(2)).taskgraphs[0].device_count == 2
    with pytest.raises(TypeError, match="functional Keras model"):
        resolve_annotation(Sub(), stages={"a": 0})
