"""Communication overlapped with backward: the structure of the traced training step.

Every gradient all-reduce must be free to start as soon as backward has produced its
bucket: it may not wait for the finiteness decision (no collective inside that
conditional or behind it), nor for the backward of earlier layers; and the buckets are
launched last layers first, the order in which backward produces them.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import epl_trainer as epl

LAYERS = 4  # dense_0 .. dense_3, then the head (layer index 4)


def trace_step(config):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    h = inputs
    for i in range(LAYERS):
        h = keras.layers.Dense(16, activation="relu", name=f"dense_{i}")(h)
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(h))
    trainer = epl.EPLTrainer(
        model,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.Adam(1e-3),
        config={"cluster.virtual_devices": 2, "communication.max_splits": LAYERS + 1, **config},
    )
    x, y = np.zeros((8, 16), "float32"), np.zeros(8, "int32")
    trainer.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=1, verbose=0, shuffle=False)
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
    program = trainer.engine.program
    return program.train_on_iterator.get_concrete_function(iter(dataset)).graph


def ancestors(op) -> set:
    """Every op `op` waits for: through its data inputs and its control inputs (a
    collective put behind the finite flag by `tf.control_dependencies` has no data edge
    to it)."""
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def gradient_ops(reduce_op) -> list:
    """The backward ops whose outputs a bucket's all-reduce carries (the first ops named
    `gradient_tape/...` on the way back from its input)."""
    found, stack, seen = [], [reduce_op.inputs[0].op], set()
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        if "gradient_tape/" in op.name:
            found.append(op)
        else:
            stack.extend(t.op for t in op.inputs)
    return found


def layer_of(op) -> int:
    found = re.search(r"/(dense_(\d)|head)_\d+/", op.name)
    return LAYERS if found.group(1) == "head" else int(found.group(2))


def lane0_reduces_in_launch_order(graph) -> list:
    """Collectives on one ordering chain run in program order; the instance key is taken
    at trace time in launch order (input 3 of CollectiveReduceV2)."""
    ops = [
        op
        for op in graph.get_operations()
        if op.type == "CollectiveReduceV2" and op.device.endswith("CPU:0")
    ]
    return sorted(ops, key=lambda op: int(tf.get_static_value(op.inputs[3])))


@pytest.mark.parametrize(
    "config",
    [{}, {"amp.level": "O1"}, {"pipeline.num_micro_batch": 2}],
    # 2 micro-batches: the first runs in a loop in the graph, the last after it, so the
    # reductions still overlap the last backward (LaneExecutor.run_in_loop).
    ids=["float32", "amp_float16", "micro_batch_loop"],
)
def test_gradient_all_reduces_do_not_wait_for_the_finite_flag_or_earlier_layers(config):
    graph = trace_step(config)
    operations = graph.get_operations()
    reduces = [op for op in operations if op.type == "CollectiveReduceV2"]
    # 2 lanes x 5 buckets, and nothing else: in data parallelism every lane decides
    # finiteness from the same reduced gradients, with no collective of its own.
    assert len(reduces) == 2 * (LAYERS + 1)
    decision = [op for op in operations if op.type in ("IsFinite", "If", "StatelessIf")]
    assert {op.type for op in decision} >= {"IsFinite"} and len(decision) > 1
    for op in reduces:
        assert not ancestors(op) & set(decision), f"{op.name} waits for the finite flag"

    launched = lane0_reduces_in_launch_order(graph)
    deepest = [max(layer_of(g) for g in gradient_ops(op)) for op in launched]
    assert deepest == sorted(deepest, reverse=True) and deepest[0] == LAYERS, deepest
    # The first bucket launched (the head's) does not need dense_0's weight gradient,
    # which the last one carries: it can run while backward still computes dense_0.
    first_layer_grads = {g for g in gradient_ops(launched[-1]) if layer_of(g) == 0}
    assert first_layer_grads
    assert not ancestors(launched[0]) & first_layer_grads


def test_ancestors_follow_control_dependencies():
    """The check above would miss an all-reduce that waits for the flag through a
    control dependency only, if `ancestors` followed data inputs alone."""

    @tf.function
    def step(x):
        finite = tf.reduce_all(tf.math.is_finite(x))
        with tf.control_dependencies([finite]):
            return tf.identity(x * 2.0, name="after_flag")

    graph = step.get_concrete_function(tf.TensorSpec([3])).graph
    after = graph.get_operation_by_name("after_flag")
    assert any(op.type == "IsFinite" for op in ancestors(after))
