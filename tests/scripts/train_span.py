"""Worker script: a pipeline replica whose stages live in different worker processes.

Run under `epl-launch`, or by hand with TF_CONFIG set (what a cluster manager does).
Usage:
  train_span.py OUTPUT_DIR [--stages 2|4] [--num_micro_batch M] [--optimizer sgd|adam]
                [--schedule PreferBackward|PreferForward|...] [--virtual_stages V]
                [--straddle] [--steps N]
                [--recompute] [--clipnorm C] [--timeout T]
                [--pause_worker W --pause_at_step N [--timeout_after_pause T2]]
                [--save_dir DIR] [--zero v0|v1|v2]
Worker w writes OUTPUT_DIR/weights_<w>.npz (its Keras model's weights after fit) and
OUTPUT_DIR/result_<w>.json (losses, evaluate and predict results).
  --straddle: cluster.device_place_prefer_intra_node=False, so the replicas' stages
              alternate over the workers (2 replicas of 2 stages on 2 workers x 2 devices:
              each replica has a stage on each worker).
  --pause_worker W --pause_at_step N: worker W writes OUTPUT_DIR/paused_<W> (its pid)
              after step N and sleeps (a test kills it).
  --pause_worker W --pause_in epoch_end|predict: the same at the end of the last epoch
              (before fit's last write-back to the Keras model), or before predict.
  --timeout_after_pause T2: from that point on, every worker's trainer runs with
              communication.timeout_seconds=T2 (the first step, whose tracing the
              timeout also bounds, keeps T); the watchdog polls every T2/4 then, so a
              fault after the pause is seen sooner.
  --run NAME=FLAGS (repeat): each run of its own FLAGS (the flags above, space-separated)
              is a trainer with its flags' config (epl.init's for a single run), in turn
              in the same job (one job, not one per run: starting the processes is most
              of a run's time); it writes OUTPUT_DIR/NAME/..., its lines begin with [NAME].
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))

import numpy as np
from _runs import add_run_argument, check_config_took_effect, runs

import epl_trainer as epl

STAGE_MAPS = {
    1: {".*": 0},
    2: {"dense_a|dense_b": 0, "norm|join|logits": 1},
    4: {"dense_a": 0, "dense_b": 1, "norm": 2, "join|logits": 3},
}
GLOBAL_BATCH = 16


def make_data(n=96):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = rng.integers(0, 3, n)
    return x, y


def make_model():
    """dense_a -> dense_b -> norm -> join(norm, dense_a) -> logits: dense_a's output is
    read by a later stage too (a skip connection across the stage boundaries)."""
    import keras

    keras.utils.set_random_seed(0)
    inp = keras.Input((6,))
    h1 = keras.layers.Dense(16, activation="relu", name="dense_a")(inp)
    h2 = keras.layers.Dense(16, activation="tanh", name="dense_b")(h1)
    n = keras.layers.LayerNormalization(name="norm")(h2)
    joined = keras.layers.Concatenate(name="join")([n, h1])
    out = keras.layers.Dense(3, name="logits")(joined)
    return keras.Model(inp, out)


def make_optimizer(name, clipnorm=None):
    import keras

    if name == "adam":
        return keras.optimizers.Adam(0.01, global_clipnorm=clipnorm)
    return keras.optimizers.SGD(0.1, global_clipnorm=clipnorm)


def make_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--num_micro_batch", type=int, default=2)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--schedule", default="PreferBackward")
    parser.add_argument("--virtual_stages", type=int, default=1, help="pipeline.virtual_stages")
    parser.add_argument("--straddle", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--zero", default="", help="zero.level (v0, v1, v2)")
    parser.add_argument("--clipnorm", type=float, default=None)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--save_dir", default=None, help="save a checkpoint there after fit")
    parser.add_argument("--pause_worker", type=int, default=-1)
    parser.add_argument("--pause_at_step", type=int, default=-1)
    parser.add_argument("--pause_in", choices=["step", "epoch_end", "predict"], default="step")
    parser.add_argument("--timeout_after_pause", type=float, default=0.0)
    parser.add_argument("--offload", action="store_true", help="offload.level v0")
    return parser


def run_config(args) -> dict:
    """The config of a run's flags: epl.init's for a single run, else its trainer's."""
    config = {
        "pipeline.num_micro_batch": args.num_micro_batch,
        "pipeline.strategy": args.schedule,
        "pipeline.virtual_stages": args.virtual_stages,
        "cluster.device_place_prefer_intra_node": not args.straddle,
        "communication.timeout_seconds": args.timeout,
    }
    if args.clipnorm is not None:  # clip the reduced gradient, as single-device Keras does
        config["communication.clip_after_allreduce"] = True
    if args.zero:
        config["zero.level"] = args.zero
    if args.recompute:
        config["gradient_checkpoint.type"] = "auto"
    if args.offload:
        config["offload.level"] = "v0"
    return config


