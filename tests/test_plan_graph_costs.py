"""epl-plan's costs of a Keras graph as the step-time model reads them: each layer's
matmuls by shape (core/graph/cost.py) and its elementwise bytes counted from the ops of
its traced training step (core/graph/traffic.py); and how bench/plan_accuracy.py times a
step."""

import dataclasses
import os
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from epl_trainer.core.graph import traffic
from epl_trainer.core.graph.auto_partition import model_cost
from epl_trainer.core.plan import devices, estimate, step_time

CPU = devices.device_by_name("cpu")
_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _traffic(model, features):
    return traffic.elementwise_traffic(
        model, tf.TensorSpec((1, *features)), tf.TensorSpec((1,), tf.int32),
        lambda y, p, w: _LOSS(y, p),
    )  # fmt: skip


def _model(*layers, features=(16, 32)):
    keras.utils.set_random_seed(0)
    inputs = keras.Input(features)
    h = inputs
    for layer in layers:
        h = layer(h)
    return keras.Model(inputs, h)


def test_elementwise_bytes_are_counted_op_by_op_from_the_traced_step():
    """Per sample and float32 output element (o = 16 x 32 here):

    * Dense(relu): forward BiasAdd (read o, write o) and Relu (read o, write o): 4 o;
      backward ReluGrad (read the upstream gradient and the output, write: 3 o) and
      BiasAddGrad (read o): 4 o.
    * LayerNormalization (Keras's ops.layer_normalization): forward the mean (read o), the
      squared difference (read o, write o), its mean (read o), the scale broadcast to o
      (write o), -mean x scale (read o, write o), + beta (read o, write o), x x scale
      (read 2 o, write o) and + the shift (read 2 o, write o): 15 o, plus the per-row
      mean and variance; "its output written and read once" counted 2.
    """
    model = _model(keras.layers.Dense(32, activation="relu", name="dense"),
                   keras.layers.LayerNormalization(name="norm"),
                   keras.layers.GlobalAveragePooling1D(name="pool"),
                   keras.layers.Dense(10, name="head"))  # fmt: skip
    counts = _traffic(model, (16, 32))
    out = 16 * 32 * 4
    assert counts["dense"] == (4 * out, 4 * out)
    forward, backward = counts["norm"]
    rows = 16 * 4  # the mean and variance per position: small tensors, counted too
    assert 15 * out < forward < 15 * out + 16 * rows
    assert 30 * out < backward < 40 * out  # its gradient: several times its forward
    assert counts["head"] == (2 * 10 * 4, 10 * 4)  # its bias only: no activation


def test_counts_go_to_the_graphs_nodes_and_time_the_elementwise_term():
    model = _model(keras.layers.Dense(32, activation="relu", name="dense"),
                   keras.layers.LayerNormalization(name="norm"),
                   keras.layers.GlobalAveragePooling1D(name="pool"),
                   keras.layers.Dense(10, name="head"))  # fmt: skip
    counts = _traffic(model, (16, 32))
    plain = model_cost(model)
    counted = traffic.with_elementwise_traffic(plain, counts)
    for node in counted.nodes:
        assert (node.elementwise_bytes, node.elementwise_backward_bytes) == counts[node.name]
    layout = step_time.Layout(micro_batch_size=8)
    terms = step_time.predict(counted, layout, CPU).terms
    moved = sum(sum(pair) for pair in counts.values()) * 8
    bandwidth = CPU.pool_rates(1)[1] * CPU.elementwise_factor(1)
    assert terms["elementwise"] == pytest.approx(moved / bandwidth)
    # Uncounted, a layer moved its output written and read once, backward twice that.
    outputs = sum(node.activation_bytes for node in plain.nodes)
    assert step_time.predict(plain, layout, CPU).terms["elementwise"] == pytest.approx(
        6 * outputs * 8 / bandwidth
    )


def test_a_shared_layers_calls_split_its_counts():
    shared = keras.layers.Dense(32, activation="relu", name="shared")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32,))
    outputs = keras.layers.Dense(10, name="head")(shared(shared(inputs)))
    model = keras.Model(inputs, outputs)
    counts = _traffic(model, (32,))
    assert counts["shared"] == (2 * 4 * 32 * 4, 2 * 4 * 32 * 4)  # both calls' ops
    nodes = traffic.with_elementwise_traffic(model_cost(model), counts).nodes
    assert [n.name for n in nodes[:2]] == ["shared[0]", "shared[1]"]
    assert nodes[0].elementwise_bytes == nodes[1].elementwise_bytes == 4 * 32 * 4


