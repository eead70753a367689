"""Tensor split of large classifiers (EPL's replicate(n) features + split(n) head).

Tolerance: weights after 3 SGD steps agree with single-device Keras to atol 1e-5 (the
only differences are float summation orders across lanes and shards).
"""

import contextlib
import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from _models import LOSS, keras_reference, max_weight_difference

import epl_trainer as epl
from epl_trainer.core.plan.ir import SplitError

ATOL = 1e-5
COLOCATE = {"cluster.colocate_split_and_replicate": True}


def head_model(classes=8, seed=1, activation=None):
    keras.utils.set_random_seed(seed)
    x = keras.Input((6,), name="x")
    h = keras.layers.Dense(16, activation="relu", name="features")(x)
    out = keras.layers.Dense(classes, activation=activation, name="head")(h)
    return keras.Model(x, out)


def resnet_like(classes, seed=1):
    """Conv features with residual blocks (no BatchNorm: per-lane batch statistics would
    differ from one device) and a large classifier."""
    keras.utils.set_random_seed(seed)
    image = keras.Input((8, 8, 3), name="image")
    h = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name="stem")(image)
    for i in range(2):
        r = keras.layers.Conv2D(8, 3, padding="same", activation="relu", name=f"block{i}_a")(h)
        r = keras.layers.Conv2D(8, 3, padding="same", name=f"block{i}_b")(r)
        h = keras.layers.Activation("relu", name=f"block{i}_out")(
            keras.layers.Add(name=f"block{i}_add")([h, r])
        )
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    out = keras.layers.Dense(classes, name="classifier")(h)
    return keras.Model(image, out)


def data(n=64, classes=8, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, classes, n).astype("int32")


REFERENCE_OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "adam_clipped": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.5),
}


@functools.cache  # the same model for every test that asks for it (read only)
def _head_reference(optimizer):
    """head_model() after plain one-device Keras `fit` on data() (3 steps of 16)."""
    reference = head_model()
    keras_reference(reference, *data(), REFERENCE_OPTIMIZERS[optimizer](), batch_size=16, steps=3)
    return reference


def image_data(n, classes, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8, 8, 3)).astype("float32")
    return x, rng.integers(0, classes, n).astype("int32")


def split_trainer(model, devices, loss=LOSS, optimizer=None, metrics=None, **config):
    config = {"cluster.virtual_devices": devices, **COLOCATE, **config}
    return epl.EPLTrainer(
        model,
        loss,
        optimizer or keras.optimizers.SGD(0.1),
        metrics=metrics,
        split=[_head_name(model)],
        config=config,
    )


def _head_name(model):
    return model.layers[-1].name


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_split_head_matches_single_device_keras(devices):
    """On 8 devices with replicate(4)-width replicas there are two replicas: sharded
    gradients are also reduced across replicas."""
    x, y = data()
    reference = _head_reference("sgd")
    model = head_model()
    config = {"cluster.virtual_devices": devices}
    if devices == 8:  # two replicas of width 4
        trainer = epl.EPLTrainer(
            model,
            LOSS,
            keras.optimizers.SGD(0.1),
            strategy=epl.Strategy(default=epl.replicate(4), split=["head"]),
            config={**config, **COLOCATE},
        )
    else:
        trainer = split_trainer(model, devices)
    history = trainer.fit(
        x, y, batch_size=16, epochs=1, steps_per_epoch=3, verbose=0, shuffle=False
    )
    assert max_weight_difference(reference, model) < ATOL
    assert np.isfinite(history.history["loss"][0])
    kinds = [tg.kind for tg in trainer.plan.taskgraphs]
    assert kinds == ["replicate", "split"]
    assert trainer.plan.num_replicas == (2 if devices == 8 else 1)


def test_each_lane_holds_one_column_shard():
    model = head_model(classes=8)
    trainer = split_trainer(model, 4)
    x, y = data()
    trainer.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=1, verbose=0, shuffle=False)
    state = trainer.engine.state
    kernel_index = next(
        i for i, v in enumerate(state.model_trainable) if v is model.layers[-1].kernel
    )
    shards = [state.trainable[li][kernel_index] for li in range(4)]
    assert [tuple(s.shape) for s in shards] == [(16, 2)] * 4
    assert [s.value.device.rsplit(":", 1)[-1] for s in shards] == ["0", "1", "2", "3"]
    joined = np.concatenate([np.asarray(s.value) for s in shards], axis=1)
    np.testing.assert_array_equal(joined, model.layers[-1].kernel.numpy())
    report = trainer.memory_report(print_table=False)
    full = 16 * 8 * 4
    head_params_per_device = [report[d].parameters for d in sorted(report.devices)]
    assert len(head_params_per_device) == 4
    assert len(set(head_params_per_device)) == 1  # every lane holds the same bytes
    features_bytes = (6 * 16 + 16) * 4
    assert head_params_per_device[0] == features_bytes + (full + 8 * 4) // 4


