"""Any input pipeline resumes exactly: a run stopped in its second pass and resumed from
its checkpoint by a fresh trainer on a fresh dataset object (a fresh process's view: the
dataset's seed generators start over) trains on every sample once, in the uninterrupted
run's order, and ends with its weights, bit for bit.

The sample ids each step trained on are printed by the model itself (train_ft's
RecordIds layer), so read-ahead of the input pipeline is not counted.
"""

import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from _launch import SCRIPTS
from test_io import FEATURES, write_tfrecords

import epl_trainer as epl

sys.path.insert(0, SCRIPTS)
import train_ft

EPOCHS, STOP_AT, SAVE_STEPS = 3, 11, 3  # 8 steps per pass: stopped in pass 2, saved at 9


def _arrays():
    x, y = train_ft.make_data()
    return {"x": x, "id": np.arange(len(x), dtype="int64")}, y


def _augment(seed, features, y):
    # A random augmentation TensorFlow can save: stateless, its seeds from Dataset.random.
    noise = tf.random.stateless_normal([6], seed, stddev=0.1)
    return {"x": features["x"] + noise, "id": features["id"]}, y


def _inputs(kind, tmp_path):
    """fit's arguments for one kind of input, built anew (a fresh dataset object)."""
    features, y = _arrays()
    if kind == "numpy":
        return {"x": features, "y": y, "batch_size": 8, "shuffle": True}
    if kind == "files":
        folder = tmp_path / "files"
        if not folder.exists():
            folder.mkdir()
            write_tfrecords(folder, num_files=4, records_per_file=16)

        def parse(record):
            parsed = tf.io.parse_single_example(record, FEATURES)
            return {"x": parsed["x"], "id": parsed["id"]}, parsed["y"]

        return {"x": str(folder / "*.tfrecord"), "parse_fn": parse, "batch_size": 8}
    if kind == "generator":  # a pipeline TensorFlow cannot save

        def rows():
            yield from zip(features["x"], features["id"], y)

        signature = (
            tf.TensorSpec([6], tf.float32),
            tf.TensorSpec([], tf.int64),
            tf.TensorSpec([], tf.int64),
        )
        dataset = tf.data.Dataset.from_generator(rows, output_signature=signature)
        return {"x": dataset.map(lambda x, i, label: ({"x": x, "id": i}, label)).batch(8)}
    dataset = tf.data.Dataset.from_tensor_slices((features, y))
    dataset = dataset.shuffle(64, seed=1, reshuffle_each_iteration=True)
    if kind == "tf.data random map":
        seeds = tf.data.Dataset.random(seed=3).batch(2)
        dataset = tf.data.Dataset.zip(seeds, dataset).map(lambda s, xy: _augment(s, *xy))
    return {"x": dataset.batch(8)}


def _ids(path):
    return [[int(i) for i in line.strip("[]\n").split()] for line in open(path)]


