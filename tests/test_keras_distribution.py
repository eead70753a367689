"""Keras's distribution API (`keras.distribution`) through EPLTrainer (issue 47, first part).

A `DataParallel`, or a `ModelParallel` whose layout map shards nothing, trains as data
parallelism over the mesh's devices; a layout map whose sharded variables make Megatron
pairs of Dense layers trains them tensor parallel over the model axis. Each equals plain
Keras `fit` on one device (SGD and Adam, weights within 1e-6), whether given as
`strategy=`, set with `set_distribution` or current in `scope()`. Layouts are Keras's own
lookups; what this version does not train (other sharded layouts, layouts of layer
outputs) and what cannot be (an indivisible dimension, a device the worker lacks) is
refused by name.
"""

import collections
import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from _models import LOSS, keras_reference, max_weight_difference, mlp, mlp_data

import epl_trainer as epl
from epl_trainer.core.engine import jit_choice
from epl_trainer.core.plan.ir import SplitError

ATOL = 1e-6
# Adam turns the last bits of a gradient (another summation order) into whole steps of
# lr: after 4 Adam steps this MLP ends 2.4e-6 (2 devices) and 5.0e-6 (4) from Keras under
# plain data parallelism, 1.7e-6 and 6.9e-6 tensor parallel; SGD 3e-8 in all four.
ATOL_ADAM = 2e-5
OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.1), "adam": lambda: keras.optimizers.Adam(0.01)}
BATCH, STEPS = 16, 4


@pytest.fixture(autouse=True)
def _no_global_distribution():
    yield
    keras.distribution.set_distribution(None)


def _devices(count):
    return keras.distribution.list_devices()[:count]


def _fit(trainer, x, y):
    trainer.fit(x, y, batch_size=BATCH, steps_per_epoch=STEPS, shuffle=False, verbose=0)


@functools.cache  # the same model for every test that asks for it (read only)
def _reference(optimizer):
    """mlp() after plain one-device Keras `fit` on mlp_data(BATCH * STEPS)."""
    model = mlp()
    keras_reference(model, *mlp_data(BATCH * STEPS), OPTIMIZERS[optimizer](), BATCH, STEPS)
    return model


def _mesh(shape, names=("batch", "model")):
    return keras.distribution.DeviceMesh(shape, names, _devices(int(np.prod(shape))))


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_data_parallel_as_strategy_equals_keras_and_our_data_parallelism(optimizer):
    x, y = mlp_data(BATCH * STEPS)
    reference = _reference(optimizer)
    model = mlp()
    distribution = keras.distribution.DataParallel(devices=_devices(2))
    trainer = epl.EPLTrainer(model, LOSS, OPTIMIZERS[optimizer](), strategy=distribution)
    assert trainer.plan.num_replicas == 2
    _fit(trainer, x, y)
    assert max_weight_difference(reference, model) < ATOL
    ours = mlp()
    config = {"cluster.virtual_devices": 2}
    _fit(epl.EPLTrainer(ours, LOSS, OPTIMIZERS[optimizer](), config=config), x, y)
    for a, b in zip(model.get_weights(), ours.get_weights()):
        np.testing.assert_array_equal(a, b)  # the same run, bit for bit


def test_the_distribution_set_or_in_scope_is_followed(caplog):
    distribution = keras.distribution.DataParallel(devices=_devices(4))
    with distribution.scope():
        in_scope = epl.EPLTrainer(mlp(), LOSS, "sgd")
    assert in_scope.plan.num_replicas == 4
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=_devices(2)))
    assert epl.EPLTrainer(mlp(), LOSS, "sgd").plan.num_replicas == 2
    # An EPL strategy given explicitly wins over the global distribution.
    explicit = epl.EPLTrainer(mlp(), LOSS, "sgd", strategy=epl.replicate(1))
    assert explicit.plan.num_replicas == 1
    assert "the keras.distribution 'DataParallel' set or in scope is not" in caplog.text


def test_the_meshs_devices_are_the_runs_in_its_order():
    distribution = keras.distribution.DataParallel(devices=["cpu:3", "cpu:2"])
    trainer = epl.EPLTrainer(mlp(), LOSS, OPTIMIZERS["sgd"](), strategy=distribution)
    devices = [lane.devices[0] for lane in trainer.lanes]
    assert [d.rsplit("/device:", 1)[1] for d in devices] == ["CPU:3", "CPU:2"]
    x, y = mlp_data(BATCH * STEPS)
    _fit(trainer, x, y)
    reference = _reference("sgd")
    assert max_weight_difference(reference, trainer.model) < ATOL


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_model_parallel_that_shards_nothing_trains_as_data_parallel(optimizer):
    """A (2, 1) mesh: the map lays the kernels out over 'model', an axis of size 1."""
    x, y = mlp_data(BATCH * STEPS)
    reference = _reference(optimizer)
    layout_map = keras.distribution.LayoutMap(_mesh((2, 1)))
    layout_map["dense_in/kernel"] = (None, "model")
    layout_map["logits/kernel"] = ("model", None)
    model = mlp()
    strategy = keras.distribution.ModelParallel(layout_map=layout_map)
    trainer = epl.EPLTrainer(model, LOSS, OPTIMIZERS[optimizer](), strategy=strategy)
    assert trainer.plan.num_replicas == 2
    _fit(trainer, x, y)
    assert max_weight_difference(reference, model) < ATOL