def test_resnet_like_features_with_a_large_split_classifier():
    # One size: 100,000 classes shows what 1,000 did (Keras's weights, loss and evaluate;
    # no tensor of the full logits' size in the step) with a head 100 times larger.
    # Trimmed for the suite's time: the 1,000-class cell.
    classes = 100_000
    x, y = image_data(48, classes)
    reference = resnet_like(classes)
    history = keras_reference(reference, x, y, keras.optimizers.SGD(0.1), batch_size=16, steps=3)
    reference_loss = float(LOSS(y[32:48], reference(x[32:48])))

    model = resnet_like(classes)
    trainer = split_trainer(model, 4)
    ours = trainer.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=3, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < ATOL
    # The training loss (mean over the 3 steps, as Keras reports it) agrees too.
    assert ours.history["loss"][0] == pytest.approx(history.history["loss"][0], abs=1e-5)
    loss = trainer.evaluate(x[32:48], y[32:48], batch_size=16, return_dict=True)["loss"]
    assert loss == pytest.approx(reference_loss, abs=1e-5)

    # No tensor of the full logits' size exists anywhere in the traced training step.
    graph = trainer.engine.program.train_on_iterator.get_concrete_function(
        iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(16))
    ).graph
    full_logits = 16 * classes
    largest = 0
    for op in _all_ops(graph):
        for out in op.outputs:
            if out.shape.is_fully_defined():
                largest = max(largest, out.shape.num_elements())
                assert out.shape.num_elements() < full_logits, (op.name, out.shape)
    kernel_shard = 8 * classes // 4
    assert largest >= kernel_shard  # the check saw the shards themselves


def _all_ops(graph):
    yield from graph.get_operations()
    for function in graph._functions.values():
        yield from _all_ops(function.graph) if hasattr(function, "graph") else ()


def test_softmax_head_and_one_hot_labels_match_keras():
    x, y = data()
    onehot = np.eye(8, dtype="float32")[y]
    loss = keras.losses.CategoricalCrossentropy()
    reference = head_model(activation="softmax")
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, metrics=["accuracy"])
    reference.fit(x, onehot, batch_size=16, steps_per_epoch=3, shuffle=False, verbose=0)

    model = head_model(activation="softmax")
    trainer = split_trainer(model, 4, loss=loss, metrics=["accuracy"])
    trainer.fit(x, onehot, batch_size=16, epochs=1, steps_per_epoch=3, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < ATOL
    expected = reference.evaluate(x, onehot, batch_size=16, verbose=0, return_dict=True)
    got = trainer.evaluate(x, onehot, batch_size=16, return_dict=True)
    assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    assert got["accuracy"] == pytest.approx(expected["accuracy"])
    probabilities = trainer.predict(x[:10], batch_size=10)
    np.testing.assert_allclose(probabilities, reference.predict(x[:10], verbose=0), atol=1e-6)


def test_accuracy_from_the_distributed_argmax_matches_keras():
    x, y = data(n=64)
    reference = head_model()
    reference.compile(loss=LOSS, metrics=["accuracy"])
    expected = reference.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    trainer = split_trainer(head_model(), 4, metrics=["accuracy"])
    got = trainer.evaluate(x, y, batch_size=16, return_dict=True)
    assert got["accuracy"] == pytest.approx(expected["accuracy"])
    assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    # Uneven final batch: padding rows get weight 0 on every lane.
    got = trainer.evaluate(x[:50], y[:50], batch_size=16, return_dict=True)
    expected = reference.evaluate(x[:50], y[:50], batch_size=16, verbose=0, return_dict=True)
    assert got["accuracy"] == pytest.approx(expected["accuracy"])
    assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5)


def test_adam_and_clipping_after_allreduce_match_keras():
    x, y = data()
    reference = _head_reference("adam_clipped")
    model = head_model()
    trainer = split_trainer(
        model,
        4,
        optimizer=keras.optimizers.Adam(0.01, global_clipnorm=0.5),
        **{"communication.clip_after_allreduce": True},
    )
    trainer.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=3, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < ATOL


