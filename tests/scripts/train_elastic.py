"""Worker script for the elastic tests: SGD on global batches, a checkpoint every 2 steps.

Run under `epl-launch --min_workers K` (which sets elastic.max_workers and the resize
file), or alone as the single-process reference. Usage:
  train_elastic.py OUTPUT_DIR [--kill_worker W --kill_at_step N] [--step_seconds S]
                   [--zero LEVEL] [--momentum M] [--pipeline]

The data are NUM_STEPS global batches of GLOBAL_BATCH samples (io.global_batches: each
worker trains on its rows of every batch). Writes into OUTPUT_DIR:
  weights.npz                 final weights (worker 0)
  ids_<w>_attempt<a>.txt      the sample ids the compiled step consumed, one line per
                              micro-batch
  attempt<a>.json             worker 0: when its process started, when training began
                              (after any restore) and when the first step ended; the
                              step it began at, the worker count and micro-batches
  killed.json                 when worker W killed itself (first attempt only)
"""

import argparse
import json
import os
import signal
import sys
import time

STARTED = time.time()  # before TensorFlow is imported: the process's own start-up counts

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))

import numpy as np  # noqa: E402
import train_ft  # noqa: E402  (its model records the ids of each batch)

import epl_trainer as epl  # noqa: E402

NUM_STEPS = 12
GLOBAL_BATCH = 12


def make_dataset():
    """Global batch t holds samples [12t, 12t+12), the same on every worker."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_STEPS * GLOBAL_BATCH, 6)).astype("float32")
    y = rng.integers(0, 3, NUM_STEPS * GLOBAL_BATCH).astype("int32")

    def lookup(ids):
        return {"x": tf.gather(x, ids), "id": ids}, tf.gather(y, ids)

    return tf.data.Dataset.range(NUM_STEPS * GLOBAL_BATCH).batch(GLOBAL_BATCH).map(lookup)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--kill_worker", type=int, default=-1)
    parser.add_argument("--kill_at_step", type=int, default=-1)
    # The shrunk job (attempt 1) must still be training when the test's join arrives; the
    # first job (killed at a fixed step) and the grown one have no need to wait.
    parser.add_argument(
        "--step_seconds", type=float, default=0.0, help="a sleep after each step of attempt 1"
    )
    parser.add_argument("--zero", default="", help="zero.level")
    parser.add_argument("--momentum", type=float, default=0.0, help="SGD's (a slot to shard)")
    parser.add_argument(
        "--pipeline", action="store_true", help="one automatic stage per worker (re-planned)"
    )
    args = parser.parse_args()
    attempt = int(os.environ.get("EPL_RESTART_ATTEMPT", "0"))
    env = epl.init(
        {
            "communication.timeout_seconds": 30,
            "checkpoint.dir": os.path.join(args.output_dir, "ckpt"),
            "checkpoint.save_steps": 2,
            "io.global_batches": True,
            "zero.level": args.zero,
        }
    )
    import keras

    worker = env.cluster.worker_index
    record = os.path.join(args.output_dir, f"ids_{worker}_attempt{attempt}.txt")
    stages = env.cluster.worker_num if args.pipeline else None
    trainer = epl.EPLTrainer(
        train_ft.make_model(record),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.SGD(0.1, momentum=args.momentum),
        config={"auto.auto_parallel": True, "pipeline.num_stages": stages} if stages else None,
    )
    report = {"started": STARTED, "workers": env.cluster.worker_num}

    def write_report():
        if worker == 0:  # replaced whole, so a reader never sees it half written
            path = os.path.join(args.output_dir, f"attempt{attempt}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(report, f)
            os.replace(path + ".tmp", path)

    class Events(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            report["began"] = time.time()
            report["step"] = int(trainer.optimizer.iterations.numpy())
            report["micro_batches"] = trainer.config.pipeline.num_micro_batch
            write_report()

        def on_train_batch_end(self, batch, logs=None):
            step = int(trainer.optimizer.iterations.numpy())
            if "first_step" not in report:
                report["first_step"] = time.time()
                write_report()
            if attempt == 0 and worker == args.kill_worker and step == args.kill_at_step:
                with open(os.path.join(args.output_dir, "killed.json"), "w") as f:
                    json.dump({"time": time.time(), "step": step}, f)
                os.kill(os.getpid(), signal.SIGKILL)
            if attempt == 1:
                time.sleep(args.step_seconds)

    trainer.fit(make_dataset(), epochs=1, callbacks=[Events()], verbose=0)
    if worker == 0:
        np.savez(os.path.join(args.output_dir, "weights.npz"), *trainer.model.get_weights())
    print(f"worker {worker} attempt {attempt} done", flush=True)


if __name__ == "__main__":
    main()