def _mlp_pair(seed=0):
    """x -> up (Dense 16, relu) -> down (Dense 8) -> logits (Dense 3): up and down are an
    MLP's Megatron pair."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,), name="x")
    h = keras.layers.Dense(16, activation="relu", name="up")(inputs)
    h = keras.layers.Dense(8, activation="tanh", name="down")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))


@functools.cache  # the same model for every test that asks for it (read only)
def _pair_reference(optimizer):
    """_mlp_pair() after plain one-device Keras `fit` on mlp_data(BATCH * STEPS)."""
    model = _mlp_pair()
    keras_reference(model, *mlp_data(BATCH * STEPS), OPTIMIZERS[optimizer](), BATCH, STEPS)
    return model


def _pair_layouts(mesh):
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")
    layout_map["up/bias"] = ("model",)
    layout_map["down/kernel"] = ("model", None)
    return layout_map


@pytest.mark.parametrize(
    "shape, optimizer",
    # SGD on every mesh; Adam (its slots held in the pair's shards) on 2 and 4 lanes. Adam
    # on (1, 2) re-ran the (2, 2) cell's lanes without its replicas (trimmed for the
    # suite's time).
    [((1, 2), "sgd"), ((2, 2), "sgd"), ((1, 4), "sgd"), ((2, 2), "adam"), ((1, 4), "adam")],
)
def test_a_megatron_pair_of_dense_layers_trains_tensor_parallel_as_keras(shape, optimizer):
    x, y = mlp_data(BATCH * STEPS)
    reference = _pair_reference(optimizer)
    model = _mlp_pair()
    strategy = keras.distribution.ModelParallel(layout_map=_pair_layouts(_mesh(shape)))
    trainer = epl.EPLTrainer(model, LOSS, OPTIMIZERS[optimizer](), strategy=strategy)
    assert [tg.kind for tg in trainer.plan.taskgraphs] == ["replicate", "split"]
    assert trainer.plan.num_replicas == shape[0]
    _fit(trainer, x, y)
    assert max_weight_difference(reference, model) < (ATOL_ADAM if optimizer == "adam" else ATOL)
    # Each device holds 1/width of the pair's kernels and of up's bias, the rest whole.
    width = shape[1]
    pair = (6 * 16 + 16 + 16 * 8) * 4
    rest = (8 + 8 * 3 + 3) * 4
    assert set(trainer.placement().values()) == {pair // width + rest}


def test_a_pair_followed_by_a_row_laid_out_layer_stays_a_pair(caplog):
    """logits laid out ('model', None) after the pair reads down's output: down is the
    pair's row, not a column of another pair, so up -> down still computes sharded and
    logits' kernel is gathered on use (everything was gathered before)."""
    x, y = mlp_data(BATCH * STEPS)
    reference = _pair_reference("sgd")
    layout_map = _pair_layouts(_mesh((1, 2)))
    layout_map["logits/kernel"] = ("model", None)
    model = _mlp_pair()
    strategy = keras.distribution.ModelParallel(layout_map=layout_map)
    with caplog.at_level("INFO", logger="epl_trainer"):
        trainer = epl.EPLTrainer(model, LOSS, OPTIMIZERS["sgd"](), strategy=strategy)
    assert (
        "(Megatron pairs): up, down; vocabulary-parallel lookups: none; held sharded, "
        "gathered on use: logits/kernel" in caplog.text
    )
    _fit(trainer, x, y)
    assert max_weight_difference(reference, model) < ATOL


@pytest.mark.parametrize(
    "level", [pytest.param(v, marks=pytest.mark.combines(f"split+zero_{v}")) for v in ("v1", "v2")]
)
def test_zero_shards_over_the_batch_axis_of_a_tensor_parallel_mesh(level):
    """A (2, 2) mesh: the pair computes sharded over 'model', logits' kernel is gathered,
    and ZeRO shards the rest over 'batch' (the replicas); the step is Keras's. v2 holds
    the replicated biases in pieces too: fewer bytes per device than v1's 572."""
    x, y = mlp_data(BATCH * STEPS)
    reference = _pair_reference("sgd")
    layout_map = _pair_layouts(_mesh((2, 2)))
    layout_map["logits/kernel"] = ("model", None)
    model = _mlp_pair()
    strategy = keras.distribution.ModelParallel(layout_map=layout_map)
    trainer = epl.EPLTrainer(
        model, LOSS, OPTIMIZERS["sgd"](), strategy=strategy, config={"zero.level": level}
    )
    _fit(trainer, x, y)
    assert max_weight_difference(reference, model) < ATOL
    held = max(trainer.placement().values())
    assert held == 572 if level == "v1" else held < 572


@pytest.mark.combines("data_parallel+pipeline")
def test_stages_with_a_data_parallel_mesh_train():
    """A DataParallel over 4 devices with 2 stages is 2 replicas of a 2-stage pipeline,
    equal to Keras. (A map that shards variables with stages trains on batch x model x
    stages devices: test_keras_distribution_stages.py.)"""
    x, y = mlp_data(BATCH * STEPS)
    reference = _pair_reference("sgd")
    model = _mlp_pair()
    stages = {"up": 0, "down|logits": 1}
    strategy = keras.distribution.DataParallel(devices=_devices(4))
    trainer = epl.EPLTrainer(model, LOSS, OPTIMIZERS["sgd"](), strategy=strategy, stages=stages)
    assert (len(trainer.plan.taskgraphs), trainer.plan.num_replicas) == (2, 2)
    _fit(trainer, x, y)
    assert max_weight_difference(reference, model) < ATOL


