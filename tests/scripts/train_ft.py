"""Worker script for the fault-tolerance tests: trains with checkpoints and auto-resume.

Run under `epl-launch`, with TF_CONFIG set by a test, or alone (one worker). Usage:
  train_ft.py OUTPUT_DIR [--epochs E] [--save_steps K] [--keep_max M] [--timeout T]
              [--pause_worker W --pause_at_step N [--timeout_after_pause T2]]
              [--kill_at_step N] [--kill_in_save N] [--zero LEVEL] [--async_save]

Checkpoints go to OUTPUT_DIR/ckpt (`checkpoint.dir`), so a second run of the same
command resumes the first. Worker w writes:
  OUTPUT_DIR/weights_<w>.npz                 final weights
  OUTPUT_DIR/samples_<w>_attempt<a>.txt      the sample ids of every batch, as the compiled
                                             training step consumed them (one line per step)
  OUTPUT_DIR/paused_<w>                      its pid, when it pauses (--pause_at_step)
  OUTPUT_DIR/logs_<w>_attempt<a>.json        the logs of its batches and epochs (fit's)
Fault injection, on the first attempt only (EPL_RESTART_ATTEMPT unset or 0):
  --pause_worker W --pause_at_step N   worker W sleeps after step N (a test kills it)
  --timeout_after_pause T2             after step N, every worker's trainer runs with
                                       communication.timeout_seconds=T2 (the first steps,
                                       whose tracing the timeout also bounds, keep T)
  --kill_at_step N                     every worker SIGKILLs itself after step N
  --kill_in_save N                     worker 0 SIGKILLs itself while saving step N's
                                       checkpoint, between writing and publishing
  --fail_snapshot N                    worker 1's snapshot of step N's checkpoint raises
Storage faults on restarts (--resume_faults), as an eventually consistent object store
shows them to worker 1:
  restart 1                            no checkpoint of the folder is readable to it
  restart 2                            its `latest` still names the previous checkpoint
"""

import argparse
import json
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))

import numpy as np

import epl_trainer as epl

NUM_SAMPLES = 64
GLOBAL_BATCH = 8


def make_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_SAMPLES, 6)).astype("float32")
    y = rng.integers(0, 3, NUM_SAMPLES).astype("int32")
    return x, y


def make_model(record_path=None):
    """An MLP whose first layer, when `record_path` is set, appends its batch's ids there."""
    import keras
    import tensorflow as tf

    class RecordIds(keras.layers.Layer):
        # tf.print runs inside the compiled step, so a line is a batch the step consumed
        # (the input pipeline's read-ahead and skips are not counted).
        def call(self, x, ids):
            if record_path is None:
                return x
            printed = tf.print(ids, summarize=-1, output_stream=f"file://{record_path}")
            with tf.control_dependencies([printed]):
                return tf.identity(x)

    keras.utils.set_random_seed(0)
    x = keras.Input((6,), name="x")
    ids = keras.Input((), dtype="int64", name="id")
    h = RecordIds(name="record")(x, ids)
    h = keras.layers.Dense(16, activation="relu", name="dense_in")(h)
    out = keras.layers.Dense(3, name="logits")(h)
    return keras.Model({"x": x, "id": ids}, out)


def make_dataset(worker_index, worker_num):
    """Global batch t holds samples [8t, 8t+8); worker w takes its contiguous slice."""
    import tensorflow as tf

    x, y = make_data()
    per_worker = GLOBAL_BATCH // worker_num
    first = worker_index * per_worker

    def lookup(ids):
        ids = ids[first : first + per_worker]
        return {"x": tf.gather(x, ids), "id": ids}, tf.gather(y, ids)

    return tf.data.Dataset.range(NUM_SAMPLES).batch(GLOBAL_BATCH, drop_remainder=True).map(lookup)