def test_attention_and_dense_layers_give_their_matmuls_by_shape():
    """Keras's MultiHeadAttention: three projections, per head the scores and the
    context (each sample's own products), the output projection; their FLOPs are the
    layer's but the softmax's."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((64, 128))
    attended = keras.layers.MultiHeadAttention(4, 32, name="attn")(tokens, tokens)
    up = keras.layers.Dense(512, activation="gelu", name="up")(attended)
    cost = model_cost(keras.Model(tokens, up))
    attention, dense = cost.nodes
    shapes = [(g.rows, g.n, g.k, g.count, g.stacked) for g in attention.gemms]
    assert shapes == [(64, 128, 128, 1, True)] * 3 + [
        (64, 64, 32, 4, False), (64, 32, 64, 4, False), (64, 128, 128, 1, True)
    ]  # fmt: skip
    assert attention.flops - sum(g.flops for g in attention.gemms) == 5 * 4 * 64 * 64
    assert [(g.rows, g.n, g.k) for g in dense.gemms] == [(64, 512, 128)]
    assert sum(g.flops for g in dense.gemms) == dense.flops


def test_einsum_dense_is_one_product_of_its_equation():
    keras.utils.set_random_seed(0)
    x = keras.Input((10, 24))
    y = keras.layers.EinsumDense("abc,cde->abde", (10, 3, 8), name="proj")(x)
    (node,) = model_cost(keras.Model(x, y)).nodes
    assert [(g.rows, g.n, g.k) for g in node.gemms] == [(10, 24, 24)]
    assert sum(g.flops for g in node.gemms) == node.flops


def test_a_residual_blocks_recompute_skips_its_last_projection_and_add():
    """What a layer's backward reads (core/graph/cost.py): a linear or GELU Dense's
    backward reads its input, not its output; a ReLU's reads its output; an add's reads
    neither. So a pre-LN feed-forward block recomputed as one segment runs its norm and
    its up-projection again, not its down-projection or the residual add."""
    keras.utils.set_random_seed(0)
    x = keras.Input((8, 32))
    h = keras.layers.LayerNormalization(name="norm")(x)
    h = keras.layers.Dense(64, activation="gelu", name="up")(h)
    h = keras.layers.Dense(32, name="down")(h)
    h = keras.layers.Add(name="add")([x, h])
    y = keras.layers.Dense(16, activation="relu", name="relu")(h)
    cost = model_cost(keras.Model(x, y))
    reads = {n.name: (n.backward_reads_output, n.backward_reads_inputs) for n in cost.nodes}
    assert reads == {"norm": (True, True), "up": (False, True), "down": (False, True),
                     "add": (False, False), "relu": (True, True)}  # fmt: skip
    single = dataclasses.replace(cost, checkpoint_positions=(4,))
    names = [cost.nodes[i].name for i in estimate.recomputed_nodes(single, 0, len(cost.nodes))]
    assert names == ["norm", "up", "relu"]


# ------------------------------------------------------------------ the bench's step clock
def _bench_module():
    bench = os.path.join(os.path.dirname(__file__), os.pardir, "bench")
    sys.path.insert(0, os.path.abspath(bench))
    try:
        import plan_accuracy
    finally:
        sys.path.pop(0)
    return plan_accuracy


def test_the_bench_times_steps_not_what_a_fit_call_does_once(monkeypatch):
    """Each fit call copies the weights into the trainer at its start and back at its
    end: plan_accuracy.py's per-step time leaves them out (timed whole over 5 steps,
    ZeRO v2's copies, which cut and join every variable's pieces, added 40-90 ms a step
    to the transformer's 80)."""
    import epl_trainer as epl

    plan_accuracy = _bench_module()
    model = _model(keras.layers.Dense(8, name="dense"), features=(8,))
    trainer = epl.EPLTrainer(model, keras.losses.MeanSquaredError(), keras.optimizers.SGD(0.1),
                             config={"cluster.virtual_devices": 2}, jit_compile=False)  # fmt: skip
    x = np.ones((16, 8), "float32")
    dataset = tf.data.Dataset.from_tensors((x, x)).repeat()
    trainer.fit(dataset, steps_per_epoch=2, verbose=0)
    runtime = trainer.runtime
    slow_copies = runtime.load_from_model

    def load_slowly(*args, **kwargs):
        time.sleep(0.2)
        return slow_copies(*args, **kwargs)

    monkeypatch.setattr(runtime, "load_from_model", load_slowly)
    start = time.perf_counter()
    trainer.fit(dataset, steps_per_epoch=4, verbose=0)
    whole = (time.perf_counter() - start) / 4
    step = plan_accuracy.fit_step_seconds(trainer, dataset, 4)
    assert whole > 0.1  # two slow copies per fit call, over 4 steps
    assert step < 0.05
