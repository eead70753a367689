"""A tf.data.Dataset given to fit is sharded across workers as tf.distribute shards one
(io.auto_shard; `data.shard_dataset`): by the files its pipeline reads, or by its
batches, unless it or the config says off."""

import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from _launch import SCRIPTS, run_launch

from epl_trainer.config.sections import Config, ConfigError
from epl_trainer.training import data as data_lib

sys.path.insert(0, SCRIPTS)
import train_sharding

ROWS, ROWS_PER_FILE = train_sharding.NUM_ROWS, 16


def write_records(folder) -> list[str]:
    """4 TFRecord files; file f holds the ids 16f .. 16f + 15, in order."""
    os.makedirs(folder, exist_ok=True)
    files = []
    for f in range(ROWS // ROWS_PER_FILE):
        path = os.path.join(folder, f"part-{f}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for i in range(f * ROWS_PER_FILE, (f + 1) * ROWS_PER_FILE):
                feature = tf.train.Feature(int64_list=tf.train.Int64List(value=[i]))
                example = tf.train.Example(features=tf.train.Features(feature={"id": feature}))
                writer.write(example.SerializeToString())
        files.append(path)
    return files


def ids_read(dataset) -> list[list[int]]:
    return [batch.numpy().tolist() for batch in dataset]


def id_batches(batch=8):
    return tf.data.Dataset.range(ROWS).batch(batch)


def record_batches(files, batch=8):
    spec = {"id": tf.io.FixedLenFeature([], tf.int64)}
    records = tf.data.TFRecordDataset(files)
    return records.map(lambda r: tf.io.parse_single_example(r, spec)["id"]).batch(batch)


def with_policy(dataset, policy):
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy
    return dataset.with_options(options)


def shards_of(dataset, shards=2, **kwargs) -> list[list[list[int]]]:
    return [ids_read(data_lib.shard_dataset(dataset, k, shards, **kwargs)) for k in range(shards)]


def rows(batches) -> list[int]:
    return [i for batch in batches for i in batch]


# ---- one process: which batches each input shard reads


def test_batches_without_files_are_dealt_by_data_every_row_once():
    first, second = shards_of(id_batches())  # io.auto_shard="auto": no files -> data
    assert first == [list(range(s, s + 8)) for s in (0, 16, 32, 48)]
    assert second == [list(range(s, s + 8)) for s in (8, 24, 40, 56)]
    assert shards_of(id_batches(), auto_shard="data") == [first, second]


def test_a_pipeline_reading_files_is_sharded_by_its_files(tmp_path):
    files = write_records(tmp_path)
    by_files = shards_of(record_batches(files))  # auto -> files: shard k reads files k, k+2
    assert rows(by_files[0]) == [*range(0, 16), *range(32, 48)]
    assert rows(by_files[1]) == [*range(16, 32), *range(48, 64)]
    assert shards_of(record_batches(files), auto_shard="files") == by_files
    by_data = shards_of(record_batches(files), auto_shard="data")
    assert rows(by_data[0]) == [*range(0, 8), *range(16, 24), *range(32, 40), *range(48, 56)]


def test_off_in_the_config_or_on_the_dataset_gives_every_shard_everything():
    everything = ids_read(id_batches())
    assert shards_of(id_batches(), auto_shard="off") == [everything, everything]
    off = with_policy(id_batches(), tf.data.experimental.AutoShardPolicy.OFF)
    assert shards_of(off) == [everything, everything]
    # The dataset's own policy wins over the config's, as under tf.distribute.
    data = with_policy(id_batches(), tf.data.experimental.AutoShardPolicy.DATA)
    assert shards_of(data, auto_shard="off") == shards_of(id_batches(), auto_shard="data")
    assert ids_read(data_lib.shard_dataset(id_batches(), 0, 1)) == everything


def test_sharding_by_files_a_pipeline_that_reads_none_is_refused():
    with pytest.raises(
        ValueError, match=r"needs a pipeline that reads files.*io.auto_shard='files'"
    ):
        data_lib.shard_dataset(id_batches(), 0, 2, auto_shard="files")


def test_global_batches_take_rows_of_each_and_refuse_another_policy():
    first, second = shards_of(id_batches(16), global_batches=True)
    assert first == [list(range(s, s + 8)) for s in range(0, ROWS, 16)]
    assert second == [list(range(s + 8, s + 16)) for s in range(0, ROWS, 16)]
    assert shards_of(id_batches(16), auto_shard="data", global_batches=True) == [first, second]
    off = with_policy(id_batches(16), tf.data.experimental.AutoShardPolicy.OFF)
    with pytest.raises(ValueError, match=r"io.global_batches.*auto_shard_policy=OFF"):
        data_lib.shard_dataset(off, 0, 2, global_batches=True)
    for policy in ("files", "off"):  # refused on one worker too, not only once it runs on many
        with pytest.raises(ValueError, match=rf"io.auto_shard='{policy}' contradicts"):
            data_lib.shard_dataset(id_batches(16), 0, 1, auto_shard=policy, global_batches=True)


def test_the_key_takes_tf_distributes_policies():
    assert Config().io.auto_shard == "auto"
    assert Config({"io.auto_shard": "FILES"}).io.auto_shard == "files"
    with pytest.raises(ConfigError, match=r"io.auto_shard.*\['auto', 'files', 'data', 'off'\]"):
        Config({"io.auto_shard": "file"})


# ---- two worker processes: what each trained on, epoch by epoch


def trained_ids(out, case, worker) -> dict[int, list[int]]:
    """{epoch: the ids of every batch worker `worker` trained on, in order}."""
    by_epoch: dict[int, list[int]] = {}
    for line in (out / f"{case}_{worker}.txt").read_text().splitlines():
        epoch, ids = line.split(" ", 1)
        by_epoch.setdefault(int(epoch), []).extend(int(i) for i in ids.strip("[]").split())
    return by_epoch


def keras_weights(optimizer, epochs=train_sharding.EPOCHS):
    """Single-device Keras on the rows in order, batches of 16: the 2-worker job's global
    batches (worker 0's batch of 8 ++ worker 1's)."""
    x, y = train_sharding.make_data()
    model = train_sharding.make_model()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=train_sharding.make_optimizer(optimizer), loss=loss)
    inputs = {"x": x, "id": np.arange(ROWS, dtype="int64")}
    model.fit(inputs, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return model.get_weights()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_workers_train_each_row_once_per_epoch(tmp_path):
    write_records(tmp_path / "records")
    script = os.path.join(SCRIPTS, "train_sharding.py")
    result = run_launch(script, tmp_path, 2, 1, tmp_path / "records", timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    out, epochs = tmp_path / "out", range(train_sharding.EPOCHS)
    for case in ("auto_sgd", "data_adam", "files", "global_batches"):
        seen = [trained_ids(out, case, w) for w in range(2)]
        for epoch in epochs:
            assert sorted(seen[0][epoch] + seen[1][epoch]) == list(range(ROWS)), (case, seen)
    # By data: worker w trains on batches w, w + 2, ... of 8 rows.
    assert trained_ids(out, "auto_sgd", 0)[0] == rows([range(s, s + 8) for s in range(0, ROWS, 16)])
    # By files: worker 0 reads files 0 and 2 (ids 0-15, 32-47), worker 1 files 1 and 3.
    assert trained_ids(out, "files", 0)[0] == [*range(0, 16), *range(32, 48)]
    for case in ("off_config", "off_option"):
        for w in range(2):
            assert trained_ids(out, case, w) == {e: list(range(ROWS)) for e in epochs}, case
    # Sharded by data, per-worker batches of 8 (the trainer's meaning) and global batches
    # of 16 (io.global_batches, Keras's meaning) both train Keras's steps on batches of 16.
    for case, optimizer in (("auto_sgd", "sgd"), ("data_adam", "adam"), ("global_batches", "sgd")):
        expected = keras_weights(optimizer)
        for w in range(2):
            weights = np.load(out / f"{case}_{w}.npz")
            for i, value in enumerate(expected):
                np.testing.assert_allclose(weights[f"arr_{i}"], value, atol=1e-5, err_msg=case)
