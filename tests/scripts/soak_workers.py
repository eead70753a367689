"""Worker script: a soak over two workers, where the watchdog is at work.

Usage: soak_workers.py OUTPUT_DIR [--steps N] [--slow_every K] [--pipeline] [--zero LEVEL]
Data parallel, or with --pipeline two stages, one per worker (both read the same data).
Every K-th batch takes longer than the watchdog's poll (a slow input), so the watchdog
probes every peer's collective service during those steps, as it does in a real job
whose input or checkpoint stalls. Worker w writes OUTPUT_DIR/soak_<w>.json: the
baseline after a warm-up, (step, threads, RSS MiB) samples, the number of health probes
and whether the watchdog thread was running.
"""

import argparse
import json
import os
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))

import numpy as np

import epl_trainer as epl
from epl_trainer.runtime import cluster as cluster_lib
from epl_trainer.training.memory import process_rss_mib, process_threads

SAMPLE_EVERY = 500
# communication.timeout_seconds: the watchdog polls every 4 s (a quarter of it). A slow
# batch outlasts two polls, so one poll surely finds it in flight and probes, and leaves
# 7.5 s before the timeout: with 4 s and 2.5 s, a step in CI's loaded run (two suite
# processes beside these two workers) once took 7 s and the watchdog rightly aborted it.
TIMEOUT_SECONDS = 16
SLOW_SECONDS = 8.5


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--slow_every", type=int, default=700)
    parser.add_argument("--pipeline", action="store_true", help="stage 0 | stage 1")
    parser.add_argument("--zero", default="", help="zero.level")
    args = parser.parse_args()
    import keras
    import tensorflow as tf

    probes = []
    probe = cluster_lib.Cluster.unreachable_workers

    def counted_probe(self, *a, **k):  # the watchdog's health probe, counted
        probes.append(time.monotonic())
        return probe(self, *a, **k)

    cluster_lib.Cluster.unreachable_workers = counted_probe
    env = epl.init({"zero.level": args.zero})
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4, name="logits")(hidden))
    x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")
    y = (x[:, :4].argmax(axis=1)).astype("int32")

    def slow_input(index, element):
        def wait(i):
            if args.slow_every and i % args.slow_every == args.slow_every - 1:
                time.sleep(SLOW_SECONDS)
            return i

        token = tf.numpy_function(wait, [index], tf.int64)
        with tf.control_dependencies([token]):
            return tf.nest.map_structure(tf.identity, element)

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat().enumerate()
    dataset = dataset.map(slow_input)
    trainer = epl.EPLTrainer(
        model,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=keras.optimizers.Adam(1e-3),
        stages={"hidden": 0, "logits": 1} if args.pipeline else None,
    )
    trainer.fit(dataset, epochs=1, steps_per_epoch=200, verbose=0)  # warm up (compiles)
    # A short timeout from now on, so that the watchdog polls often; set after the
    # warm-up, whose first step compiles for longer than it.
    timeout = {"communication.timeout_seconds": TIMEOUT_SECONDS}
    trainer.config = trainer.config.replace(timeout)
    threads, rss = process_threads(), process_rss_mib()
    samples = []

    def sample(batch, logs):
        if (batch + 1) % SAMPLE_EVERY == 0:
            samples.append((batch + 1, process_threads(), process_rss_mib()))

    history = trainer.fit(
        dataset,
        epochs=1,
        steps_per_epoch=args.steps,
        verbose=0,
        callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=sample)],
    )
    result = {
        "baseline": [threads, rss],
        "samples": samples,
        "probes": len(probes),
        "watchdog_running": any(t.name == "epl-watchdog" for t in threading.enumerate()),
        "loss": history.history["loss"][0],
    }
    path = os.path.join(args.output_dir, f"soak_{env.cluster.worker_index}.json")
    os.makedirs(args.output_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
