"""Engine checkpoints: a restored run continues exactly as the uninterrupted one."""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from _models import LOSS, max_weight_difference, mlp, mlp_data

import epl_trainer as epl
from epl_trainer.training.checkpoint import CheckpointError


def _trainer(model, devices=2):
    return epl.EPLTrainer(
        model, LOSS, keras.optimizers.Adam(0.01), config={"cluster.virtual_devices": devices}
    )


def _dataset():
    x, y = mlp_data()
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(16)


@pytest.mark.combines("checkpoint+data_parallel")
def test_restore_into_a_fresh_trainer_continues_identically(tmp_path):
    uninterrupted = mlp()
    _trainer(uninterrupted).fit(_dataset(), epochs=4, verbose=0)

    first = _trainer(mlp())
    first.fit(_dataset(), epochs=2, verbose=0)
    path = first.save_checkpoint(str(tmp_path))
    assert os.path.basename(path) == "ckpt-8"

    resumed_model = mlp(seed=123)  # different initial weights: all must come from the checkpoint
    resumed = _trainer(resumed_model)
    resumed.restore_checkpoint(str(tmp_path))
    assert resumed.epochs_done == 2
    assert int(resumed.optimizer.iterations.numpy()) == 8
    # After a restore `epochs` is the final epoch, as Keras documents it with
    # initial_epoch: epochs 2 and 3 run.
    history = resumed.fit(_dataset(), epochs=4, verbose=0)
    assert max_weight_difference(uninterrupted, resumed_model) == 0.0
    assert history.epoch == [2, 3]


def test_restore_fills_every_replica(tmp_path):
    first = _trainer(mlp(), devices=1)
    first.fit(_dataset(), epochs=1, verbose=0)
    first.save_checkpoint(str(tmp_path))
    resumed = _trainer(mlp(seed=9), devices=4)
    resumed.restore_checkpoint(str(tmp_path))
    state = resumed.engine.state
    for lane in state.trainable[1:]:
        for a, b in zip(lane, state.trainable[0]):
            np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value))


def test_latest_points_to_the_newest_complete_checkpoint(tmp_path):
    trainer = _trainer(mlp())
    trainer.fit(_dataset(), epochs=1, verbose=0)
    trainer.save_checkpoint(str(tmp_path))
    trainer.fit(_dataset(), epochs=1, verbose=0)
    trainer.save_checkpoint(str(tmp_path))
    assert (tmp_path / "latest").read_text() == "ckpt-8"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-4", "ckpt-8", "latest"]


def test_restore_by_tag_gives_the_named_older_checkpoint(tmp_path):
    """DeepSpeed's load_checkpoint(dir, tag): the folder name or its step picks the
    checkpoint; an unknown tag names the existing ones and changes nothing on disk."""
    trainer = _trainer(mlp())
    trainer.fit(_dataset(), epochs=1, verbose=0)
    trainer.save_checkpoint(str(tmp_path))
    at_step_4 = trainer.model.get_weights()
    trainer.fit(_dataset(), epochs=1, verbose=0)
    trainer.save_checkpoint(str(tmp_path))
    for tag in ("ckpt-4", 4, "4"):
        model = mlp(seed=5)
        restored = _trainer(model)
        assert restored.restore_checkpoint(str(tmp_path), tag=tag) == str(tmp_path / "ckpt-4")
        assert int(restored.optimizer.iterations.numpy()) == 4
        assert restored.epochs_done == 1
        for a, b in zip(model.get_weights(), at_step_4):
            np.testing.assert_array_equal(a, b)
    listing = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(
        CheckpointError, match=r"No checkpoint tagged 'ckpt-5'.*\['ckpt-4', 'ckpt-8'\]"
    ):
        _trainer(mlp()).restore_checkpoint(str(tmp_path), tag="ckpt-5")
    assert sorted(p.name for p in tmp_path.iterdir()) == listing
    assert (tmp_path / "latest").read_text() == "ckpt-8"