@pytest.mark.combines("checkpoint+split")
def test_checkpoint_restores_every_shard_and_its_slots(tmp_path):
    x, y = data()
    model = head_model()
    trainer = split_trainer(model, 4, optimizer=keras.optimizers.Adam(0.01))
    trainer.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=2, verbose=0, shuffle=False)
    trainer.save_checkpoint(str(tmp_path))
    trainer.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=2, verbose=0, shuffle=False)
    expected = [w.copy() for w in model.get_weights()]

    fresh = head_model(seed=7)
    restored = split_trainer(fresh, 4, optimizer=keras.optimizers.Adam(0.01))
    restored.restore_checkpoint(str(tmp_path))
    # After a restore `epochs` is the final epoch (Keras's meaning with initial_epoch).
    epochs = restored.epochs_done + 1
    restored.fit(x, y, batch_size=16, epochs=epochs, steps_per_epoch=2, verbose=0, shuffle=False)
    for a, b in zip(expected, fresh.get_weights()):
        np.testing.assert_array_equal(a, b)


def _error(callable_, error=SplitError):
    with pytest.raises(error) as info:
        callable_()
    return str(info.value)


def test_units_that_do_not_split_evenly_are_refused():
    message = _error(lambda: split_trainer(head_model(classes=6), 4))
    assert "units=6" in message and "4 devices" in message


def test_split_dense_that_is_not_a_model_output_is_refused():
    keras.utils.set_random_seed(0)
    x = keras.Input((6,))
    h = keras.layers.Dense(8, name="wide")(x)
    out = keras.layers.Dense(3, name="out")(h)
    model = keras.Model(x, out)
    trainer = lambda: epl.EPLTrainer(  # noqa: E731
        model, LOSS, split=["wide"], config={"cluster.virtual_devices": 2, **COLOCATE}
    )
    assert "must produce a model output" in _error(trainer)


def test_a_loss_that_is_not_cross_entropy_is_refused():
    message = _error(lambda: split_trainer(head_model(), 2, loss="mse"))
    assert "cross-entropy" in message and "head" in message


