"""communication.*: buckets, communicators, fp16 wire and sparse gradients, end to end.

(Bucket planning itself is unit-tested in test_comm.py; clip before/after in
test_trainer_parity.py.)
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _models import LOSS, keras_reference, max_weight_difference, mlp_data

import epl_trainer as epl


def deep_mlp(seed=0, layers=6):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,), name="x")
    h = inputs
    for i in range(layers):
        h = keras.layers.Dense(8 + 4 * i, activation="tanh", name=f"dense_{i}")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))


def embedding_model(seed=0):
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((5,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(50, 8, name="embed")(tokens)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(tokens, keras.layers.Dense(3, name="logits")(h))


def token_data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    # Few distinct tokens: rows repeat within and across replicas.
    return rng.integers(0, 12, size=(n, 5)).astype("int32"), rng.integers(0, 3, n).astype("int32")


def trainer_for(model, optimizer=None, devices=2, jit_compile=None, **config):
    return epl.EPLTrainer(
        model,
        LOSS,
        optimizer or keras.optimizers.SGD(0.1),
        jit_compile=jit_compile,
        config={"cluster.virtual_devices": devices, **config},
    )


def step_graph(trainer, x, y, batch_size=16):
    trainer.fit(x, y, batch_size=batch_size, steps_per_epoch=1, verbose=0, shuffle=False)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size, drop_remainder=True)
    return trainer.engine.program.train_on_iterator.get_concrete_function(iter(dataset)).graph


def all_ops(graph):
    """Every op of a graph and of the functions it calls (e.g. a tf.cond's branches: the
    update runs inside one, skipped when gradients are not finite)."""
    for op in graph.get_operations():
        yield op
        for attr in ("then_branch", "else_branch", "f", "body", "cond"):
            try:
                name = op.get_attr(attr).name
            except (ValueError, AttributeError):
                continue
            function = graph._get_function(name)
            if function is not None and hasattr(function, "graph"):
                yield from all_ops(function.graph)


def collectives(graph, op_type, device_suffix="CPU:0"):
    """The gradient collectives on one device (scalar ones, e.g. the finiteness vote,
    left out)."""
    return [
        op
        for op in all_ops(graph)
        if op.type == op_type
        and op.device.endswith(device_suffix)
        and op.inputs[0].shape.num_elements() != 1
    ]


@pytest.mark.parametrize("max_splits,expected", [(1, 1), (5, 5), (60, 14)])
def test_one_all_reduce_per_bucket(max_splits, expected):
    """14 gradients (7 kernels, 7 biases) of one dtype: min(max_splits, 14) buckets,
    each one collective on each device."""
    x, y = mlp_data()
    trainer = trainer_for(deep_mlp(), **{"communication.max_splits": max_splits})
    graph = step_graph(trainer, x, y)
    reduces = collectives(graph, "CollectiveReduceV2")
    assert len(reduces) == expected
    sizes = sorted(int(op.inputs[0].shape.num_elements()) for op in reduces)
    total = sum(int(np.prod(v.shape)) for v in trainer.model.trainable_variables)
    assert sum(sizes) == total
    if expected > 1:  # balanced: no bucket beyond its share plus the largest tensor
        largest = max(int(np.prod(v.shape)) for v in trainer.model.trainable_variables)
        assert max(sizes) <= total / expected + largest


@pytest.mark.parametrize("communicators", [1, 3])
def test_buckets_spread_over_communicator_chains(communicators):
    x, y = mlp_data()
    trainer = trainer_for(
        deep_mlp(),
        **{"communication.max_splits": 6, "communication.num_communicators": communicators},
    )
    graph = step_graph(trainer, x, y)
    tokens = {op.inputs[-1].op.name for op in collectives(graph, "CollectiveReduceV2")}
    # Each chain orders its collectives by its own token; chains are independent.
    assert len(tokens) == communicators


def test_fp16_wire_matches_float32_within_half_precision():
    x, y = mlp_data()
    reference = deep_mlp()
    keras_reference(reference, x, y, keras.optimizers.SGD(0.1), batch_size=16, steps=3)
    model = deep_mlp()
    trainer = trainer_for(model, **{"communication.fp16": True, "communication.fp16_scale": 64})
    trainer.fit(x, y, batch_size=16, steps_per_epoch=3, verbose=0, shuffle=False)
    difference = max_weight_difference(reference, model)
    # float16 keeps 11 significant bits: relative error 2^-11 ~ 5e-4 of each gradient,
    # times the learning rate, over 3 steps.
    assert difference < 1e-3
    print(f"fp16 wire: max weight difference after 3 steps {difference:.2e}")
    graph = step_graph(trainer, x, y)
    dtypes = {op.inputs[0].dtype for op in collectives(graph, "CollectiveReduceV2")}
    assert dtypes == {tf.float16}


@pytest.mark.parametrize(
    "optimizer, jit_compile", [("sgd", None), ("adam", None), ("adam", True)], ids=str
)
def test_sparse_embedding_gradients_are_gathered_as_slices(optimizer, jit_compile):
    """Keras applies IndexedSlices sparsely (Adam updates only the looked-up rows'
    moments); gathering slices keeps exactly those semantics. Under XLA (each lane one
    function) the token ids are followed into the lane's function: still the batch's."""
    x, y = token_data()
    make = (
        (lambda: keras.optimizers.SGD(0.5))
        if optimizer == "sgd"
        else (lambda: keras.optimizers.Adam(0.05))
    )
    reference = embedding_model()
    keras_reference(reference, x, y, make(), batch_size=16, steps=3)
    model = embedding_model()
    trainer = trainer_for(model, make(), devices=4, jit_compile=jit_compile)
    assert trainer.engine_plan.jit.per_lane == bool(jit_compile)
    trainer.fit(x, y, batch_size=16, steps_per_epoch=3, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < 1e-5

    graph = step_graph(trainer, x, y)
    gathers = collectives(graph, "CollectiveGatherV2")
    assert len(gathers) == 2  # the embedding's rows and their indices
    vocabulary_size = 50 * 8
    for op in collectives(graph, "CollectiveReduceV2"):
        assert op.inputs[0].shape.num_elements() < vocabulary_size  # no dense embedding grad


class AddPositions(keras.layers.Layer):
    """KerasHub ViT's position embedding: an Embedding looked up at `arange(n)` for the
    whole batch, so one device's gradient holds each position's row once, summed over
    the batch."""

    def __init__(self, num_positions, dim, **kwargs):
        super().__init__(**kwargs)
        self.embedding = keras.layers.Embedding(num_positions, dim, name="table")
        self.positions = keras.ops.expand_dims(keras.ops.arange(num_positions), 0)

    def call(self, x):
        return x + self.embedding(self.positions)


def position_model(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5, 4), name="x")
    h = keras.layers.Flatten()(AddPositions(5, 4, name="positions")(inputs))
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))


class AddPositionsAgain(keras.layers.Layer):
    """Adds another layer's position embedding: a table two layers read (tied)."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding
        self.positions = keras.ops.expand_dims(keras.ops.arange(embedding.input_dim), 0)

    def call(self, x):
        return x + self.embedding(self.positions)