def test_a_tagged_save_is_kept_by_keep_max_and_restored_by_its_tag(tmp_path):
    """DeepSpeed's save_checkpoint(dir, tag): the tag names the folder; keep_max deletes
    only `ckpt-<step>` folders; `latest` points at the newest save, tagged or not."""
    trainer = _trainer(mlp())
    trainer.fit(_dataset(), epochs=1, verbose=0)
    for tag in ("latest", "12", "ckpt-3", ".hidden", "a/b"):
        with pytest.raises(ValueError, match="tag"):
            trainer.save_checkpoint(str(tmp_path), tag=tag)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
    assert trainer.save_checkpoint(str(tmp_path), tag="best") == str(tmp_path / "best")
    assert (tmp_path / "latest").read_text() == "best"
    at_step_4 = trainer.model.get_weights()
    trainer.fit(_dataset(), epochs=1, verbose=0)
    trainer.save_checkpoint(str(tmp_path), keep_max=1)
    trainer.fit(_dataset(), epochs=1, verbose=0)
    trainer.save_checkpoint(str(tmp_path), keep_max=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".spare", "best", "ckpt-12", "latest"]
    model = mlp(seed=5)
    restored = _trainer(model)
    assert restored.restore_checkpoint(str(tmp_path), tag="best") == str(tmp_path / "best")
    assert int(restored.optimizer.iterations.numpy()) == 4
    for a, b in zip(model.get_weights(), at_step_4):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(CheckpointError, match=r"Its checkpoints: \['ckpt-12', 'best'\]"):
        restored.restore_checkpoint(str(tmp_path), tag="ckpt-8")


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="No checkpoint in"):
        _trainer(mlp()).restore_checkpoint(str(tmp_path))


def test_corrupted_checkpoint_data_names_the_file(tmp_path):
    trainer = _trainer(mlp())
    trainer.fit(_dataset(), epochs=1, verbose=0)
    path = trainer.save_checkpoint(str(tmp_path))
    for name in os.listdir(path):
        if name.endswith(".bin"):
            with open(os.path.join(path, name), "r+b") as f:
                f.truncate(10)
    with pytest.raises(CheckpointError, match=r"shard-0\.bin' is truncated or corrupted"):
        _trainer(mlp()).restore_checkpoint(str(tmp_path))
    assert os.path.isdir(path)  # never removed or overwritten by a failed restore