def test_a_gated_mlp_laid_out_as_llamas_trains_tensor_parallel():
    """gate and up laid out (None, 'model') without biases, their product read by down
    laid out ('model', None): KerasHub Llama's MLP layout, on a functional model."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    gate = keras.layers.Dense(16, activation="silu", use_bias=False, name="gate")(inputs)
    up = keras.layers.Dense(16, use_bias=False, name="up")(inputs)
    h = keras.layers.Multiply(name="gated")([gate, up])
    h = keras.layers.Dense(8, use_bias=False, name="down")(h)
    model = keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    x, y = mlp_data(BATCH * STEPS)
    keras_reference(reference, x, y, OPTIMIZERS["sgd"](), BATCH, STEPS)
    layout_map = keras.distribution.LayoutMap(_mesh((2, 2)))
    layout_map["(gate|up)/kernel"] = (None, "model")
    layout_map["down/kernel"] = ("model", None)
    strategy = keras.distribution.ModelParallel(layout_map=layout_map)
    trainer = epl.EPLTrainer(model, LOSS, OPTIMIZERS["sgd"](), strategy=strategy)
    assert trainer.plan.taskgraphs[-1].kind == "split"  # the pair computes sharded
    _fit(trainer, x, y)
    assert max_weight_difference(reference, model) < ATOL


@pytest.mark.parametrize("shape", [(1, 2), (2, 2), (1, 4)])
def test_a_sharded_layout_outside_a_pair_is_gathered_on_use(shape, caplog):
    """dense_in's kernel laid out (None, 'model') with its bias whole makes no Megatron
    pair: each device holds its slice, gathered whole on use; the step is Keras's."""
    x, y = mlp_data(BATCH * STEPS)
    reference = _reference("sgd")
    layout_map = keras.distribution.LayoutMap(_mesh(shape))
    layout_map["dense_in/kernel"] = (None, "model")
    layout_map["logits/kernel"] = ("model", None)
    model = mlp()
    strategy = keras.distribution.ModelParallel(layout_map=layout_map)
    with caplog.at_level("INFO", logger="epl_trainer"):
        trainer = epl.EPLTrainer(model, LOSS, OPTIMIZERS["sgd"](), strategy=strategy)
    assert "gathered on use: dense_in/kernel, logits/kernel" in caplog.text
    assert "gathered on use: dense_in/kernel, logits/kernel" in str(trainer.plan)
    assert trainer.plan.num_replicas == shape[0]
    _fit(trainer, x, y)
    assert max_weight_difference(reference, model) < ATOL
    width = shape[1]
    sliced, whole = 6 * 16 + 16 * 3, 16 + 3
    assert set(trainer.placement().values()) == {(sliced // width + whole) * 4}


class SubclassedMLP(keras.Model):
    """mlp()'s layers in a subclassed model: no layer graph, no `outputs`."""

    def __init__(self):
        super().__init__()
        self.dense_in = keras.layers.Dense(16, activation="relu", name="dense_in")
        self.logits = keras.layers.Dense(3, name="logits")

    def call(self, x):
        return self.logits(self.dense_in(x))


def test_a_subclassed_model_with_sharded_layouts_trains_as_keras():
    """Its kernels held in blocks, gathered on use, on (1, 2). Before, the split pass read
    `model.outputs`, which a subclassed model lacks: AttributeError at the first step."""
    x, y = mlp_data(BATCH * STEPS)

    def make():
        keras.utils.set_random_seed(0)
        model = SubclassedMLP()
        model(x[:1])  # its layers built: variables to lay out
        return model

    reference = make()
    keras_reference(reference, x, y, OPTIMIZERS["sgd"](), BATCH, STEPS)
    layout_map = keras.distribution.LayoutMap(_mesh((1, 2)))
    layout_map[".*dense_in/kernel"] = (None, "model")  # paths start with the model's name
    layout_map[".*logits/kernel"] = ("model", None)
    model = make()
    strategy = keras.distribution.ModelParallel(layout_map=layout_map)
    trainer = epl.EPLTrainer(model, LOSS, OPTIMIZERS["sgd"](), strategy=strategy)
    assert "/dense_in/kernel, subclassed_mlp" in str(trainer.plan)  # gathered on use
    _fit(trainer, x, y)
    assert max_weight_difference(reference, model) < ATOL


def _square_mlp():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu", name="dense_in")(inputs)
    return keras.Model(inputs, keras.layers.Dense(4, name="logits")(h))


@pytest.mark.parametrize(
    "shape, layout, optimizer",
    [
        ((2, 2), ("model", "batch"), "sgd"),
        ((2, 2), ("batch", "model"), "adam"),
        ((2, 2), ("batch", None), "sgd"),
        ((4, 1), (None, "batch"), "adam"),
    ],
)
def test_storage_over_the_batch_axis_follows_the_layout(shape, layout, optimizer):
    """Both kernels laid out over the batch axis (and the model axis): each device holds
    its block, 1/(batch x model) of them, gathered whole on use; the step is Keras's.
    These failed before ("sharded over the batch axis ... not trained")."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 8)).astype("float32")
    y = rng.integers(0, 4, BATCH * STEPS)
    reference = _square_mlp()
    keras_reference(reference, x, y, OPTIMIZERS[optimizer](), BATCH, STEPS)
    layout_map = keras.distribution.LayoutMap(_mesh(shape))
    layout_map["dense_in/kernel"] = layout
    layout_map["logits/kernel"] = layout
    model = _square_mlp()
    strategy = keras.distribution.ModelParallel(layout_map=layout_map)
    trainer = epl.EPLTrainer(model, LOSS, OPTIMIZERS[optimizer](), strategy=strategy)
    _fit(trainer, x, y)
    assert max_weight_difference(reference, model) < (ATOL_ADAM if optimizer == "adam" else ATOL)
    parts = np.prod([dict(zip(("batch", "model"), shape))[a] for a in layout if a is not None])
    kernels, biases = 8 * 16 + 16 * 4, 16 + 4
    assert set(trainer.placement().values()) == {(kernels // parts + biases) * 4}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_storage_over_the_batch_axis_alone_keeps_plain_ops_under_auto(monkeypatch, optimizer):
    """A (2, 1) mesh (KerasHub's maps on an (N, 1) mesh) leaves one device per replica,
    but the blocks are gathered inside the lanes. Without oneDNN (GPUs) "auto" compiled
    each lane with XLA and then refused its own choice ("XLA cannot compile ... Received:
    jit_compile=True") to a user who never asked for XLA; jit_compile=True is refused."""
    monkeypatch.setattr(jit_choice, "onednn_enabled", lambda: False)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 8)).astype("float32")
    y = rng.integers(0, 4, BATCH * STEPS)
    reference = _square_mlp()
    keras_reference(reference, x, y, OPTIMIZERS[optimizer](), BATCH, STEPS)
    layout_map = keras.distribution.LayoutMap(_mesh((2, 1)))
    layout_map["dense_in/kernel"] = ("batch", None)
    strategy = keras.distribution.ModelParallel(layout_map=layout_map)
    model = _square_mlp()
    trainer = epl.EPLTrainer(model, LOSS, OPTIMIZERS[optimizer](), strategy=strategy)
    assert "gathered in the lanes" in trainer.engine_plan.jit.reason
    _fit(trainer, x, y)
    assert max_weight_difference(reference, model) < (ATOL_ADAM if optimizer == "adam" else ATOL)
    with pytest.raises(SplitError, match="XLA cannot compile"):
        epl.EPLTrainer(_square_mlp(), LOSS, "sgd", strategy=strategy, jit_compile=True)


def test_an_indivisible_dimension_names_the_variable_shape_axis_and_size():
    layout_map = keras.distribution.LayoutMap(_mesh((1, 2)))
    layout_map["logits/kernel"] = (None, "model")  # 3 logits over 2 devices
    strategy = keras.distribution.ModelParallel(layout_map=layout_map)
    with pytest.raises(
        ValueError,
        match=r"'logits/kernel' of shape \(16, 3\) is laid out \(None, 'model'\): dimension 1 "
        r"\(3\) is not divisible by mesh axis 'model' of size 2",
    ):
        epl.EPLTrainer(mlp(), LOSS, "sgd", strategy=strategy)


def test_layout_map_lookups_are_keras_own():
    layout_map = keras.distribution.LayoutMap(_mesh((2, 1)))
    layout_map[".*_in/kernel"] = (None, "model")
    layout_map["dense.*kernel"] = (None, "model")
    strategy = keras.distribution.ModelParallel(layout_map=layout_map)
    with pytest.raises(ValueError, match="matches multiple layout specification keys"):
        epl.EPLTrainer(mlp(), LOSS, "sgd", strategy=strategy)
    # An exact key wins over the patterns, as in Keras.
    layout_map["dense_in/kernel"] = (None, None)
    epl.EPLTrainer(mlp(), LOSS, "sgd", strategy=strategy)


def test_a_layout_map_key_that_lays_out_nothing_is_named(caplog):
    """Keras leaves a variable no key matches replicated without a word: a misspelt key
    ('dense-in', 'kernels') trained another layout than the one written, silently."""
    layout_map = keras.distribution.LayoutMap(_mesh((1, 2)))
    layout_map["dense-in/kernel"] = (None, "model")
    layout_map["logits/kernels"] = ("model", None)
    layout_map["dense_in/bias"] = ("model",)
    strategy = keras.distribution.ModelParallel(layout_map=layout_map)
    epl.EPLTrainer(mlp(), LOSS, "sgd", strategy=strategy)
    assert "Layout map keys ['dense-in/kernel', 'logits/kernels'] lay out no" in caplog.text


def test_a_layout_of_layer_outputs_is_refused():
    layout_map = keras.distribution.LayoutMap(_mesh((2, 1)))
    layout_map["dense_in/output"] = ("batch", None)
    strategy = keras.distribution.ModelParallel(layout_map=layout_map)
    with pytest.raises(ValueError, match=r"Layouts of layer outputs .*'dense_in/output'"):
        epl.EPLTrainer(mlp(), LOSS, "sgd", strategy=strategy)


def test_bad_meshes_and_strategies_are_named():
    with pytest.raises(ValueError, match=r"'cpu:99' is not a device of this worker"):
        epl.EPLTrainer(
            mlp(), LOSS, "sgd", strategy=keras.distribution.DataParallel(devices=["cpu:99"])
        )
    with pytest.raises(ValueError, match="names a device twice"):
        epl.EPLTrainer(
            mlp(),
            LOSS,
            "sgd",
            strategy=keras.distribution.DataParallel(devices=["cpu:1", "cpu:1"]),
        )
    with pytest.raises(TypeError, match=r"a keras\.distribution\.DataParallel or ModelParallel"):
        epl.EPLTrainer(mlp(), LOSS, "sgd", strategy=object())


# The 2-worker runs of tests/scripts/train_dp.py: name -> (its flags, replicas in the job).
TWO_WORKER_RUNS = {
    "keras_data_parallel": ("--keras_data_parallel", 4),
    "keras_gathered": ("--keras_gathered", 2),
    "keras_batch_blocks": ("--keras_batch_blocks --adam --checkpoint_dir {checkpoint}", 2),
    "keras_gathered_own_step": ("--keras_gathered --own_step", 2),
}


@pytest.fixture(scope="module")
def two_worker_job(tmp_path_factory):
    """One job of 2 worker processes x 2 devices (epl-launch) that trains each run of
    TWO_WORKER_RUNS in turn, a trainer each with its flags' config (one job, not one per
    run: the four took 22.6 s, most of it starting processes; one takes 7.2 s). Returns
    its folder: the runs' weights in out/<name>/, the checkpoint in checkpoint/."""
    import os

    from _launch import SCRIPTS, run_launch

    tmp_path = tmp_path_factory.mktemp("keras_distribution_workers")
    checkpoint = tmp_path / "checkpoint"
    runs = [
        f"--run={name}={flags.format(checkpoint=checkpoint)}"
        for name, (flags, _) in TWO_WORKER_RUNS.items()
    ]
    result = run_launch(os.path.join(SCRIPTS, "train_dp.py"), tmp_path, 2, 2, *runs, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    for name, (_, replicas) in TWO_WORKER_RUNS.items():
        assert f"[{name}] worker 0/2 devices=2 replicas={replicas}" in result.stdout
    return tmp_path


@pytest.mark.slow
@pytest.mark.timeout(360)
@pytest.mark.parametrize(
    "run, make_model, make_data",
    [
        ("keras_data_parallel", "make_model", "make_data"),
        ("keras_gathered", "make_embedding_model", "make_tied_data"),
        ("keras_batch_blocks", "make_embedding_model", "make_tied_data"),
        ("keras_gathered_own_step", "make_embedding_model", "make_tied_data"),
    ],
)
def test_two_workers_train_as_one_process(run, make_model, make_data, two_worker_job):
    """--keras_data_parallel: each worker's `DataParallel(devices=list_devices())` is its
    2 devices; the job's 4 lanes train as one process on the global batch.
    --keras_gathered: the job's (2, 2) mesh holds an embedding table and two kernels as
    halves over each worker's devices, gathered on use; the batch axis spans the 2
    workers, whose replicas sum the slices' gradients (the table's as (index, row) pairs)
    across processes: the weights of one process on the global batch.
    --keras_batch_blocks (Adam): the table and a kernel laid out over both axes of the
    job's (2, 2) mesh, so each device holds a quarter and the blocks over the batch axis
    sit on different workers, gathered across the processes on use (refused before);
    the checkpoint each worker saved holds its replicas' slabs, and restored into one
    process's data parallelism it gives the same weights and Adam slots.
    --own_step: --keras_gathered's run of a model with its own train_step, which reads the
    halves gathered on use (user_steps.py); the replicas' sums of the halves' gradients
    cross the processes. (The runs train in turn in one job: two_worker_job.)"""
    import sys

    from _launch import SCRIPTS

    sys.path.insert(0, SCRIPTS)
    import train_dp

    blocks = run == "keras_batch_blocks"
    checkpoint = str(two_worker_job / "checkpoint")
    model = getattr(train_dp, make_model)()
    if "--own_step" in TWO_WORKER_RUNS[run][0]:
        model = train_dp.with_own_step(model)
    optimizer = keras.optimizers.Adam(0.01) if blocks else keras.optimizers.SGD(0.1)
    trainer = epl.EPLTrainer(model, LOSS, optimizer)
    x, y = getattr(train_dp, make_data)()
    trainer.fit(x, y, batch_size=16, steps_per_epoch=3, verbose=0, shuffle=False)
    for worker in range(2):
        saved = np.load(two_worker_job / "out" / run / f"weights_{worker}.npz")
        for i, value in enumerate(model.get_weights()):
            np.testing.assert_allclose(saved[f"arr_{i}"], value, atol=1e-5)
    if blocks:
        import epl_trainer.training.checkpoint as ckpt

        manifest, _ = ckpt.read_all(ckpt.latest(checkpoint))
        assert "trainable/0@dim1=0:4" in manifest["entries"]  # the table's slab on worker 0
        restored = train_dp.make_embedding_model()
        into = epl.EPLTrainer(
            restored,
            LOSS,
            keras.optimizers.Adam(0.01),
            strategy=keras.distribution.DataParallel(devices=_devices(2)),
        )
        into.restore_checkpoint(checkpoint)
        for mine, theirs in zip(restored.get_weights(), model.get_weights()):
            np.testing.assert_allclose(mine, theirs, atol=1e-5)

        def state(optimizer):  # by name within the optimizer (its own name differs)
            return {v.path.split("/", 1)[1]: v.numpy() for v in optimizer.variables}

        expected = state(model.optimizer)
        found = state(restored.optimizer)
        assert sorted(found) == sorted(expected) and len(found) > 2
        for name, value in found.items():
            np.testing.assert_allclose(value, expected[name], atol=1e-5, err_msg=name)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.combines("split+multi_worker")
def test_kerashub_llama_on_a_mesh_over_two_workers_trains_as_keras(tmp_path):
    """KerasHub's Llama map on the job's (2, 2) mesh, a worker per batch coordinate: the
    decoder blocks compute tensor parallel within each worker, the map's blocks over the
    batch axis are gathered across the workers, and 4 Adam steps end where Keras's `fit`
    on one device ends, on both workers."""
    import os
    import sys

    from _launch import SCRIPTS, run_launch

    pytest.importorskip("keras_hub")
    sys.path.insert(0, SCRIPTS)
    import train_kerashub_mesh

    result = run_launch(
        os.path.join(SCRIPTS, "train_kerashub_mesh.py"), tmp_path, 2, 2, timeout=200
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "worker 0 replicas=2" in result.stdout
    assert "computed sharded in blocks: transformer_layer_1 (MLP)" in result.stdout
    reference = train_kerashub_mesh.make_llama()
    reference.compile(optimizer=OPTIMIZERS["adam"](), loss=LM_LOSS)
    x, y = train_kerashub_mesh.make_data()
    reference.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    for worker in range(2):
        saved = np.load(tmp_path / "out" / f"weights_{worker}.npz")
        for i, value in enumerate(reference.get_weights()):
            np.testing.assert_allclose(saved[f"arr_{i}"], value, atol=ATOL_ADAM)


def _embedding_model(mask_zero):
    keras.utils.set_random_seed(0)
    tokens = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(16, 8, mask_zero=mask_zero, name="embed")(tokens)
    h = keras.layers.GlobalAveragePooling1D()(h)  # reads the mask when there is one
    return keras.Model(tokens, keras.layers.Dense(3, name="logits")(h))


@pytest.mark.parametrize(
    "shape, optimizer, mask_zero",
    [((1, 2), "sgd", False), ((1, 2), "adam", True), ((2, 2), "adam", False)],
)
def test_an_embedding_laid_out_by_vocabulary_looks_up_in_place(shape, optimizer, mask_zero):
    """The table laid out ('model', None): each device holds half the vocabulary and looks
    up the ids it holds for all the replica's rows, a reduce-scatter summing the halves
    (the plan says so); the step is Keras's, Adam's rows applied sparsely as Keras does."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 16, (BATCH * STEPS, 5)).astype("int32")
    y = rng.integers(0, 3, BATCH * STEPS)
    reference = _embedding_model(mask_zero)
    keras_reference(reference, x, y, OPTIMIZERS[optimizer](), BATCH, STEPS)
    layout_map = keras.distribution.LayoutMap(_mesh(shape))
    layout_map["embed/embeddings"] = ("model", None)
    model = _embedding_model(mask_zero)
    strategy = keras.distribution.ModelParallel(layout_map=layout_map)
    trainer = epl.EPLTrainer(model, LOSS, OPTIMIZERS[optimizer](), strategy=strategy)
    assert "vocabulary-parallel lookups: embed/embeddings; held sharded, gathered on use: none" in (
        trainer.plan.layouts_description
    )
    _fit(trainer, x, y)
    assert max_weight_difference(reference, model) < (ATOL_ADAM if optimizer == "adam" else ATOL)
    assert set(trainer.placement().values()) == {(16 * 8 // shape[1] + 8 * 3 + 3) * 4}


def _token_pair_model():
    """ids -> Embedding -> a Megatron pair (up, down) -> logits over the vocabulary."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((8,), dtype="int32")
    h = keras.layers.Embedding(64, 16, name="token_embedding")(tokens)
    h = keras.layers.Dense(32, activation="relu", name="up")(h)
    h = keras.layers.Dense(16, name="down")(h)
    return keras.Model(tokens, keras.layers.Dense(64, name="logits")(h))


@pytest.mark.parametrize(
    "shape, table, optimizer",
    [((1, 2), None, "sgd"), ((1, 2), (None, "model"), "adam"), ((2, 2), ("model", None), "sgd")],
)
def test_micro_batches_of_a_sharded_map_under_a_keras_loss_train_as_keras(shape, table, optimizer):
    """Two micro-batches of a model whose Keras loss asserts its shapes (sparse
    cross-entropy): TF runs such asserts in program order, so with each lane's tasks
    emitted in turn lane 1's first forward waited for lane 0's second, which waited for
    lane 0's first backward and its collective with lane 1: the first step hung with no
    error (KerasHub's Llama too). The lanes now emit their tasks together; a hang would
    end in the watchdog's error after `communication.timeout_seconds`."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 64, (32, 9)).astype("int32")
    x, y = tokens[:, :-1], tokens[:, 1:]
    reference = _token_pair_model()
    keras_reference(reference, x, y, OPTIMIZERS[optimizer](), 8, 4)
    layout_map = keras.distribution.LayoutMap(_mesh(shape))
    layout_map["up/kernel"] = (None, "model")
    layout_map["down/kernel"] = ("model", None)
    if table is not None:
        layout_map["token_embedding/embeddings"] = table
    model = _token_pair_model()
    trainer = epl.EPLTrainer(
        model,
        LOSS,
        OPTIMIZERS[optimizer](),
        strategy=keras.distribution.ModelParallel(layout_map=layout_map),
        config={"pipeline.num_micro_batch": 2, "communication.timeout_seconds": 60},
    )
    trainer.fit(x, y, batch_size=8, steps_per_epoch=4, shuffle=False, verbose=0)
    assert max_weight_difference(reference, model) < (ATOL_ADAM if optimizer == "adam" else ATOL)


class _CheckedInput(keras.layers.Layer):
    """Passes its input on once a tf.debugging assert on it ran (a stateful op that
    touches no resource, gating the data)."""

    def call(self, x):
        check = tf.debugging.assert_less(tf.reduce_max(tf.abs(x)), 1e6)
        with tf.control_dependencies([check]):
            return tf.identity(x)


def _checked_pair_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(16, activation="relu", name="up")(_CheckedInput()(inputs))
    h = _CheckedInput()(keras.layers.Dense(8, name="down")(h))
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))


@pytest.mark.parametrize("micro_batches, optimizer", [(1, "sgd"), (2, "adam")])
def test_asserts_around_a_megatron_pair_do_not_order_one_lane_after_another(
    micro_batches, optimizer
):
    """A check gating the pair's input and another after its all-reduce: TF ran such
    asserts in one program order over the lanes, so lane 1's input check waited for lane
    0's second check, which waited for the all-reduce with lane 1: the first step hung,
    one micro-batch or two. Each lane's asserts are now ordered among its own
    (core/engine/lane_order.py)."""
    x, y = mlp_data(BATCH * STEPS)
    reference = _checked_pair_model()
    keras_reference(reference, x, y, OPTIMIZERS[optimizer](), BATCH, STEPS)
    model = _checked_pair_model()
    trainer = epl.EPLTrainer(
        model,
        LOSS,
        OPTIMIZERS[optimizer](),
        strategy=keras.distribution.ModelParallel(layout_map=_pair_layouts(_mesh((1, 2)))),
        config={"pipeline.num_micro_batch": micro_batches, "communication.timeout_seconds": 60},
    )
    assert "computed sharded (Megatron pairs): up, down" in trainer.plan.layouts_description
    _fit(trainer, x, y)
    assert max_weight_difference(reference, model) < (ATOL_ADAM if optimizer == "adam" else ATOL)


def _causal_lm_data(rows=32, length=8, vocabulary=64):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, vocabulary, (rows, length + 1)).astype("int32")
    features = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((rows, length), bool)}
    return features, tokens[:, 1:]


def _causal_lm(kind, query_heads=4, kv_heads=2):
    """A tiny KerasHub causal LM with random weights (nothing downloaded)."""
    keras_hub = pytest.importorskip("keras_hub")
    keras.utils.set_random_seed(0)
    size = dict(
        vocabulary_size=64,
        num_layers=2,
        num_query_heads=query_heads,
        num_key_value_heads=kv_heads,
        hidden_dim=16,
        intermediate_dim=64,
    )
    if kind == "llama":
        backbone = keras_hub.models.LlamaBackbone(**size)
        return keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)
    if kind == "qwen":  # Llama's blocks with biases on query, key and value
        backbone = keras_hub.models.QwenBackbone(**size)
        return keras_hub.models.QwenCausalLM(backbone, preprocessor=None)
    backbone = keras_hub.models.GemmaBackbone(**size, head_dim=4)
    return keras_hub.models.GemmaCausalLM(backbone, preprocessor=None)


LM_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@functools.cache  # the same weights for every test that asks for them (read only)
def _causal_lm_reference(kind, kv_heads=2, optimizer="sgd"):
    """Plain Keras `fit` on one device of `_causal_lm(kind, kv_heads)` on `_causal_lm_data()`
    (4 steps of 8 rows): its weights."""
    x, y = _causal_lm_data()
    reference = _causal_lm(kind, kv_heads=kv_heads)
    reference.compile(optimizer=OPTIMIZERS[optimizer](), loss=LM_LOSS)
    reference.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    return tuple(reference.get_weights())


def _difference_from(weights, model) -> float:
    return max(float(np.abs(u - v).max()) for u, v in zip(weights, model.get_weights()))


@pytest.mark.parametrize(
    "kind, shape, optimizer",
    [
        # Adam once per attention form, on (2, 2): Llama's query/key/value read from the
        # gathered whole (Qwen's, with biases) and Gemma's read from the lane's heads.
        # Llama's own Adam cells repeated its SGD cells with another optimizer. Llama on
        # (2, 2) is Qwen's (2, 2) cell without the biases, and trains on that mesh in
        # test_kerashub_blocks_computed_sharded_combine_with_zero_and_amp (SGD) and over
        # two workers in test_kerashub_llama_on_a_mesh_over_two_workers_trains_as_keras.
        ("llama", (1, 2), "sgd"),
        ("llama", (1, 4), "sgd"),
        ("gemma", (1, 2), "sgd"),
        ("gemma", (1, 4), "sgd"),
        ("gemma", (2, 2), "adam"),
        ("qwen", (2, 2), "adam"),
    ],
)
def test_kerashub_causal_lms_train_with_their_own_layout_maps_as_keras(kind, shape, optimizer):
    """`LlamaBackbone.get_layout_map` / `GemmaBackbone.get_layout_map` as KerasHub ships
    them. Inside KerasHub's subclassed decoder blocks, attention computes by heads and
    the MLP as a Megatron pair on each device's shares (decoder_blocks.py; before, every
    kernel was gathered whole and computed replicated); Llama's query, key and value,
    which its map lays out along the hidden dimension, are gathered whole and their
    heads computed. Storage follows the map over 'model' and 'batch'. 4 steps end where
    Keras's `fit` on one device ends. A device holds 0.556 of Llama's weights on (1, 2)
    (its reverse embedding stays whole), 0.330 on (1, 4) and 0.334 on (2, 2); of
    Gemma's 0.507, 0.260 and 0.261. Qwen's blocks are Llama's with biases on query, key
    and value, shared by heads."""
    keras_hub = pytest.importorskip("keras_hub")
    kv_heads = shape[1]  # Gemma's key/value kernels are laid out by kv head
    x, y = _causal_lm_data()
    reference = _causal_lm_reference(kind, kv_heads, optimizer)
    model = _causal_lm(kind, kv_heads=kv_heads)
    backbone = type(model.backbone)
    strategy = keras.distribution.ModelParallel(layout_map=backbone.get_layout_map(_mesh(shape)))
    trainer = epl.EPLTrainer(model, LM_LOSS, OPTIMIZERS[optimizer](), strategy=strategy)
    llama_like = kind in ("llama", "qwen")
    block, attention = (
        ("transformer_layer", "self_attention") if llama_like else ("decoder_block", "attention")
    )
    whole = "; query, key, value from the gathered whole" if llama_like else ""
    computed = [
        part
        for i in (1, 0)
        for part in (f"{block}_{i} (MLP)", f"{block}_{i}/{attention} (attention by heads{whole})")
    ]
    logits = ""
    if kind != "llama" and shape[0] == 1:  # a tied table, by vocabulary over 'model' only
        logits = "; vocabulary-parallel logits (sharded cross-entropy): token_embedding/embeddings"
    assert trainer.plan.layouts_description.endswith(
        "computed sharded in blocks: " + ", ".join(computed) + logits
    )
    trainer.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert _difference_from(reference, model) < (ATOL_ADAM if optimizer == "adam" else 1e-5)
    total = sum(int(np.prod(v.shape)) * 4 for v in model.weights)
    held = trainer.placement()
    assert len(held) == shape[0] * shape[1]
    if shape == (1, 2):
        assert max(held.values()) <= 0.6 * total
    del keras_hub


def _lane_collectives(trainer, x, y):
    """({(op type, input shape, dtype): count} of the collectives lane 1 (CPU:1) runs in
    one traced training step, every op of that step)."""
    from test_comm_options import all_ops

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True)
    graph = trainer.engine.program.train_on_iterator.get_concrete_function(iter(dataset)).graph
    ops = list(all_ops(graph))
    counts = collections.Counter(
        (op.type, tuple(op.inputs[0].shape.as_list()), op.inputs[0].dtype.name)
        for op in ops
        if op.type.startswith("Collective") and op.device.endswith("CPU:1")
    )
    return counts, ops


def test_a_gemma_block_sends_the_rows_of_one_all_reduce_each_way_per_pair():
    """Gemma (2 blocks, hidden 16, sequence 8, vocabulary 64) with its layout map on
    (1, 2), 8 rows a step, 4 on each lane. Per block, forward: the hidden rows gathered
    into attention (with the attention mask) and into the MLP, each pair's partial
    outputs reduce-scattered back (an all-to-all); backward their adjoints. The tied
    table looks up in place and computes each lane's vocabulary slice of the logits for
    the sharded cross-entropy. Those are all the rows that move; no kernel of a block is
    gathered (before, every one was: attention and MLP kernels computed replicated), nor
    the table (before, its logits read it whole), and no tensor of a whole vocabulary's
    logits exists on a lane."""
    pytest.importorskip("keras_hub")
    x, y = _causal_lm_data()
    model = _causal_lm("gemma")
    layout_map = type(model.backbone).get_layout_map(_mesh((1, 2)))
    trainer = epl.EPLTrainer(
        model,
        LM_LOSS,
        OPTIMIZERS["sgd"](),
        strategy=keras.distribution.ModelParallel(layout_map=layout_map),
    )
    trainer.fit(x, y, batch_size=8, steps_per_epoch=1, shuffle=False, verbose=0)
    blocks = 2
    collectives, graph = _lane_collectives(trainer, x, y)
    assert collectives == {
        # rows into attention and the MLP and into the logits forward; the pairs' and the
        # lookup's output gradients backward
        ("CollectiveGatherV2", (None, 8, 16), "float32"): 4 * blocks + 2,
        # the pairs' and the lookup's outputs forward; the pairs' and the logits' input
        # gradients backward; the accuracy's argmax (each lane's best logit)
        ("CollectiveAllToAllV2", (2, None), "float32"): 4 * blocks + 3,
        ("CollectiveGatherV2", (None, 8, 8), "int32"): blocks,  # the attention masks
        ("CollectiveGatherV2", (None, 8), "int32"): 1,  # the token ids into the lookup
        ("CollectiveGatherV2", (None,), "int32"): 1,  # the labels into the cross-entropy
        # the cross-entropy's row maximum, and its sums of exponentials and targets
        ("CollectiveReduceV2", (None,), "float32"): 1,
        ("CollectiveReduceV2", (None, 3), "float32"): 1,
        # the norms' scales (2 a block and the final one) reduced as data parallelism
        ("CollectiveReduceV2", (16,), "float32"): 2 * blocks + 1,
        ("CollectiveReduceV2", (), "float32"): 1,  # the loss metric's total
        # KerasHub compiles its tasks with token accuracy as a weighted metric: the
        # sample weights gathered for the cross-entropy, and the distributed argmax's
        # all-to-all of each lane's best class
        ("CollectiveGatherV2", (None, 8), "float32"): 1,
        ("CollectiveAllToAllV2", (2, None), "int64"): 1,
    }
    whole_vocabulary = [
        (op.name, out.shape)
        for op in graph
        for out in op.outputs
        if out.dtype.is_floating and out.shape.rank and out.shape[-1] == 64
    ]
    assert not whole_vocabulary


@pytest.mark.parametrize("sharded", [True, False])
def test_gemmas_tied_logits_by_vocabulary_give_keras_loss_accuracy_and_predictions(sharded):
    """Gemma on (1, 2) with token accuracy as a weighted metric: the loss and accuracy
    `fit` reports, the weights and `predict`'s logits (joined from the lanes' vocabulary
    slices) equal Keras's. A loss the sharded cross-entropy does not compute (one that
    ignores a class) leaves the logits to the whole table, gathered on use, and still
    equals Keras."""
    pytest.importorskip("keras_hub")
    loss = LM_LOSS if sharded else keras.losses.SparseCategoricalCrossentropy(True, ignore_class=0)
    metrics = ["sparse_categorical_accuracy"]
    x, y = _causal_lm_data()
    reference = _causal_lm("gemma")
    reference.compile(optimizer=OPTIMIZERS["sgd"](), loss=loss, weighted_metrics=metrics)
    expected = reference.fit(x, y, batch_size=8, shuffle=False, verbose=0).history
    model = _causal_lm("gemma")
    layout_map = type(model.backbone).get_layout_map(_mesh((1, 2)))
    trainer = epl.EPLTrainer(
        model,
        loss,
        OPTIMIZERS["sgd"](),
        weighted_metrics=metrics,
        strategy=keras.distribution.ModelParallel(layout_map=layout_map),
    )
    assert ("vocabulary-parallel logits" in trainer.plan.layouts_description) == sharded
    history = trainer.fit(x, y, batch_size=8, shuffle=False, verbose=0).history
    for name in ("loss", "sparse_categorical_accuracy"):
        np.testing.assert_allclose(history[name], expected[name], rtol=1e-6)
    assert max_weight_difference(reference, model) < 1e-6
    logits = trainer.predict(x, batch_size=8, verbose=0)
    assert logits.shape == (32, 8, 64)
    np.testing.assert_allclose(logits, reference.predict(x, verbose=0), atol=1e-5)


@pytest.mark.parametrize(
    "config, atol",
    [
        # ZeRO v1 is left to v2, which shards the same replicated variables over 'batch'
        # and reduce-scatters their gradients too; v1 with a layout map on (2, 2):
        # test_zero_shards_over_the_batch_axis_of_a_tensor_parallel_mesh.
        pytest.param({"zero.level": "v2"}, 1e-5, marks=pytest.mark.combines("split+zero_v2")),
        # bfloat16 compute against Keras's float32: 1.2e-5 after 4 steps
        pytest.param({"amp.level": "O1"}, 5e-5, marks=pytest.mark.combines("split+amp")),
    ],
)
def test_kerashub_blocks_computed_sharded_combine_with_zero_and_amp(config, atol):
    """Llama's layout map on (2, 2), its blocks computed sharded over 'model': ZeRO v2
    shards the replicated variables over 'batch' (9,808 bytes per device; v1 held 13,120),
    and mixed precision computes the blocks in bfloat16; each run ends where Keras's
    does."""
    pytest.importorskip("keras_hub")
    x, y = _causal_lm_data()
    reference = _causal_lm_reference("llama")
    model = _causal_lm("llama")
    layout_map = type(model.backbone).get_layout_map(_mesh((2, 2)))
    strategy = keras.distribution.ModelParallel(layout_map=layout_map)
    trainer = epl.EPLTrainer(model, LM_LOSS, OPTIMIZERS["sgd"](), strategy=strategy, config=config)
    assert "computed sharded in blocks" in trainer.plan.layouts_description
    trainer.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert _difference_from(reference, model) < atol
    if config.get("zero.level") == "v2":
        assert max(trainer.placement().values()) < 13_120


def test_a_block_whose_heads_the_axis_does_not_divide_is_computed_whole():
    """Llama with 2 key/value heads on (1, 4): its map lays the key and value kernels out
    along the hidden dimension (16, divisible), but 2 heads do not share over 4 lanes, so
    attention is gathered and computed whole, said in the plan; the MLP still computes
    sharded, and the step is Keras's."""
    pytest.importorskip("keras_hub")
    x, y = _causal_lm_data()
    reference = _causal_lm_reference("llama", kv_heads=2)
    model = _causal_lm("llama", kv_heads=2)
    layout_map = type(model.backbone).get_layout_map(_mesh((1, 4)))
    strategy = keras.distribution.ModelParallel(layout_map=layout_map)
    trainer = epl.EPLTrainer(model, LM_LOSS, OPTIMIZERS["sgd"](), strategy=strategy)
    described = trainer.plan.layouts_description
    assert (
        "computed sharded in blocks: transformer_layer_1 (MLP), transformer_layer_0 (MLP)"
        in described
    )
    assert (
        "blocks computed whole: transformer_layer_1/self_attention (num_key_value_heads=2 is "
        "not divisible by the model axis (4))" in described
    )
    trainer.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert _difference_from(reference, model) < 1e-5


def test_a_kerashub_tensor_parallel_checkpoint_restores_into_another_layout(tmp_path):
    """Llama with its layout map on (2, 2), Adam, 2 steps, saved (the blocks and their
    Adam slots joined from 4 devices); restored on (1, 2) (cut again for 2), 2 more steps:
    where 4 uninterrupted Keras steps end.

    Restored into 2-device data parallelism from (1, 2), a cell of its own before, is
    trimmed for the suite's time: joining Llama's blocks at the save is this test's, and a
    layout map's checkpoint restoring into Keras's DataParallel is
    test_keras_distribution_stages.py's
    test_a_checkpoint_of_stages_over_a_layout_map_restores_into_data_parallelism (a
    Megatron pair's: test_split.py's
    test_a_tensor_parallel_checkpoint_restores_into_data_parallelism)."""
    saved_on, restored_as = (2, 2), (1, 2)
    keras_hub = pytest.importorskip("keras_hub")
    x, y = _causal_lm_data()
    reference = _causal_lm_reference("llama", optimizer="adam")  # 4 uninterrupted steps
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map
    first = epl.EPLTrainer(
        _causal_lm("llama"),
        LM_LOSS,
        OPTIMIZERS["adam"](),
        strategy=keras.distribution.ModelParallel(layout_map=layout_map(_mesh(saved_on))),
    )
    half = {k: v[:16] for k, v in x.items()}
    first.fit(half, y[:16], batch_size=8, shuffle=False, verbose=0)
    first.save_checkpoint(str(tmp_path))
    model = _causal_lm("llama")
    strategy = keras.distribution.ModelParallel(layout_map=layout_map(_mesh(restored_as)))
    second = epl.EPLTrainer(model, LM_LOSS, OPTIMIZERS["adam"](), strategy=strategy)
    second.restore_checkpoint(str(tmp_path))
    rest = {k: v[16:] for k, v in x.items()}
    second.fit(rest, y[16:], batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert _difference_from(reference, model) < ATOL_ADAM


@pytest.mark.slow
def test_a_keras_application_with_its_kernels_laid_out_trains_as_keras():
    """keras.applications' MobileNetV3Small (a model we did not write: depthwise and 1x1
    convolutions, squeeze-excite, a 1x1-conv classifier) on a (1, 2) mesh, every
    convolution kernel laid out over 'model' on its output channels: each is held as its
    block and gathered on use, and the run equals Keras's fit (SGD)."""
    import re

    from test_third_party_models import as_dataset, image_batches, mobilenet_v3_small

    batches = image_batches()
    reference = mobilenet_v3_small()
    # Keras's own train_step run eagerly: the same math as the traced one, without tracing
    # a model the engine traces next (as test_third_party_models' references).
    reference.compile(
        keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(), run_eagerly=True
    )
    reference.fit(as_dataset(batches), verbose=0, shuffle=False)
    model = mobilenet_v3_small()
    layout_map = keras.distribution.LayoutMap(_mesh((1, 2)))
    kernels = [
        v.path
        for v in model.trainable_variables
        if v.path.endswith("/kernel") and len(v.shape) == 4 and v.shape[-1] % 2 == 0
    ]
    for path in kernels:
        layout_map[re.escape(path)] = (None, None, None, "model")
    strategy = keras.distribution.ModelParallel(layout_map=layout_map)
    trainer = epl.EPLTrainer(
        model,
        keras.losses.SparseCategoricalCrossentropy(),
        keras.optimizers.SGD(0.1),
        strategy=strategy,
    )
    trainer.fit(as_dataset(batches), verbose=0)
    assert len(kernels) > 30
    gathered = trainer.plan.layouts_description.split("gathered on use: ")[1]
    assert all(path in gathered for path in kernels)
    difference = max_weight_difference(reference, model)
    print(f"MobileNetV3Small on (1, 2): {difference:.2e} from Keras")
    assert difference < 1e-5
    whole = sum(v.numpy().nbytes for v in model.trainable_variables)
    assert max(trainer.placement().values()) < 0.75 * whole  # the kernels are halved


def test_a_compiled_model_brings_its_optimizer_loss_and_metrics_to_a_megatron_pair():
    """A model compiled with its optimizer, loss and metrics, given to EPLTrainer with
    only a ModelParallel strategy: its own objects train tensor-parallel as Keras's fit."""
    x, y = mlp_data(BATCH * STEPS)

    def compiled():
        model = _mlp_pair()
        model.compile(keras.optimizers.Adam(0.01), LOSS, metrics=["accuracy"])
        return model

    reference = compiled()
    reference.fit(x, y, batch_size=BATCH, steps_per_epoch=STEPS, shuffle=False, verbose=0)
    model = compiled()
    strategy = keras.distribution.ModelParallel(layout_map=_pair_layouts(_mesh((1, 2))))
    trainer = epl.EPLTrainer(model, strategy=strategy)
    history = trainer.fit(x, y, batch_size=BATCH, steps_per_epoch=STEPS, shuffle=False, verbose=0)
    assert "accuracy" in history.history
    assert "Megatron pairs): up, down;" in trainer.plan.layouts_description
    assert max_weight_difference(reference, model) < ATOL_ADAM