def _fit(tmp_path, kind, name, folder=None, stop_at=None, **config):
    record = tmp_path / f"{name}.txt"
    model = train_ft.make_model(str(record))
    config = {"cluster.virtual_devices": 1, **config}
    if folder is not None:
        config.update({"checkpoint.dir": str(folder), "checkpoint.save_steps": SAVE_STEPS})
    trainer = epl.EPLTrainer(
        model,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.Adam(0.01),
        config=config,
    )

    class Kill(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(trainer.optimizer.iterations.numpy()) == stop_at:
                raise KeyboardInterrupt  # as a kill: the step's own save never happens

    callbacks = [] if stop_at is None else [Kill()]
    try:
        trainer.fit(**_inputs(kind, tmp_path), epochs=EPOCHS, verbose=0, callbacks=callbacks)
    except KeyboardInterrupt:
        pass
    return model, _ids(record)


def _stopped_and_resumed(tmp_path, kind, **config):
    folder = tmp_path / "ckpt"
    _, before = _fit(tmp_path, kind, "killed", folder, STOP_AT, **config)
    assert len(before) == STOP_AT
    model, after = _fit(tmp_path, kind, "resumed", folder, **config)
    return model, before[:9] + after  # the checkpoint of step 9 is the newest


KINDS = ["tf.data reshuffling", "tf.data random map", "numpy", "files"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_resumed_run_reads_every_sample_once_in_the_uninterrupted_order(tmp_path, kind):
    reference, seen = _fit(tmp_path, kind, "uninterrupted")
    model, resumed_seen = _stopped_and_resumed(tmp_path, kind)
    assert len(seen) == EPOCHS * 8
    assert resumed_seen == seen
    for epoch in range(EPOCHS):  # each pass holds every sample once
        assert sorted(i for ids in seen[epoch * 8 : (epoch + 1) * 8] for i in ids) == list(
            range(64)
        )
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(got, want)


def test_without_the_input_state_a_reshuffling_pipeline_resumes_on_other_samples(tmp_path):
    """What the saved state fixes (and what every resume did before it): skipping the
    batches already taken of a reshuffled pass reads other samples."""
    _, seen = _fit(tmp_path, "tf.data reshuffling", "uninterrupted")
    _, resumed_seen = _stopped_and_resumed(
        tmp_path, "tf.data reshuffling", **{"checkpoint.input_state": False}
    )
    assert resumed_seen != seen


def test_a_generator_pipeline_says_why_it_resumes_by_skipping(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="epl_trainer"):
        _, seen = _fit(tmp_path, "generator", "uninterrupted")
        _, resumed_seen = _stopped_and_resumed(tmp_path, "generator")
    assert "The input pipeline's state cannot be saved with the checkpoint" in caplog.text
    assert "Resuming without the input pipeline's saved state" in caplog.text
    assert "skipping the 1 batch(es) already taken" in caplog.text
    assert resumed_seen == seen  # a deterministic generator: skipping is exact here
    assert os.path.isdir(tmp_path / "ckpt")


def test_the_input_state_is_stored_in_the_shard_and_a_damaged_one_is_skipped(tmp_path, caplog):
    """The iterator's state is bytes in the worker's shard file, hashed like every entry
    (no files beside it): a flipped byte is caught, named in a warning, and the resume
    skips the batches already taken instead of restoring a wrong state."""
    from epl_trainer.training import checkpoint as ckpt

    folder = tmp_path / "ckpt"
    _fit(tmp_path, "tf.data reshuffling", "killed", folder, STOP_AT)
    latest = ckpt.latest(str(folder))
    assert sorted(os.listdir(latest)) == ["manifest.json", "shard-0.bin", "shard-0.json"]
    where = ckpt.read_manifest(latest)["shards"]["shard-0"]["input"]["state"]
    assert where["nbytes"] > 0
    with open(os.path.join(latest, "shard-0.bin"), "r+b") as f:
        f.seek(where["offset"] + where["nbytes"] // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with caplog.at_level("WARNING", logger="epl_trainer"):
        _, after = _fit(tmp_path, "tf.data reshuffling", "resumed", folder)
    assert "'input state'" in caplog.text and "does not match the hash" in caplog.text
    assert "skipping the 1 batch(es) already taken" in caplog.text
    assert len(after) == EPOCHS * 8 - 9


def test_a_checkpoint_with_the_input_state_beside_its_shard_still_resumes_exactly(
    tmp_path, monkeypatch
):
    """Saves before the state went into the shard wrote a TensorFlow checkpoint of the
    iterator beside it (`input-<w>.index`, the record's "prefix"); such a checkpoint
    still resumes on the uninterrupted run's samples."""
    from epl_trainer.training import checkpoint as ckpt
    from epl_trainer.training import checkpoint_manager

    def save_beside(self):  # the earlier CheckpointManager._save_input_state
        iterator = self._progress.batches.iterator_to_save()
        saving[0] = iterator
        return {"position": self._progress.batches.position, "pending": True}

    saving = [None]
    real_write_shard = ckpt.write_shard

    def write_shard(folder, worker, entries, staging=None, inputs=None):
        if inputs is not None and inputs.pop("pending", False):
            name = f"input-{worker}"
            tf.train.Checkpoint(iterator=saving[0]).write(os.path.join(folder, name))
            inputs["prefix"] = name
        real_write_shard(folder, worker, entries, staging, inputs)

    _, seen = _fit(tmp_path, "tf.data reshuffling", "uninterrupted")
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint_manager.CheckpointManager, "_save_input_state", save_beside)
        patch.setattr(ckpt, "write_shard", write_shard)
        folder = tmp_path / "ckpt"
        _, before = _fit(tmp_path, "tf.data reshuffling", "killed", folder, STOP_AT)
    latest = ckpt.latest(str(folder))
    assert "input-0.index" in os.listdir(latest)
    _, after = _fit(tmp_path, "tf.data reshuffling", "resumed", folder)
    assert before[:9] + after == seen