def test_corrupted_metadata_is_a_clear_error(tmp_path):
    trainer = _trainer(mlp())
    trainer.fit(_dataset(), epochs=1, verbose=0)
    path = trainer.save_checkpoint(str(tmp_path))
    with open(os.path.join(path, "manifest.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError, match=r"manifest\.json.*corrupted"):
        _trainer(mlp()).restore_checkpoint(str(tmp_path))


def test_checkpoint_of_a_different_model_is_rejected(tmp_path):
    trainer = _trainer(mlp())
    trainer.fit(_dataset(), epochs=1, verbose=0)
    trainer.save_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match="shape"):
        _trainer(mlp(width=32)).restore_checkpoint(str(tmp_path))


@pytest.mark.combines("checkpoint+amp+one_device")
def test_amp_loss_scale_state_is_restored(tmp_path):
    config = {
        "cluster.virtual_devices": 1,
        "amp.level": "O1",
        "amp.dtype": "float16",  # bfloat16 has a fixed scale of 1
        "amp.initial_scale_power": 4,
        "amp.loss_scale_window": 2,
    }
    trainer = epl.EPLTrainer(mlp(), LOSS, keras.optimizers.Adam(0.01), config=config)
    trainer.fit(_dataset(), epochs=1, verbose=0)  # 4 clean steps: the scale doubles twice
    scale = float(trainer.engine.program.update.scaler.scale())
    assert scale == 2.0**6
    trainer.save_checkpoint(str(tmp_path))
    resumed = epl.EPLTrainer(mlp(seed=3), LOSS, keras.optimizers.Adam(0.01), config=config)
    resumed.restore_checkpoint(str(tmp_path))
    assert float(resumed.engine.program.update.scaler.scale()) == scale


def test_keep_max_keeps_only_the_newest(tmp_path):
    trainer = _trainer(mlp())
    for _ in range(3):
        trainer.fit(_dataset(), epochs=1, verbose=0)
        trainer.save_checkpoint(str(tmp_path), keep_max=2)
    # beside them, the dropped checkpoint's data file as the next save's (.spare)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".spare", "ckpt-12", "ckpt-8", "latest"]


def test_a_dropped_checkpoints_file_is_written_over_by_the_next_save(tmp_path):
    """keep_max=1: the data file of the checkpoint a save drops is kept as the worker's
    spare and the next save writes over it in place (the same inode: no deletion or
    allocation of a checkpoint's size per save), and every kept checkpoint restores
    exactly. A smaller model's save into the same folder cuts the recycled file to its
    own length."""
    directory = str(tmp_path)
    trainer = _trainer(mlp())
    for _ in range(2):
        trainer.fit(_dataset(), epochs=1, verbose=0)
        trainer.save_checkpoint(directory, keep_max=1)
    spare = os.path.join(directory, ".spare", "shard-0.bin")
    assert sorted(os.listdir(directory)) == [".spare", "ckpt-8", "latest"]
    inode = os.stat(spare).st_ino
    trainer.fit(_dataset(), epochs=1, verbose=0)
    path = trainer.save_checkpoint(directory, keep_max=1)
    assert os.stat(os.path.join(path, "shard-0.bin")).st_ino == inode
    restored_model = mlp(seed=7)
    _trainer(restored_model).restore_checkpoint(directory)
    assert max_weight_difference(trainer.model, restored_model) == 0.0
    # A smaller model's checkpoint in the same folder: the recycled file is cut to size.
    small = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    small_trainer = _trainer(small)
    small_trainer.fit(_dataset(), epochs=1, verbose=0)
    before = os.path.getsize(spare)
    path = small_trainer.save_checkpoint(directory, keep_max=1)
    assert os.path.getsize(os.path.join(path, "shard-0.bin")) < before
    restored_small = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    _trainer(restored_small).restore_checkpoint(directory)
    for a, b in zip(restored_small.get_weights(), small.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_stale_temporary_folders_of_dead_saves_are_removed(tmp_path):
    stale = tmp_path / ".tmp-ckpt-4-999999999"  # no such process
    stale.mkdir(parents=True)
    (stale / "state.index").write_text("half written")
    trainer = _trainer(mlp())
    trainer.fit(_dataset(), epochs=1, verbose=0)
    trainer.save_checkpoint(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-4", "latest"]


class _Interrupt(Exception):
    pass


@pytest.mark.combines("checkpoint+data_parallel")
def test_fit_with_checkpoint_dir_resumes_mid_epoch_like_an_uninterrupted_run(tmp_path):
    config = {"checkpoint.dir": str(tmp_path), "checkpoint.save_steps": 3}
    uninterrupted = mlp()
    _trainer(uninterrupted).fit(_dataset(), epochs=2, verbose=0)

    class InterruptAtStep7(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == 7:
                raise _Interrupt()

    first = epl.EPLTrainer(
        mlp(), LOSS, keras.optimizers.Adam(0.01), config={"cluster.virtual_devices": 2, **config}
    )
    with pytest.raises(_Interrupt):
        first.fit(_dataset(), epochs=2, callbacks=[InterruptAtStep7()], verbose=0)
    # Saved at steps 3, 4 (the first epoch's end) and 6: the second epoch's third batch is next.
    assert (tmp_path / "latest").read_text() == "ckpt-6"

    resumed_model = mlp(seed=5)
    resumed = epl.EPLTrainer(
        resumed_model,
        LOSS,
        keras.optimizers.Adam(0.01),
        config={"cluster.virtual_devices": 2, **config},
    )
    history = resumed.fit(_dataset(), epochs=2, verbose=0)  # epochs counts from the start
    assert history.epoch == [1]
    assert resumed.epochs_done == 2
    assert max_weight_difference(uninterrupted, resumed_model) == 0.0


def test_a_resumed_epoch_logs_the_metrics_of_all_its_batches(tmp_path):
    """The running loss and metrics of the epoch in progress are in a checkpoint saved
    mid-epoch: the resumed epoch's batch and epoch logs cover its batches before the
    checkpoint too, as the uninterrupted run's do (before: they restarted at the resume,
    and the epoch's logged loss was 0.07 off with SGD, the batch logs 0.3)."""

    def fit(callbacks=(), **config):
        trainer = epl.EPLTrainer(
            mlp(dropout=0.3),
            LOSS,
            keras.optimizers.SGD(0.05, momentum=0.9),
            metrics=["sparse_categorical_accuracy"],
            config={"cluster.virtual_devices": 2, **config},
        )
        seen = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: batch_logs.append(dict(logs))
        )
        return trainer.fit(_dataset(), epochs=2, callbacks=[seen, *callbacks], verbose=0)

    batch_logs = []
    uninterrupted = fit().history
    uninterrupted_batches, batch_logs = batch_logs[-2:], []

    class InterruptAtStep7(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == 7:
                raise _Interrupt()

    config = {"checkpoint.dir": str(tmp_path), "checkpoint.save_steps": 3}
    with pytest.raises(_Interrupt):
        fit([InterruptAtStep7()], **config)
    batch_logs = []
    resumed = fit(**config).history  # from step 6: the second epoch's last 2 batches
    assert len(batch_logs) == 2
    for key in ("loss", "sparse_categorical_accuracy"):
        np.testing.assert_allclose(resumed[key], uninterrupted[key][1:], rtol=0, atol=1e-6)
        np.testing.assert_allclose(
            [logs[key] for logs in batch_logs],
            [logs[key] for logs in uninterrupted_batches],
            rtol=0,
            atol=1e-6,
        )


def test_damaged_newest_checkpoint_stops_auto_resume_and_is_kept(tmp_path):
    trainer = _trainer(mlp())
    trainer.fit(_dataset(), epochs=1, verbose=0)
    path = trainer.save_checkpoint(str(tmp_path))
    (data,) = [os.path.join(path, n) for n in os.listdir(path) if n.endswith(".bin")]
    with open(data, "r+b") as f:
        f.truncate(10)
    before = sorted(os.listdir(tmp_path)), sorted(os.listdir(path))
    resumed = epl.EPLTrainer(
        mlp(),
        LOSS,
        keras.optimizers.Adam(0.01),
        config={"cluster.virtual_devices": 2, "checkpoint.dir": str(tmp_path)},
    )
    with pytest.raises(CheckpointError, match=r"shard-0\.bin' is truncated"):
        resumed.fit(_dataset(), epochs=2, verbose=0)
    assert (sorted(os.listdir(tmp_path)), sorted(os.listdir(path))) == before
    assert os.path.getsize(data) == 10


def test_resume_with_steps_per_epoch_continues_the_same_pass(tmp_path):
    # 8 batches, 3 steps per epoch: one iterator runs on across epochs (Keras semantics),
    # so the input position differs from the step within the epoch.
    def fit(model, callbacks=(), **config):
        config = {"cluster.virtual_devices": 2, **config}
        trainer = epl.EPLTrainer(model, LOSS, keras.optimizers.Adam(0.01), config=config)
        dataset = tf.data.Dataset.from_tensor_slices(mlp_data()).batch(8)
        return trainer.fit(
            dataset, epochs=3, steps_per_epoch=3, callbacks=list(callbacks), verbose=0
        )

    uninterrupted = mlp()
    fit(uninterrupted)

    class InterruptAtStep5(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == 5:
                raise _Interrupt()

    config = {"checkpoint.dir": str(tmp_path), "checkpoint.save_steps": 2}
    with pytest.raises(_Interrupt):
        fit(mlp(), [InterruptAtStep5()], **config)
    # The newest checkpoint is step 4: the second epoch's first step, batch 4 of the pass.
    assert (tmp_path / "latest").read_text() == "ckpt-4"
    metadata = json.loads((tmp_path / "ckpt-4" / "manifest.json").read_text())
    position = metadata["epochs_done"], metadata["step_in_epoch"], metadata["input_position"]
    assert position == (1, 1, 4)
    resumed = mlp(seed=7)
    fit(resumed, **config)
    assert max_weight_difference(uninterrupted, resumed) == 0.0


def test_restore_then_fit_finishes_the_run_as_checkpoint_dir_does(tmp_path, caplog):
    """Issue 48, item 4: a 2-epoch job of 6 steps per epoch (shuffled numpy, Dropout),
    checkpoints every 2 steps, interrupted at step 9 (newest: step 8, epoch 1's third
    step). `restore_checkpoint` then `fit(epochs=2)` (DeepSpeed's load_checkpoint habit)
    runs the 4 steps left and ends where the uninterrupted run ends; before, it ran 10
    (the rest of the epoch and one more) and ended 4.5e-2 away. A fit with no epoch left
    trains nothing and says so."""
    x, y = mlp_data(96)

    def fit(model, trainer=None, callbacks=(), **config):
        trainer = trainer or epl.EPLTrainer(
            model,
            LOSS,
            keras.optimizers.Adam(0.01),
            config={"cluster.virtual_devices": 2, **config},
        )
        trainer.fit(x, y, batch_size=16, epochs=2, callbacks=list(callbacks), verbose=0)
        return trainer

    uninterrupted = mlp(dropout=0.3)
    fit(uninterrupted)

    class InterruptAtStep9(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == 9:
                raise _Interrupt()

    with pytest.raises(_Interrupt):
        fit(
            mlp(dropout=0.3),
            callbacks=[InterruptAtStep9()],
            **{"checkpoint.dir": str(tmp_path / "run"), "checkpoint.save_steps": 2},
        )
    assert (tmp_path / "run" / "latest").read_text() == "ckpt-8"
    resumed_model = mlp(seed=7, dropout=0.3)
    resumed = epl.EPLTrainer(
        resumed_model, LOSS, keras.optimizers.Adam(0.01), config={"cluster.virtual_devices": 2}
    )
    resumed.restore_checkpoint(str(tmp_path / "run"))
    fit(resumed_model, trainer=resumed)
    assert int(resumed.optimizer.iterations.numpy()) == 12
    assert max_weight_difference(uninterrupted, resumed_model) == 0.0
    # Restored again (step 8, inside epoch 1), fit(epochs=1) has nothing left to run.
    resumed.restore_checkpoint(str(tmp_path / "run"))
    with caplog.at_level("WARNING", logger="epl_trainer"):
        resumed.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert int(resumed.optimizer.iterations.numpy()) == 8
    assert "fit(epochs=1) has no epoch to run: the restored checkpoint has 1 epoch(s)" in (
        caplog.text
    )


def test_a_torn_save_is_ignored_by_restore_and_named_in_warnings(tmp_path, caplog):
    """A save killed mid-write leaves its hidden temporary (`.tmp-ckpt-<step>-<pid>`):
    a restore reads the checkpoint `latest` names and says it ignores the torn one; the
    next save removes it, saying so."""
    import subprocess
    import sys

    trainer = _trainer(mlp())
    trainer.fit(_dataset(), epochs=1, verbose=0)
    trainer.save_checkpoint(str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    torn = tmp_path / f".tmp-ckpt-9-{int(dead.stdout)}"
    torn.mkdir()
    (torn / "shard-0.bin").write_bytes(b"half a shard")
    restored = _trainer(mlp(seed=3))
    with caplog.at_level("WARNING", logger="epl_trainer"):
        path = restored.restore_checkpoint(str(tmp_path))
    assert path.endswith("ckpt-4")
    assert f"Ignoring ['{torn.name}']" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="epl_trainer"):
        restored.save_checkpoint(str(tmp_path))
    assert f"Removing '{torn.name}'" in caplog.text
    assert not torn.exists()
    assert (tmp_path / "latest").read_text() == "ckpt-4"