def tied_position_model(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5, 4), name="x")
    positions = AddPositions(5, 4, name="positions")
    h = keras.layers.Dense(4, activation="tanh", name="mix")(positions(inputs))
    h = keras.layers.Flatten()(AddPositionsAgain(positions.embedding, name="again")(h))
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))


def position_data_and_reference(build=position_model):
    """32 rows for `position_model` (or `build`), and the model Keras's Adam trained on
    them (2 steps of 16)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 5, 4)).astype("float32")
    y = rng.integers(0, 3, 32).astype("int32")
    reference = build()
    keras_reference(reference, x, y, keras.optimizers.Adam(0.01), batch_size=16, steps=2)
    return x, y, reference


@pytest.mark.parametrize("config", [{}, {"zero.level": "v1"}], ids=["data_parallel", "zero_v1"])
def test_rows_looked_up_at_constant_positions_are_all_reduced_as_one_device_sums_them(config):
    """Gathered, each replica's copy of a summed row was a row of its own, and Keras's
    Adam squares rows before it sums repeated ones: the table ended 5.2e-3 from Keras
    after two steps, data parallel and ZeRO v1 (SGD, linear in the rows, matched)."""
    x, y, reference = position_data_and_reference()
    model = position_model()
    trainer = trainer_for(model, keras.optimizers.Adam(0.01), **config)
    trainer.fit(x, y, batch_size=16, steps_per_epoch=2, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < 1e-6
    if not config:  # (ZeRO gathers its updated parameter pieces)
        assert not collectives(step_graph(trainer, x, y), "CollectiveGatherV2")


# Micro-batches accumulated on one device, in a loop or unrolled, then reduced over
# replicas; a pipeline's stage accumulating its micro-batches, alone and replicated.
POSITION_STAGES = {"positions": 0, "flatten.*|logits": 1}
MICRO_BATCH_CASES = {
    "one_device_loop": (1, {}, None, False),
    "one_device_unrolled": (1, {}, None, True),
    "2_replicas_loop": (2, {}, None, False),
    "2_replicas_zero_v1": (2, {"zero.level": "v1"}, None, False),
    "2_stages": (2, {}, POSITION_STAGES, False),
    "2_replicas_of_2_stages": (4, {}, POSITION_STAGES, False),
}


@pytest.mark.parametrize("case", sorted(MICRO_BATCH_CASES))
def test_rows_at_constant_positions_are_summed_over_micro_batches(case):
    """Two micro-batches' gradients of a lookup at `arange(n)` hold the same rows: one
    device's gradient of both holds each row once, summed. Stacked as two rows each,
    Adam's second moment differed: 1.2e-2 / 1.3e-2 from Keras after two steps (SGD,
    linear in the rows, matched); with replicas the stacked rows' indices were no longer
    provably constant, so they were gathered as well."""
    devices, config, stages, unrolled = MICRO_BATCH_CASES[case]
    x, y, reference = position_data_and_reference()
    model = position_model()
    trainer = epl.EPLTrainer(
        model,
        LOSS,
        keras.optimizers.Adam(0.01),
        stages=stages,
        config={"cluster.virtual_devices": devices, "pipeline.num_micro_batch": 2, **config},
    )
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    program = trainer.runtime.ensure_for(dataset).program
    assert program.loops_micro_batches == (stages is None and not config)
    if unrolled:  # before the first trace: each micro-batch emitted on its own
        program._emit_lanes = program._emit_lanes_one_by_one
    trainer.fit(dataset, verbose=0)
    assert max_weight_difference(reference, model) < 1e-6


# Under XLA the gradients leave a compiled function: each lane's (2 replicas), each
# stage's backward (micro-batches, a pipeline). (devices, micro-batches, stages)
XLA_CASES = {
    "2_replicas": (2, 1, None),
    "one_device_2_micro_batches": (1, 2, None),
    "2_replicas_x_2_micro_batches": (2, 2, None),
    "2_stages": (2, 2, POSITION_STAGES),
}


@pytest.mark.parametrize("case", sorted(XLA_CASES))
def test_rows_at_constant_positions_are_reduced_as_one_device_sums_them_under_xla(case):
    """A gradient that leaves an XLA function has indices that are that function's
    outputs; they are followed into the function, where they are still constant. Not
    followed, the rows were gathered over replicas and stacked over micro-batches: Adam
    ended 5.2e-3 from Keras after two steps (4.0e-3 with 2 replicas x 2 micro-batches)."""
    devices, num_micro_batch, stages = XLA_CASES[case]
    x, y, reference = position_data_and_reference()
    model = position_model()
    trainer = epl.EPLTrainer(
        model,
        LOSS,
        keras.optimizers.Adam(0.01),
        stages=stages,
        jit_compile=True,
        config={"cluster.virtual_devices": devices, "pipeline.num_micro_batch": num_micro_batch},
    )
    jit = trainer.engine_plan.jit
    assert jit.per_lane if num_micro_batch == 1 else jit.per_stage
    trainer.fit(x, y, batch_size=16, steps_per_epoch=2, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < 1e-6


# A position table read by both stages: (devices, jit_compile)
TIED_POSITION_CASES = {"2_stages": (2, False), "2_stages_xla": (2, True), "2x2_stages": (4, False)}


@pytest.mark.parametrize("case", sorted(TIED_POSITION_CASES))
def test_rows_at_constant_positions_of_a_table_two_stages_read_are_summed_per_stage(case):
    """One device's gradient of a table read twice at `arange(n)` holds each use's rows
    once, summed over the batch (the tape concatenates the two uses). The lane's one
    running sum stacked both stages' rows of every micro-batch: Adam ended 5.9e-3 from
    Keras after two steps (6.4e-3 with 2 replicas); each stage's are now summed over the
    micro-batches, then the stages' concatenated."""
    devices, jit_compile = TIED_POSITION_CASES[case]
    x, y, reference = position_data_and_reference(tied_position_model)
    model = tied_position_model()
    trainer = epl.EPLTrainer(
        model,
        LOSS,
        keras.optimizers.Adam(0.01),
        stages={"positions": 0, "mix|again|flatten.*|logits": 1},
        jit_compile=jit_compile,
        config={"cluster.virtual_devices": devices, "pipeline.num_micro_batch": 2},
    )
    trainer.fit(x, y, batch_size=16, steps_per_epoch=2, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < 1e-6


@pytest.mark.parametrize("how", ["loop", "unrolled", "xla"])
def test_rows_of_token_ids_stay_rows_of_their_own_over_micro_batches(how):
    """Per-sample lookups: one device's gradient holds every sample's row, repeated
    tokens included, so the micro-batches' rows are concatenated (and gathered over the
    replicas), not summed as rows looked up at constant positions are; under XLA too
    (each stage's backward compiled), where the ids are followed into the functions."""
    x, y = token_data(32)
    reference = embedding_model()
    keras_reference(reference, x, y, keras.optimizers.Adam(0.05), batch_size=16, steps=2)
    model = embedding_model()
    trainer = trainer_for(
        model,
        keras.optimizers.Adam(0.05),
        jit_compile=how == "xla",
        **{"pipeline.num_micro_batch": 2},
    )
    assert trainer.engine_plan.jit.per_stage == (how == "xla")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    program = trainer.runtime.ensure_for(dataset).program
    assert program.loops_micro_batches
    if how == "unrolled":
        program._emit_lanes = program._emit_lanes_one_by_one
    trainer.fit(dataset, verbose=0)
    assert max_weight_difference(reference, model) < 1e-6


def test_sparse_as_dense_reduces_the_embedding_dense():
    x, y = token_data()
    reference = embedding_model()
    keras_reference(reference, x, y, keras.optimizers.SGD(0.5), batch_size=16, steps=3)
    model = embedding_model()
    trainer = trainer_for(
        model, keras.optimizers.SGD(0.5), **{"communication.sparse_as_dense": True}
    )
    trainer.fit(x, y, batch_size=16, steps_per_epoch=3, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < 1e-5
    graph = step_graph(trainer, x, y)
    assert not collectives(graph, "CollectiveGatherV2")
    sizes = [op.inputs[0].shape.num_elements() for op in collectives(graph, "CollectiveReduceV2")]
    assert sum(sizes) == sum(int(np.prod(v.shape)) for v in model.trainable_variables)


def test_sparse_gradients_stay_sparse_where_keras_keeps_them_so():
    """Only global-norm clipping hands Keras's optimizer a dense Embedding gradient. A
    masked loss (its divisor depends on the data, so the engine corrects each replica's
    gradients by a factor after the reduction) has no clipping: Keras's Adam updates from
    the slices, squaring each repeated row's slice. Densified there too (as the clipping
    fix first did for every scaled gradient), the table ended 8.7e-2 from Model.fit after
    one Adam epoch on 2 devices."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def masked_model():
        keras.utils.set_random_seed(0)
        tokens = keras.Input((6,), dtype="int32")
        h = keras.layers.Embedding(20, 8, mask_zero=True)(tokens)  # the loss is masked
        return keras.Model(tokens, keras.layers.Dense(5)(h))

    rng = np.random.default_rng(0)
    x = rng.integers(0, 6, (32, 6)).astype("int32")  # few ids: rows repeat; 0 is masked
    y = rng.integers(0, 5, (32, 6)).astype("int32")
    reference = masked_model()
    reference.compile(keras.optimizers.Adam(0.05), loss)
    reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    model = masked_model()
    trainer = epl.EPLTrainer(
        model, loss, keras.optimizers.Adam(0.05), config={"cluster.virtual_devices": 2}
    )
    trainer.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert max_weight_difference(reference, model) < 1e-6


@pytest.mark.parametrize("optimizer_class", [keras.optimizers.SGD, keras.optimizers.Adam])
def test_sparse_gradients_with_accumulation_and_clipping_match_keras(optimizer_class):
    """Keras's global-norm clipping hands the optimizer a dense Embedding gradient
    (repeated rows summed). Adam on the clipped IndexedSlices instead squared each
    repeated row separately: the weights differed from Model.fit by 0.11 after 3 steps
    (SGD, linear in the gradient, cannot tell)."""
    x, y = token_data()
    optimizer = lambda: optimizer_class(0.05, global_clipnorm=0.1)  # noqa: E731
    reference = embedding_model()
    keras_reference(reference, x, y, optimizer(), batch_size=16, steps=3)
    model = embedding_model()
    trainer = trainer_for(
        model,
        optimizer(),
        **{"pipeline.num_micro_batch": 2, "communication.clip_after_allreduce": True},
    )
    trainer.fit(x, y, batch_size=16, steps_per_epoch=3, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < 1e-5