def _stale_storage(attempt):
    """Worker 1's view of the checkpoint folder on restart `attempt` (--resume_faults)."""
    from epl_trainer.training import checkpoint, checkpoint_manager

    if attempt == 1:

        def unreadable(path):
            raise checkpoint.CheckpointError(f"{path!r}: not visible to this worker yet")

        checkpoint.read_manifest = unreadable
        checkpoint_manager.RESUME_VISIBILITY_SECONDS = 1.0
    if attempt == 2:
        newest = checkpoint.latest

        def previous(directory):
            steps = checkpoint.list_checkpoints(directory)
            path = newest(directory)
            return os.path.join(directory, f"ckpt-{steps[-2]}") if len(steps) > 1 else path

        checkpoint.latest = previous


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save_steps", type=int, default=2)
    parser.add_argument("--keep_max", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--pause_worker", type=int, default=-1)
    parser.add_argument("--pause_at_step", type=int, default=-1)
    parser.add_argument("--timeout_after_pause", type=float, default=0.0)
    parser.add_argument("--kill_at_step", type=int, default=-1)
    parser.add_argument("--kill_in_save", type=int, default=-1)
    parser.add_argument("--zero", default="", help="zero.level (optimizer state sharded)")
    parser.add_argument("--async_save", action="store_true", help="checkpoint.async_save")
    parser.add_argument("--fail_snapshot", type=int, default=-1, help="see the docstring")
    parser.add_argument("--resume_faults", action="store_true", help="see the docstring")
    args = parser.parse_args()
    attempt = int(os.environ.get("EPL_RESTART_ATTEMPT", "0"))
    first_attempt = attempt == 0
    os.makedirs(args.output_dir, exist_ok=True)
    env = epl.init(
        {
            "communication.timeout_seconds": args.timeout,
            "checkpoint.dir": os.path.join(args.output_dir, "ckpt"),
            "checkpoint.save_steps": args.save_steps,
            "checkpoint.keep_max": args.keep_max,
            "zero.level": args.zero,
            "checkpoint.async_save": args.async_save,
            "io.auto_shard": "off",  # make_dataset gives each worker its own rows
        }
    )
    import keras

    from epl_trainer.training import checkpoint

    cluster = env.cluster
    worker = cluster.worker_index
    if args.resume_faults and worker == 1:
        _stale_storage(attempt)
    record = os.path.join(args.output_dir, f"samples_{worker}_attempt{attempt}.txt")
    trainer = epl.EPLTrainer(
        make_model(record),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.Adam(0.01),
        metrics=["sparse_categorical_accuracy"],
    )

    if first_attempt and args.kill_in_save >= 0 and worker == 0:

        def die_before_publishing(tmp_path):
            if os.path.basename(tmp_path).startswith(f".tmp-ckpt-{args.kill_in_save}-"):
                os.kill(os.getpid(), signal.SIGKILL)

        checkpoint.before_publish = die_before_publishing

    if first_attempt and args.fail_snapshot >= 0 and worker == 1:
        from epl_trainer.training.checkpoint_manager import CheckpointManager

        snapshot = CheckpointManager._snapshot

        def failing_snapshot(self, to_host):
            if int(trainer.optimizer.iterations.numpy()) == args.fail_snapshot:
                raise OSError(f"snapshot of step {args.fail_snapshot} failed on worker 1")
            return snapshot(self, to_host)

        CheckpointManager._snapshot = failing_snapshot

    class Faults(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if not first_attempt:
                return
            step = int(trainer.optimizer.iterations.numpy())
            if step == args.kill_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.pause_at_step and args.timeout_after_pause:
                # The watchdog reads the trainer's config at every step (watchdog_for).
                trainer.config = trainer.config.replace(
                    {"communication.timeout_seconds": args.timeout_after_pause}
                )
            if step == args.pause_at_step and worker == args.pause_worker:
                with open(os.path.join(args.output_dir, f"paused_{worker}"), "w") as f:
                    f.write(str(os.getpid()))
                time.sleep(300)

    batch_logs = []
    seen = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda _, logs: batch_logs.append({k: float(v) for k, v in logs.items()})
    )
    history = trainer.fit(
        make_dataset(worker, cluster.worker_num),
        epochs=args.epochs,
        callbacks=[Faults(), seen],
        verbose=0,
    )
    with open(os.path.join(args.output_dir, f"logs_{worker}_attempt{attempt}.json"), "w") as f:
        json.dump({"batches": batch_logs, "epochs": history.history}, f)
    np.savez(os.path.join(args.output_dir, f"weights_{worker}.npz"), *trainer.model.get_weights())
    print(f"worker {worker} attempt {attempt} done", flush=True)


if __name__ == "__main__":
    main()