def train(args, cluster, output_dir, label="", config=None):
    """Trains, evaluates and predicts one run of `args` (a trainer of its own, with
    `config`); writes its results in output_dir. Returns the trainer."""
    import keras

    worker = cluster.worker_index
    trainer = epl.EPLTrainer(
        make_model(),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        make_optimizer(args.optimizer, args.clipnorm),
        metrics=["accuracy"],
        stages=STAGE_MAPS[args.stages],
        config=config,
    )
    print("".join(f"{label}{line}\n" for line in trainer.plan.summary().splitlines()), flush=True)

    def pause_if(where: str) -> None:
        if args.pause_in != where:
            return
        if args.timeout_after_pause:  # every worker: the watchdog reads it at each phase
            trainer.config = trainer.config.replace(
                {"communication.timeout_seconds": args.timeout_after_pause}
            )
        if worker == args.pause_worker:
            with open(os.path.join(output_dir, f"paused_{worker}"), "w") as f:
                f.write(str(os.getpid()))
            time.sleep(3600)

    class PauseAfterStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch + 1 == args.pause_at_step:
                pause_if("step")

        def on_epoch_end(self, epoch, logs=None):
            pause_if("epoch_end")

    os.makedirs(output_dir, exist_ok=True)
    x, y = make_data()
    history = trainer.fit(
        x,
        y,
        batch_size=GLOBAL_BATCH // trainer.data_shards,
        epochs=1,
        steps_per_epoch=args.steps,
        callbacks=[PauseAfterStep()],
        verbose=0,
        shuffle=False,
    )
    if args.save_dir:  # every worker writes the shard of the stages it holds
        trainer.save_checkpoint(args.save_dir)
    evaluated = trainer.evaluate(
        x[:32], y[:32], batch_size=16 // trainer.data_shards, return_dict=True
    )
    pause_if("predict")
    predicted = trainer.predict(x[:8], batch_size=8)
    np.savez(os.path.join(output_dir, f"weights_{worker}.npz"), *trainer.model.get_weights())
    with open(os.path.join(output_dir, f"result_{worker}.json"), "w") as f:
        json.dump(
            {
                "loss": history.history["loss"][-1],
                "evaluate": evaluated,
                "predict": np.asarray(predicted).tolist(),
                "data_shards": trainer.data_shards,
            },
            f,
        )
    loss = history.history["loss"][-1]
    print(f"{label}worker {worker}/{cluster.worker_num} loss={loss:.6f}", flush=True)
    return trainer


def main():
    parser = make_parser()
    add_run_argument(parser)
    args = parser.parse_args()
    if not args.run:
        train(args, epl.init(run_config(args)).cluster, args.output_dir)
        return
    cluster = epl.init().cluster
    defaults = run_config(parser.parse_args([args.output_dir]))
    for name, own, output_dir in runs(parser, args):
        config = run_config(own)
        trainer = train(own, cluster, output_dir, f"[{name}] ", config)
        check_config_took_effect(name, config, defaults, trainer)


if __name__ == "__main__":
    main()
