"""Asynchronous checkpoint saves (`checkpoint.async_save`): the step hands a snapshot to a
background writer; what is saved is the state of the step that asked, whatever training
did meanwhile; one save in flight; `latest` moves only once a save is complete."""

import os
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from _models import LOSS, mlp, mlp_data

import epl_trainer as epl
from epl_trainer.training import checkpoint as ckpt
from epl_trainer.training import checkpoint_writer
from epl_trainer.training.checkpoint import CheckpointError


def _trainer(model, folder=None, asynchronous=True, optimizer=None, **config):
    config = {"cluster.virtual_devices": 2, "checkpoint.async_save": asynchronous, **config}
    if folder is not None:
        config.update({"checkpoint.dir": str(folder), "checkpoint.save_steps": 1})
        config["checkpoint.keep_max"] = 100
    return epl.EPLTrainer(model, LOSS, optimizer or keras.optimizers.Adam(0.01), config=config)


def _dataset():
    x, y = mlp_data()
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(16)


def _values(path):
    return ckpt.read_all(path)[1]


@pytest.fixture
def slow_writer():
    """Holds each background write back 0.3 s: training goes on past the saved step."""
    checkpoint_writer.before_write = lambda step: time.sleep(0.3)
    yield
    checkpoint_writer.before_write = None


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_async_saves_hold_the_state_of_the_step_that_asked(tmp_path, slow_writer, optimizer):
    """Every step's asynchronous checkpoint equals the synchronous run's, bit for bit, while
    the writer lags behind training. Before the snapshot read each variable at the step, an
    entry handed over as a variable was written with a later step's value."""
    make = (lambda: keras.optimizers.SGD(0.1)) if optimizer == "sgd" else None
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    _trainer(mlp(), sync_dir, False, make and make()).fit(_dataset(), epochs=2, verbose=0)
    _trainer(mlp(), async_dir, True, make and make()).fit(_dataset(), epochs=2, verbose=0)
    steps = ckpt.list_checkpoints(str(sync_dir))
    assert steps == list(range(1, 9)) == ckpt.list_checkpoints(str(async_dir))
    for step in steps:
        want = _values(os.path.join(sync_dir, f"ckpt-{step}"))
        got = _values(os.path.join(async_dir, f"ckpt-{step}"))
        assert sorted(got) == sorted(want)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"step {step} {key}")
    assert (async_dir / "latest").read_text() == "ckpt-8"  # fit's end waited for the writer
    # no temporary left (.spare: the dropped checkpoint's file, for the next save)
    assert not [n for n in os.listdir(async_dir) if n.startswith(".") and n != ".spare"]


def _pair_model(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,), name="x")
    h = keras.layers.Dense(16, activation="relu", name="up")(inputs)
    h = keras.layers.Dense(8, activation="tanh", name="down")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))


