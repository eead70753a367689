"""Worker script for multi-worker tests: trains a small model, saves its weights.

Run under `epl-launch` (TF_CONFIG set) or alone (one worker). Usage:
  train_dp.py OUTPUT_DIR [--steps N] [--fail_worker K] [--global_batch B] [...]
  train_dp.py OUTPUT_DIR --run NAME=FLAGS [--run NAME=FLAGS ...]
Worker w writes OUTPUT_DIR/weights_<w>.npz. With --fail_worker K, worker K raises
after its first step. Each --run is one trainer of its own FLAGS (the flags above,
space-separated), trained in turn in the same job (one job, not one per run: starting
the processes is most of a run's time): its flags' config (zero.level, ...; epl.init's
for a single run) is that trainer's config; worker w writes OUTPUT_DIR/NAME/weights_<w>.npz
and OUTPUT_DIR/NAME/messages_<w>.txt (what epl_trainer logged during the run), and its
lines begin with [NAME].
"""

import argparse
import logging
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
sys.path.insert(1, os.path.join(os.path.dirname(__file__), os.pardir))  # tests/: _models

import numpy as np
from _runs import Messages, add_run_argument, check_config_took_effect, runs

import epl_trainer as epl

STAGES = {"dense_in": 0, "norm|logits": 1}
TIED_STAGES = {"embed|block": 0, "norm|logits": 1}
SHORT_LAST_SAMPLES, SHORT_LAST_BATCH = 1001, 167  # --short_last: 501 and 500 per worker


def make_data(n=96):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = rng.integers(0, 3, n)
    return x, y


def make_model(classes=3):
    import keras

    keras.utils.set_random_seed(0)
    inp = keras.Input((6,))
    h = keras.layers.Dense(16, activation="relu", name="dense_in")(inp)
    h = keras.layers.LayerNormalization(name="norm")(h)
    out = keras.layers.Dense(classes, name="logits")(h)
    return keras.Model(inp, out)


def make_tied_data(n=96):
    rng = np.random.default_rng(0)
    return rng.integers(0, 13, size=(n, 5)), rng.integers(0, 13, size=(n, 5))


def make_tied_model():
    """Tokens -> embedding -> Dense -> logits from the same embedding matrix (tied)."""
    import keras
    from _models import TiedLogits  # tests/ (imported here: after epl.init configures TF)

    keras.utils.set_random_seed(0)
    tokens = keras.Input((5,), dtype="int32")
    embed = keras.layers.Embedding(13, 8, name="embed")
    h = keras.layers.Dense(8, activation="tanh", name="block")(embed(tokens))
    h = keras.layers.LayerNormalization(name="norm")(h)
    return keras.Model(tokens, TiedLogits(embed, name="logits")(h))


def make_embedding_model():
    """Tokens -> embedding -> Dense -> per-token logits (13 classes), nothing tied."""
    import keras

    keras.utils.set_random_seed(0)
    tokens = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(14, 8, name="embed")(tokens)  # 14 rows: 7 per device
    h = keras.layers.Dense(8, activation="tanh", name="block")(h)
    return keras.Model(tokens, keras.layers.Dense(13, name="logits")(h))


