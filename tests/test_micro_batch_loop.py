"""Micro-batches of a one-stage lane run as a loop in the graph (program.py,
`LaneExecutor.run_in_loop`): the traced step does not grow with them, and it trains
exactly as the step that emits every micro-batch on its own."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import epl_trainer as epl

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def tokens_model(seed=0):
    """Embedding (sparse gradients), Dropout (seed state), BatchNorm (moving statistics)."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(40, 8, name="embed")(tokens)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(16, activation="relu", name="body")(h)
    h = keras.layers.Dropout(0.3, seed=3)(h)
    h = keras.layers.BatchNormalization(name="norm")(h)
    return keras.Model(tokens, keras.layers.Dense(4, name="head")(h))


def tokens_data(rows=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 40, (rows, 6)).astype("int32")
    return x, (x[:, 0] % 4).astype("int32")


def trainer_for(model, micro_batches, devices=1, **config):
    return epl.EPLTrainer(
        model,
        LOSS,
        keras.optimizers.Adam(0.01, global_clipnorm=0.5),
        metrics=["accuracy"],
        config={
            "cluster.virtual_devices": devices,
            "pipeline.num_micro_batch": micro_batches,
            **config,
        },
    )


def step_graph(trainer, x, y, batch_size=16):
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
    engine = trainer.runtime.ensure_for(dataset)
    return engine.program.train_on_iterator.get_concrete_function(iter(dataset)).graph


def graph_ops(graph) -> int:
    library = graph.as_graph_def().library
    return len(graph.get_operations()) + sum(len(f.node_def) for f in library.function)


def test_the_traced_step_does_not_grow_with_micro_batches():
    x, y = tokens_data()
    sizes = {}
    for micro_batches in (2, 8):
        trainer = trainer_for(tokens_model(), micro_batches)
        assert trainer.runtime.ensure_for(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        ).program.loops_micro_batches
        sizes[micro_batches] = graph_ops(step_graph(trainer, x, y))
    assert sizes[2] == sizes[8], sizes


@pytest.mark.parametrize(
    "devices, config",
    # One device, no other feature, is left to the gradient-checkpointing cell (the same
    # single lane's loop, its micro-batches recomputed) and the plain 2-device cell (the
    # same loop in each lane). Trimmed for the suite's time: (1, {}).
    [
        (2, {}),  # data parallel: each lane loops, the sparse rows are gathered after
        (2, {"communication.sparse_as_dense": True}),
        pytest.param(
            2,
            {"amp.level": "O1", "amp.dtype": "bfloat16"},
            marks=pytest.mark.combines("amp+data_parallel"),
        ),
        pytest.param(
            1,
            {"gradient_checkpoint.type": "auto"},
            marks=pytest.mark.combines("gradient_checkpoint+one_device"),
        ),
        pytest.param(  # sharded optimizer states take the summed gradients
            2, {"zero.level": "v0"}, marks=pytest.mark.combines("zero_v0+data_parallel")
        ),
    ],
)
def test_the_loop_trains_as_the_unrolled_step(devices, config):
    x, y = tokens_data()
    runs = {}
    for looped in (True, False):
        model = tokens_model()
        trainer = trainer_for(model, 4, devices, **config)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        program = trainer.runtime.ensure_for(dataset).program
        assert program.loops_micro_batches
        if not looped:  # before the first trace: the step every other mode emits
            program._emit_lanes = program._emit_lanes_one_by_one
        history = trainer.fit(dataset, epochs=2, verbose=0)
        runs[looped] = (model.get_weights(), history.history)
    (looped_weights, looped_logs), (unrolled_weights, unrolled_logs) = runs[True], runs[False]
    for a, b in zip(looped_weights, unrolled_weights):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(looped_logs[name], unrolled_logs[name], rtol=1e-6)


def test_pipelines_and_sharded_gradients_emit_each_micro_batch():
    x, y = tokens_data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    for devices, config, stages in (
        (2, {"zero.level": "v1"}, None),  # each micro-batch is reduce-scattered on its own
        (2, {"zero.level": "v2"}, None),
        (2, {}, {"embed|flatten.*|body": 0, "dropout.*|norm|head": 1}),  # a pipeline
    ):
        model = tokens_model()
        trainer = epl.EPLTrainer(
            model,
            LOSS,
            keras.optimizers.Adam(0.01),
            stages=stages,
            config={"cluster.virtual_devices": devices, "pipeline.num_micro_batch": 4, **config},
        )
        assert not trainer.runtime.ensure_for(dataset).program.loops_micro_batches