def test_a_cross_entropy_that_ignores_class_zero_is_refused():
    """ignore_class=0 was taken for "off" (0 turns label smoothing off) and the sharded
    cross-entropy computed class 0's rows too, silently."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)
    message = _error(lambda: split_trainer(head_model(), 2, loss=loss))
    assert "plain cross-entropy" in message and "'ignore_class': 0" in message


def test_from_logits_must_match_the_activation():
    message = _error(lambda: split_trainer(head_model(activation="softmax"), 2, loss=LOSS))
    assert "from_logits=True" in message


def test_split_without_colocation_is_refused():
    model = head_model()
    with pytest.raises(ValueError, match="colocate_split_and_replicate=True"):
        epl.EPLTrainer(
            model,
            LOSS,
            split=["head"],
            config={"cluster.virtual_devices": 4},
            strategy=epl.Strategy(default=epl.replicate(2)),
        )


@pytest.mark.combines("split+data_parallel")
def test_a_model_split_whole_needs_no_colocation():
    """EPL's `with epl.split(2): model()` with the default config: one split TaskGraph has
    nothing to share devices with. It was refused ("need
    cluster.colocate_split_and_replicate=True (the split layers then share the devices of
    the replicated ones") though the model had no replicated TaskGraph."""

    def split_whole(scope):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,), name="x")
        with scope:
            h = keras.layers.Dense(16, activation="tanh", name="up")(inputs)
            outputs = keras.layers.Dense(4, name="logits")(h)
        return keras.Model(inputs, outputs)

    x, y = data(classes=4)
    reference = split_whole(contextlib.nullcontext())
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    keras_reference(reference, x, y, optimizer, batch_size=16, steps=3)
    epl.init({"cluster.virtual_devices": 4})  # 2 replicas of a 2-way split
    model = split_whole(epl.split(2))
    trainer = epl.EPLTrainer(model, LOSS, keras.optimizers.SGD(0.1, momentum=0.9))
    trainer.fit(x, y, batch_size=16, steps_per_epoch=3, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < ATOL
    assert "Split: split layers are sharded across the devices" in trainer.plan.summary()


@pytest.mark.parametrize(
    "level",
    [
        pytest.param("v0", marks=pytest.mark.combines("zero_v0+split+data_parallel")),
        pytest.param("v1", marks=pytest.mark.combines("zero_v1+split+data_parallel")),
        pytest.param("v2", marks=pytest.mark.combines("zero_v2+split+data_parallel")),
    ],
)
def test_split_with_zero_shards_the_replicated_part(level):
    """8 devices, 2 replicas of width 4, a split head: ZeRO partitions the replicated
    `features` layer over the 8 lanes; each lane updates its own head shard after the
    shards are reduced over the replicas. Adam, 2 micro-batches, global-norm clipping
    after the reduction (the norm adds the pieces' and the shards' squares)."""
    x, y = data()
    reference = _head_reference("adam_clipped")
    model = head_model()
    trainer = epl.EPLTrainer(
        model,
        LOSS,
        REFERENCE_OPTIMIZERS["adam_clipped"](),
        strategy=epl.Strategy(default=epl.replicate(4), split=["head"]),
        config={
            "cluster.virtual_devices": 8,
            "zero.level": level,
            "pipeline.num_micro_batch": 2,
            "communication.clip_after_allreduce": True,
            **COLOCATE,
        },
    )
    trainer.fit(x, y, batch_size=16, steps_per_epoch=3, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < ATOL
    update = trainer.engine.program.update
    features = {v.path: i for i, v in enumerate(model.trainable_variables)}["features/kernel"]
    owners = {lane for lane, i, _, _ in update.piece_spans().values() if i == features}
    assert len(owners) > 1  # the replicated kernel is cut over several lanes


def test_clipping_before_the_reduction_is_refused_with_a_hint():
    optimizer = keras.optimizers.SGD(0.1, global_clipnorm=1.0)
    message = _error(lambda: split_trainer(head_model(), 2, optimizer=optimizer))
    assert "clip_after_allreduce=True" in message


def test_metrics_other_than_accuracy_on_a_split_output_are_refused():
    message = _error(
        lambda: split_trainer(head_model(), 2, metrics=["sparse_top_k_categorical_accuracy"])
    )
    assert "sparse_top_k_categorical_accuracy" in message


@pytest.mark.combines("amp+split")
def test_split_head_under_bf16_amp_trains_close_to_float32():
    x, y = data()
    fp32 = head_model()
    split_trainer(fp32, 4).fit(x, y, batch_size=16, steps_per_epoch=3, verbose=0, shuffle=False)
    bf16 = head_model()
    trainer = split_trainer(bf16, 4, **{"amp.level": "O1", "amp.dtype": "bfloat16"})
    history = trainer.fit(x, y, batch_size=16, steps_per_epoch=3, verbose=0, shuffle=False)
    assert np.isfinite(history.history["loss"][0])
    assert max_weight_difference(fp32, bf16) < 2e-2


def test_plan_summary_names_the_colocated_split():
    trainer = split_trainer(head_model(), 2)
    summary = trainer.plan.summary()
    assert "split layers are sharded" in summary and "Pipeline:" not in summary


# ---- Megatron pairs: two split Dense layers, the second on the first's output -----------


def pair_model(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,), name="x")
    h = keras.layers.Dense(16, activation="relu", name="up")(inputs)
    h = keras.layers.Dense(8, activation="tanh", name="down")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))


def pair_trainer(model, devices, width, **config):
    return epl.EPLTrainer(
        model,
        LOSS,
        keras.optimizers.SGD(0.1),
        strategy=epl.Strategy(default=epl.replicate(width), split=["up", "down"]),
        config={"cluster.virtual_devices": devices, **COLOCATE, **config},
    )


@pytest.mark.combines("split+data_parallel")
def test_a_split_megatron_pair_matches_keras_and_holds_column_and_row_shards():
    x, y = data(classes=3)
    reference = pair_model()
    keras_reference(reference, x, y, keras.optimizers.SGD(0.1), batch_size=16, steps=3)
    model = pair_model()
    trainer = pair_trainer(model, devices=4, width=2)  # 2 replicas of a 2-way pair
    trainer.fit(x, y, batch_size=16, steps_per_epoch=3, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < ATOL
    state = trainer.engine.state
    index = {id(v): i for i, v in enumerate(state.model_trainable)}
    up, down = model.get_layer("up"), model.get_layer("down")
    shapes = [tuple(state.trainable[0][index[id(v)]].shape) for v in (up.kernel, up.bias)]
    assert shapes == [(6, 8), (8,)]  # by output column
    assert tuple(state.trainable[0][index[id(down.kernel)]].shape) == (8, 8)  # by input row
    assert tuple(state.trainable[0][index[id(down.bias)]].shape) == (8,)  # whole


def test_a_frozen_split_layer_is_refused_by_name():
    """A layer of the split scope frozen (Keras's fine-tuning) has no trainable variables
    to shard: before, EPLTrainer failed with a bare KeyError (the kernel's id)."""
    model = pair_model()
    model.get_layer("up").trainable = False
    with pytest.raises(SplitError, match=r"Non-trainable variables in a split TaskGraph.*up/"):
        pair_trainer(model, devices=2, width=2)


def test_a_megatron_pair_sends_one_gather_and_one_reduce_scatter_of_rows_each_way():
    """Per lane and step (one micro-batch): the rows gathered into the pair and the
    partial sums reduce-scattered out of it forward; the adjoint of the reduce-scatter
    (an all-gather) backward, and of the gather (an all-to-all) where the pair's input
    needs a gradient. Nothing else of the pair crosses devices; the weights'
    data-parallel reduction is separate (all-reduces)."""
    from test_comm_options import all_ops

    x, y = data(classes=3)
    trainer = pair_trainer(pair_model(), devices=2, width=2)
    trainer.fit(x, y, batch_size=16, steps_per_epoch=1, verbose=0, shuffle=False)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True)
    graph = trainer.engine.program.train_on_iterator.get_concrete_function(iter(dataset)).graph
    lane_ops = [
        op
        for op in all_ops(graph)
        if op.type in ("CollectiveGatherV2", "CollectiveAllToAllV2") and op.device.endswith("CPU:1")
    ]
    kinds = sorted((op.type, op.inputs[0].shape[-1]) for op in lane_ops)
    assert kinds == [
        ("CollectiveAllToAllV2", None),  # forward: the partial sums' reduce-scatter (flat)
        ("CollectiveGatherV2", 6),  # forward: the rows into the pair (6 features)
        ("CollectiveGatherV2", 8),  # backward: the pair's output gradients (8 units)
    ]  # no backward all-to-all: the pair reads the model's input, which needs no gradient