def _tensor_parallel():
    devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(2)]
    mesh = keras.distribution.DeviceMesh((1, 2), ("batch", "model"), devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")
    layout_map["down/kernel"] = ("model", None)
    layout_map["logits/kernel"] = ("model", None)  # no pair: held as blocks, gathered
    return keras.distribution.ModelParallel(layout_map=layout_map)


# Pipeline stages with micro-batches only: the stages' variables are snapshot at the step
# whether one micro-batch or two ran in it. The stages' cell without micro-batches re-ran
# the same snapshot (trimmed for the suite's time).
MODES = {
    "zero_v2": {"zero.level": "v2"},
    "pipeline_micro_batches": {
        "auto.auto_parallel": True,
        "pipeline.num_stages": 2,
        "pipeline.num_micro_batch": 2,
    },
    "tensor_parallel": None,  # Keras's ModelParallel: a Megatron pair and gathered blocks
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_async_saves_equal_sync_saves_in_other_modes(tmp_path, slow_writer, mode):
    """ZeRO v2's pieces, pipeline stages and tensor-parallel blocks are snapshot at the
    step too: every asynchronous checkpoint equals the synchronous run's, bit for bit."""
    folders = {}
    for asynchronous in (False, True):
        folder = tmp_path / ("async" if asynchronous else "sync")
        config = {
            "checkpoint.dir": str(folder),
            "checkpoint.save_steps": 1,
            "checkpoint.keep_max": 100,
            "checkpoint.async_save": asynchronous,
        }
        if MODES[mode] is None:
            model, strategy = _pair_model(), _tensor_parallel()
        else:
            model, strategy = mlp(), None
            config.update({"cluster.virtual_devices": 2, **MODES[mode]})
        trainer = epl.EPLTrainer(
            model, LOSS, keras.optimizers.Adam(0.01), config=config, strategy=strategy
        )
        x, y = mlp_data()
        if MODES[mode] is None:
            x = x[:, :6]
        trainer.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        folders[asynchronous] = folder
    steps = ckpt.list_checkpoints(str(folders[False]))
    assert steps == ckpt.list_checkpoints(str(folders[True])) and len(steps) >= 4
    for step in steps:
        want = _values(os.path.join(folders[False], f"ckpt-{step}"))
        got = _values(os.path.join(folders[True], f"ckpt-{step}"))
        assert sorted(got) == sorted(want)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"step {step} {key}")


def test_an_accelerators_values_are_copied_to_host_memory_at_the_snapshot():
    """On a GPU the snapshot copies each value to the host (the device's memory is the
    training's); on CPU a read already is host memory and shares its buffer."""
    from epl_trainer.training.checkpoint_manager import _needs_host_copy

    assert _needs_host_copy("/job:worker/replica:0/task:1/device:GPU:0")
    assert _needs_host_copy("/job:localhost/replica:0/task:0/device:TPU:3")
    assert not _needs_host_copy("/job:localhost/replica:0/task:0/device:CPU:1")
    assert not _needs_host_copy("")  # an eager tensor TensorFlow placed on the host


def test_one_save_in_flight_and_latest_moves_only_when_it_is_written(tmp_path):
    """While the writer is held, `latest` names the previous checkpoint and the next save
    waits; released, the save is published."""
    trainer = _trainer(mlp())
    trainer.fit(_dataset(), epochs=1, verbose=0)
    first = trainer.save_checkpoint(str(tmp_path))
    assert trainer.wait_for_checkpoint() == first
    assert (tmp_path / "latest").read_text() == "ckpt-4"

    release, writing, running = threading.Event(), [], []

    def held(step):
        running.append(step)
        writing.append(len(running))  # saves writing at once
        release.wait(30)
        running.remove(step)

    checkpoint_writer.before_write = held
    try:
        trainer.fit(_dataset(), epochs=1, verbose=0)
        second = trainer.save_checkpoint(str(tmp_path))  # returns at once
        assert second.endswith("ckpt-8")
        time.sleep(0.2)
        assert (tmp_path / "latest").read_text() == "ckpt-4"
        waiter = threading.Thread(target=trainer.save_checkpoint, args=(str(tmp_path), None, "x"))
        waiter.start()
        time.sleep(0.3)
        assert waiter.is_alive()  # the third save waits for the second
        release.set()
        waiter.join(30)
        assert trainer.wait_for_checkpoint().endswith("x")
    finally:
        checkpoint_writer.before_write = None
    assert max(writing) == 1
    assert (tmp_path / "latest").read_text() == "x"
    assert ckpt.list_tags(str(tmp_path)) == ["ckpt-4", "ckpt-8", "x"]


def test_a_failed_background_write_is_raised_at_the_next_save_and_latest_stays(tmp_path):
    trainer = _trainer(mlp())
    trainer.fit(_dataset(), epochs=1, verbose=0)
    trainer.save_checkpoint(str(tmp_path))
    trainer.wait_for_checkpoint()

    def fail(step):
        raise OSError(28, "No space left on device")

    checkpoint_writer.before_write = fail
    try:
        trainer.fit(_dataset(), epochs=1, verbose=0)
        trainer.save_checkpoint(str(tmp_path))
    finally:
        checkpoint_writer.before_write = None
    with pytest.raises(CheckpointError, match=r"asynchronous save of step 8 .* No space left"):
        trainer.save_checkpoint(str(tmp_path))
    assert (tmp_path / "latest").read_text() == "ckpt-4"
    assert trainer.wait_for_checkpoint() is None  # reported once
    assert trainer.save_checkpoint(str(tmp_path)).endswith("ckpt-8")
    trainer.wait_for_checkpoint()
    assert (tmp_path / "latest").read_text() == "ckpt-8"


def test_fit_stopped_by_an_error_waits_for_the_writer(tmp_path):
    """An exception in fit leaves no save half written: the one in flight is published."""

    class Stop(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                raise RuntimeError("stop")

    checkpoint_writer.before_write = lambda step: time.sleep(0.3)
    try:
        trainer = _trainer(mlp(), tmp_path)
        with pytest.raises(RuntimeError, match="stop"):
            trainer.fit(_dataset(), epochs=1, verbose=0, callbacks=[Stop()])
    finally:
        checkpoint_writer.before_write = None
    assert (tmp_path / "latest").read_text() == "ckpt-2"  # saved after step 2's callback
    resumed = _trainer(mlp(seed=5))
    resumed.restore_checkpoint(str(tmp_path))
    assert int(resumed.optimizer.iterations.numpy()) == 2


def test_an_async_run_resumes_bit_for_bit(tmp_path):
    """Killed (here: a new trainer on the same folder) after its asynchronous saves, the run
    continues to the uninterrupted one's weights."""
    uninterrupted = mlp()
    _trainer(uninterrupted).fit(_dataset(), epochs=3, verbose=0)
    _trainer(mlp(), tmp_path).fit(_dataset(), epochs=2, verbose=0)
    resumed_model = mlp(seed=9)
    _trainer(resumed_model, tmp_path).fit(_dataset(), epochs=3, verbose=0)
    for got, want in zip(resumed_model.get_weights(), uninterrupted.get_weights()):
        np.testing.assert_array_equal(got, want)


def test_format_2_checkpoints_still_restore(tmp_path):
    """Checkpoints written before the raw shard files (TF tensor bundles, format 2)."""
    import json

    trainer = _trainer(mlp(), asynchronous=False)
    trainer.fit(_dataset(), epochs=1, verbose=0)
    path = trainer.save_checkpoint(str(tmp_path))
    values = _values(path)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    # Rewrite the shard as format 2 did: SaveV2, its files in the manifest.
    os.remove(os.path.join(path, "shard-0.bin"))
    keys = sorted(values)
    tf.raw_ops.SaveV2(
        prefix=os.path.join(path, "shard-0"),
        tensor_names=keys,
        shape_and_slices=[""] * len(keys),
        tensors=[tf.constant(values[k]) for k in keys],
    )
    files = [n for n in os.listdir(path) if n.startswith("shard-0.") and not n.endswith("json")]
    manifest["shards"]["shard-0"]["files"] = {
        n: os.path.getsize(os.path.join(path, n)) for n in files
    }
    manifest["format_version"] = 2
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    restored = _trainer(mlp(seed=4), asynchronous=False)
    restored.restore_checkpoint(str(tmp_path))
    for got, want in zip(restored.model.get_weights(), trainer.model.get_weights()):
        np.testing.assert_array_equal(got, want)
