"""Worker script for the IO slicing test: trains from TFRecord files with io.slicing=True.

Run under `epl-launch`. Usage:
  train_io.py OUTPUT_DIR FILE_GLOB [--steps N] [--batch_size B]
Records are tf.train.Example {id, x[6], y}. Worker w writes OUTPUT_DIR/seen_<w>.json: the
record ids its input pipeline actually parsed during fit (recorded by a py_function in
the parse function), and OUTPUT_DIR/weights_<w>.npz.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))

import numpy as np

import epl_trainer as epl


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("file_glob")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=4)
    args = parser.parse_args()
    env = epl.init({"io.slicing": True})
    import keras
    import tensorflow as tf

    seen = []

    def record_id(i):
        seen.append(int(i.numpy()))
        return i

    features = {
        "id": tf.io.FixedLenFeature([], tf.int64),
        "x": tf.io.FixedLenFeature([6], tf.float32),
        "y": tf.io.FixedLenFeature([], tf.int64),
    }

    def parse(record):
        parsed = tf.io.parse_single_example(record, features)
        record_seen = tf.py_function(record_id, [parsed["id"]], tf.int64)
        with tf.control_dependencies([record_seen]):
            return tf.identity(parsed["x"]), parsed["y"]

    keras.utils.set_random_seed(0)
    inp = keras.Input((6,))
    out = keras.layers.Dense(3)(keras.layers.Dense(8, activation="relu")(inp))
    trainer = epl.EPLTrainer(
        keras.Model(inp, out),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.SGD(0.1),
    )
    trainer.fit(
        args.file_glob,
        parse_fn=parse,
        batch_size=args.batch_size,
        steps_per_epoch=args.steps,
        verbose=0,
    )
    worker = env.cluster.worker_index
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, f"seen_{worker}.json"), "w") as f:
        json.dump(sorted(set(seen)), f)
    np.savez(os.path.join(args.output_dir, f"weights_{worker}.npz"), *trainer.model.get_weights())
    print(f"worker {worker} parsed {len(seen)} records", flush=True)


if __name__ == "__main__":
    main()