def with_own_step(model):
    """`model` as a model with its own train_step (Keras's guide's, gradients halved: the
    default step would give another result)."""
    import keras
    import tensorflow as tf

    class HalvedGradients(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            halved = [tf.math.scalar_mul(0.5, g) for g in grads]  # rows stay rows
            self.optimizer.apply_gradients(zip(halved, self.trainable_variables))
            self.compiled_loss_tracker.update_state(loss)
            return {"loss": self.compiled_loss_tracker.result()}

    own = HalvedGradients(model.inputs, model.outputs)
    own.compiled_loss_tracker = keras.metrics.Mean(name="loss")
    return own


def gathered_layouts():
    """The job's (workers, 2) mesh (Keras's `list_devices()` lists every worker's
    devices); every kernel and the embedding table laid out over 'model' without making
    a Megatron pair (block's bias is whole): all gathered on use, the batch axis over the
    workers."""
    import keras

    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((len(devices) // 2, 2), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["embed/embeddings"] = ("model", None)
    layout_map["block/kernel"] = (None, "model")
    layout_map["logits/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(layout_map=layout_map)


def batch_axis_layouts():
    """The job's (workers, 2) mesh (Keras's `list_devices()` lists every worker's
    devices), with the table and a kernel laid out over both axes: blocks over the batch
    axis sit on different workers, gathered on use across them."""
    import keras

    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((len(devices) // 2, 2), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["embed/embeddings"] = ("model", "batch")  # (14, 8): 7 x 4 per device
    layout_map["block/kernel"] = ("batch", "model")  # (8, 8): 4 x 4 per device
    layout_map["logits/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(layout_map=layout_map)


def make_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--global_batch", type=int, default=16)
    parser.add_argument("--fail_worker", type=int, default=-1)
    parser.add_argument("--two_stages", action="store_true", help="dense_in | norm+logits")
    parser.add_argument("--num_micro_batch", type=int, default=1)
    parser.add_argument(
        "--tied", action="store_true", help="embed+block | norm+logits, the embedding tied"
    )
    parser.add_argument("--split", action="store_true", help="split(n) logits, 4 classes")
    parser.add_argument(
        "--evaluate_first", action="store_true", help="evaluate before fit; worker 1 gets no data"
    )
    parser.add_argument(
        "--uneven", action="store_true", help="one pass; worker 1 has 2 batches, worker 0 has 4"
    )
    parser.add_argument(
        "--short_last",
        action="store_true",
        help="1001 samples sharded, then batched by 167: worker 0 has 3 full batches, "
        "worker 1's last one is a row short (500 samples)",
    )
    parser.add_argument("--steps_per_execution", type=int, default=1)
    parser.add_argument("--zero", default="", help="zero.level")
    parser.add_argument(
        "--keras_data_parallel",
        action="store_true",
        help="strategy=keras.distribution.DataParallel over this worker's devices",
    )
    parser.add_argument(
        "--keras_gathered",
        action="store_true",
        help="an embedding model, its variables laid out over each worker's (1, 2) mesh",
    )
    parser.add_argument(
        "--keras_batch_blocks",
        action="store_true",
        help="an embedding model laid out over the job's (workers, 2) mesh's both axes",
    )
    parser.add_argument("--adam", action="store_true", help="Adam(0.01) instead of SGD(0.1)")
    parser.add_argument("--own_step", action="store_true", help="the model's own train_step")
    parser.add_argument("--checkpoint_dir", default="", help="save_checkpoint there at the end")
    parser.add_argument(
        "--global_batches", action="store_true", help="io.global_batches (batch sizes global)"
    )
    parser.add_argument(
        "--evaluate_rows",
        type=int,
        default=0,
        help="after fit, evaluate the first N samples (the fit's batch size) and print the loss",
    )
    return parser


def run_config(args) -> dict:
    """The config of a run's flags: epl.init's for a single run, else its trainer's."""
    return {
        "zero.level": args.zero,
        "pipeline.num_micro_batch": args.num_micro_batch,
        "cluster.colocate_split_and_replicate": args.split,
        "io.auto_shard": "off",  # --uneven / --short_last build each worker's own batches
        "io.global_batches": args.global_batches,
        # A step that hangs fails within a minute (the test's bound), not 600 s.
        **({"communication.timeout_seconds": 60} if args.short_last else {}),
    }


def train(args, cluster, output_dir, label="", config=None):
    """Trains one run of `args` (a trainer of its own, with `config`) and saves its
    weights in output_dir."""
    import keras

    if args.keras_gathered or args.keras_batch_blocks:
        model = make_embedding_model()
    elif args.tied:
        model = make_tied_model()
    else:
        model = make_model(classes=4 if args.split else 3)
    if args.own_step:
        model = with_own_step(model)
    trainer = epl.EPLTrainer(
        model,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.Adam(0.01) if args.adam else keras.optimizers.SGD(0.1),
        stages=TIED_STAGES if args.tied else STAGES if args.two_stages else None,
        steps_per_execution=args.steps_per_execution,
        config=config,
        # One replica per worker: features replicate(n) and logits split(n) on its devices.
        strategy=(
            epl.Strategy(default=epl.replicate(len(cluster.local_devices)), split=["logits"])
            if args.split
            else keras.distribution.DataParallel(devices=keras.distribution.list_devices())
            if args.keras_data_parallel
            else gathered_layouts()
            if args.keras_gathered
            else batch_axis_layouts()
            if args.keras_batch_blocks
            else None
        ),
    )
    tokens = args.tied or args.keras_gathered or args.keras_batch_blocks
    x, y = make_tied_data() if tokens else make_data()
    per_worker = args.global_batch // cluster.worker_num
    if args.global_batches:
        per_worker = args.global_batch  # every worker takes its rows of each global batch
    if args.evaluate_first:
        import tensorflow as tf

        data = tf.data.Dataset.from_tensor_slices((x[:8], y[:8])).batch(8)
        logs = trainer.evaluate(
            data.take(0) if cluster.worker_index == 1 else data, return_dict=True
        )
        print(f"{label}worker {cluster.worker_index} evaluate loss={logs['loss']:.6f}", flush=True)

    class FailAfterFirstStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if cluster.worker_index == args.fail_worker:
                raise RuntimeError(f"worker {cluster.worker_index} fails on purpose")

    if args.uneven:
        import tensorflow as tf

        # Worker w's batch i holds rows of the single-process global batch i.
        rows = [x[(2 * i + cluster.worker_index) * 8 :][:8] for i in range(4)]
        labels = [y[(2 * i + cluster.worker_index) * 8 :][:8] for i in range(4)]
        batches = 2 if cluster.worker_index == 1 else 4
        data = tf.data.Dataset.from_tensor_slices(
            (np.stack(rows[:batches]), np.stack(labels[:batches]))
        )
        history = trainer.fit(data, epochs=1, verbose=0)
        print(f"{label}worker {cluster.worker_index} steps={int(trainer.optimizer.iterations)}")
    elif args.short_last:
        import tensorflow as tf

        x, y = make_data(SHORT_LAST_SAMPLES)
        data = tf.data.Dataset.from_tensor_slices((x, y)).shard(2, cluster.worker_index)
        history = trainer.fit(data.batch(SHORT_LAST_BATCH), epochs=1, verbose=0)
        print(f"{label}worker {cluster.worker_index} steps={int(trainer.optimizer.iterations)}")
    else:
        history = trainer.fit(
            x,
            y,
            batch_size=per_worker,
            epochs=1,
            steps_per_epoch=args.steps,
            callbacks=[FailAfterFirstStep()],
            verbose=0,
            shuffle=False,
        )
    if args.evaluate_rows:
        logs = trainer.evaluate(
            x[: args.evaluate_rows], y[: args.evaluate_rows], batch_size=per_worker, verbose=0
        )
        print(f"{label}worker {cluster.worker_index} evaluate_rows loss={logs:.8f}", flush=True)
    if args.checkpoint_dir:
        trainer.save_checkpoint(args.checkpoint_dir)
    os.makedirs(output_dir, exist_ok=True)
    np.savez(
        os.path.join(output_dir, f"weights_{cluster.worker_index}.npz"),
        *trainer.model.get_weights(),
    )
    print(
        f"{label}worker {cluster.worker_index}/{cluster.worker_num} "
        f"devices={len(cluster.local_devices)} "
        f"replicas={trainer.plan.num_replicas} "
        f"loss={history.history['loss'][-1]:.6f}",
        flush=True,
    )
    return trainer


def main():
    parser = make_parser()
    add_run_argument(parser)
    args = parser.parse_args()
    if not args.run:
        train(args, epl.init(run_config(args)).cluster, args.output_dir)
        return
    cluster = epl.init({"io.auto_shard": "off"}).cluster
    log = logging.getLogger("epl_trainer")
    defaults = run_config(parser.parse_args([args.output_dir]))
    for name, own, output_dir in runs(parser, args):
        messages = Messages()
        log.addHandler(messages)
        config = run_config(own)
        try:
            trainer = train(own, cluster, output_dir, f"[{name}] ", config=config)
        finally:
            log.removeHandler(messages)
        check_config_took_effect(name, config, defaults, trainer)
        path = os.path.join(output_dir, f"messages_{cluster.worker_index}.txt")
        with open(path, "w") as f:
            f.write("".join(f"{message}\n" for message in messages.messages))


if __name__ == "__main__":
    main()