def test_a_tensor_parallel_checkpoint_restores_into_data_parallelism(tmp_path):
    """2 steps tensor parallel, saved; restored into 2 data-parallel devices, 2 more
    steps: the weights of 4 uninterrupted Keras steps."""
    x, y = data(classes=3)
    reference = pair_model()
    keras_reference(reference, x, y, keras.optimizers.SGD(0.1), batch_size=16, steps=4)
    first = pair_trainer(pair_model(), devices=4, width=2)
    first.fit(x[:32], y[:32], batch_size=16, verbose=0, shuffle=False)
    first.save_checkpoint(str(tmp_path))
    model = pair_model(seed=5)  # other initial weights: the checkpoint's replace them
    second = epl.EPLTrainer(
        model, LOSS, keras.optimizers.SGD(0.1), config={"cluster.virtual_devices": 2}
    )
    second.restore_checkpoint(str(tmp_path))
    second.fit(x[32:64], y[32:64], batch_size=16, epochs=2, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < ATOL


def gated_model(seed=0):
    """A gated MLP (Llama's): down(silu(gate(x)) * up(x))."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,), name="x")
    gate = keras.layers.Dense(16, name="gate")(inputs)
    gate = keras.layers.Activation("silu", name="silu")(gate)
    up = keras.layers.Dense(16, name="up")(inputs)
    h = keras.layers.Multiply(name="gated")([gate, up])
    h = keras.layers.Dense(8, name="down")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))


def test_a_gated_mlp_is_one_megatron_pair_with_two_columns():
    """gate and up column-parallel, silu and the product on each lane's units, down
    row-parallel: Keras's weights on one device."""
    x, y = data(classes=3)
    reference = gated_model()
    keras_reference(reference, x, y, keras.optimizers.SGD(0.1), batch_size=16, steps=3)
    model = gated_model()
    trainer = epl.EPLTrainer(
        model,
        LOSS,
        keras.optimizers.SGD(0.1),
        strategy=epl.Strategy(default=epl.replicate(2), split=["gate", "up", "down"]),
        config={"cluster.virtual_devices": 4, **COLOCATE},
    )
    trainer.fit(x, y, batch_size=16, steps_per_epoch=3, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < ATOL
    kinds = {s.layer.name: s.kind for s in trainer.engine_plan.split_layers}
    assert kinds == {"gate": "column", "up": "column", "down": "row"}


def test_a_layer_reading_a_pairs_units_from_outside_is_refused():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    up = keras.layers.Dense(16, activation="relu", name="up")(inputs)
    down = keras.layers.Dense(8, name="down")(up)
    side = keras.layers.Dense(8, name="side")(up)  # reads the whole hidden units
    model = keras.Model(inputs, keras.layers.Add(name="sum")([down, side]))
    with pytest.raises(SplitError, match=r"'up' lies between .*read by layers outside"):
        epl.EPLTrainer(
            model,
            "mse",
            "sgd",
            strategy=epl.Strategy(default=epl.replicate(2), split=["up", "down"]),
            config={"cluster.virtual_devices": 2, **COLOCATE},
        )
