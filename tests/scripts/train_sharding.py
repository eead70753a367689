"""Worker script for tests/test_dataset_sharding.py: fit on a tf.data.Dataset, one case
after another, each with a fresh trainer (io.auto_shard and the Dataset's own policy).

Run under `epl-launch`. Usage: train_sharding.py OUTPUT_DIR RECORDS_DIR [CASE ...]
Every case trains 2 epochs on the 64 rows of `make_data`; a row carries its id (0-63) as
the feature "id". Worker w writes, per case:
  OUTPUT_DIR/<case>_<w>.txt   "epoch [ids]" for every batch the compiled step consumed
  OUTPUT_DIR/<case>_<w>.npz   the final weights
RECORDS_DIR holds the test's TFRecord files (the "files" case): file f holds the ids
16f .. 16f + 15 in order.
"""

import argparse
import glob
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))

import numpy as np

import epl_trainer as epl

NUM_ROWS = 64
EPOCHS = 2
BATCH = 8  # a Dataset batch: each worker's (the trainer's meaning), or with
GLOBAL_BATCH = 16  # io.global_batches the global one (Keras's meaning)

# case: (trainer config, optimizer, how the Dataset is built)
CASES = {
    "auto_sgd": ({}, "sgd", "slices"),
    "data_adam": ({"io.auto_shard": "data"}, "adam", "slices"),
    "off_config": ({"io.auto_shard": "off"}, "sgd", "slices"),
    "off_option": ({}, "sgd", "slices_off"),
    "files": ({}, "sgd", "records"),
    "global_batches": ({"io.global_batches": True}, "sgd", "global"),
}


def make_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_ROWS, 6)).astype("float32")
    y = rng.integers(0, 3, NUM_ROWS).astype("int32")
    return x, y


def make_model(record_path=None, epoch=None):
    """An MLP on {"x", "id"}; with `record_path` its first layer prints `epoch` and the
    batch's ids there (tf.print runs in the compiled step: a line is a batch trained on)."""
    import keras
    import tensorflow as tf

    class RecordIds(keras.layers.Layer):
        def call(self, x, ids):
            if record_path is None:
                return x
            printed = tf.print(epoch, ids, summarize=-1, output_stream=f"file://{record_path}")
            with tf.control_dependencies([printed]):
                return tf.identity(x)

    keras.utils.set_random_seed(0)
    x = keras.Input((6,), name="x")
    ids = keras.Input((), dtype="int64", name="id")
    h = RecordIds(name="record")(x, ids)
    h = keras.layers.Dense(16, activation="relu", name="dense_in")(h)
    return keras.Model({"x": x, "id": ids}, keras.layers.Dense(3, name="logits")(h))


def make_optimizer(name):
    import keras

    return keras.optimizers.SGD(0.1) if name == "sgd" else keras.optimizers.Adam(0.01)


def make_dataset(kind, records_dir):
    import tensorflow as tf

    x, y = make_data()

    def lookup(ids):
        return {"x": tf.gather(x, ids), "id": ids}, tf.gather(y, ids)

    if kind == "records":
        files = sorted(glob.glob(os.path.join(records_dir, "*.tfrecord")))
        spec = {"id": tf.io.FixedLenFeature([], tf.int64)}
        ids = tf.data.TFRecordDataset(files).map(
            lambda record: tf.io.parse_single_example(record, spec)["id"]
        )
        return ids.batch(BATCH).map(lookup)
    rows = tf.data.Dataset.range(NUM_ROWS)
    dataset = rows.batch(GLOBAL_BATCH if kind == "global" else BATCH).map(lookup)
    if kind == "slices_off":  # the tf.distribute way of saying "do not shard this one"
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        dataset = dataset.with_options(options)
    return dataset


def run_case(case, output_dir, records_dir, worker):
    import keras
    import tensorflow as tf

    config, optimizer, kind = CASES[case]
    epoch = tf.Variable(0, dtype=tf.int64, trainable=False)
    record = os.path.join(output_dir, f"{case}_{worker}.txt")
    trainer = epl.EPLTrainer(
        make_model(record, epoch),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        make_optimizer(optimizer),
        config=config,
    )
    history = trainer.fit(
        make_dataset(kind, records_dir),
        epochs=EPOCHS,
        verbose=0,
        callbacks=[keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, _: epoch.assign(e))],
    )
    np.savez(os.path.join(output_dir, f"{case}_{worker}.npz"), *trainer.model.get_weights())
    print(f"worker {worker} {case} loss={history.history['loss'][-1]:.6f}", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("records_dir")
    parser.add_argument("cases", nargs="*", default=list(CASES))
    args = parser.parse_args()
    env = epl.init()
    os.makedirs(args.output_dir, exist_ok=True)
    for case in args.cases:
        run_case(case, args.output_dir, args.records_dir, env.cluster.worker_index)


if __name__ == "__main__":
    main()
