"""Stateful ops that touch no resource are ordered per lane (core/engine/lane_order.py):
an assert of lane 1 never waits for one of lane 0, while each lane's asserts keep their
program order, and ops outside every lane keep TF's single chain."""

import tensorflow as tf

from epl_trainer.core.engine.lane_order import traced_as_lane


def _is_assert(op) -> bool:
    return op.name.endswith("/AssertGuard")  # the If op tf.debugging asserts trace as


def _asserts_by_name(graph) -> dict:
    return {op.name.split("/")[0]: op for op in graph.get_operations() if _is_assert(op)}


def _checked(x, name):
    with tf.name_scope(name):
        return tf.debugging.assert_less(x, 10.0)


def test_each_lanes_asserts_wait_only_for_their_own_lanes():
    @tf.function(autograph=False)
    def step(x):
        _checked(x, "outside_first")
        for task in range(2):
            for lane in range(2):
                with traced_as_lane(lane):
                    _checked(x, f"lane{lane}_task{task}")
        _checked(x, "outside_last")
        return x

    graph = step.get_concrete_function(tf.TensorSpec([], tf.float32)).graph
    asserts = _asserts_by_name(graph)

    def waits_for(name) -> set:
        return {c.name.split("/")[0] for c in asserts[name].control_inputs if _is_assert(c)}

    assert waits_for("lane0_task0") == set()
    assert waits_for("lane1_task0") == set()  # was: lane0_task0, traced just before it
    assert waits_for("lane0_task1") == {"lane0_task0"}  # was: lane1_task0
    assert waits_for("lane1_task1") == {"lane1_task0"}
    assert waits_for("outside_last") == {"outside_first"}


def test_nested_lane_contexts_use_the_innermost_and_eager_code_is_untouched():
    @tf.function(autograph=False)
    def step(x):
        with traced_as_lane(0):
            _checked(x, "lane0_first")
            with traced_as_lane(1):
                _checked(x, "lane1_inner")
            _checked(x, "lane0_second")
        return x

    graph = step.get_concrete_function(tf.TensorSpec([], tf.float32)).graph
    asserts = _asserts_by_name(graph)
    assert [c.name.split("/")[0] for c in asserts["lane0_second"].control_inputs] == ["lane0_first"]
    assert not [c for c in asserts["lane1_inner"].control_inputs if _is_assert(c)]
    with traced_as_lane(3):  # eagerly: nothing to order, nothing recorded
        tf.debugging.assert_less(1.0, 10.0)
