"""Quickstart: train a small Keras classifier data-parallel with `EPLTrainer`.

The data has learnable structure: labels are the argmax of a fixed random linear
"teacher" over 16 dense features plus two categorical tokens, so a model that learns
reaches well above the 25% chance accuracy of the 4 classes. The model is an ordinary
functional Keras model (Dense, LayerNormalization and an Embedding branch); the only
EPL lines are `epl.init(config)` and `epl.EPLTrainer(...)`.

Run from the repo root::

    python -m model_zoo.quickstart [--epochs 5] [--batch_size 64] [--steps_per_epoch 40]
        [--output_dir /tmp/epl_quickstart] [--epl_config configs/dp.json]
        [--epl_set cluster.virtual_devices=4] [--deepspeed_config configs/ds_zero2_offload.json]
    epl-launch --num_workers 2 --gpu_per_worker 1 model_zoo/quickstart/__main__.py

`cluster.virtual_devices` defaults to 2 here (two simulated devices on one CPU) unless
`EPL_CLUSTER_VIRTUAL_DEVICES` (which `epl-launch` sets), `--epl_config` or `--epl_set`
says otherwise. Worker 0 writes TensorBoard logs to `<output_dir>/logs` and the final
numbers to `<output_dir>/metrics.json`.
"""

import json
import os
import sys
import time
from pathlib import Path

if not __package__:
    # Run as a file (epl-launch does this), not with -m: make the checkout importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ info banners

# Before Keras loads TensorFlow: unless the user chose, importing epl_trainer turns on
# oneDNN's CPU kernels (runtime/onednn.py), and TensorFlow reads that once, at import.
import epl_trainer as epl  # isort: split

import keras
import numpy as np
from absl import app, flags

import epl_trainer.runtime.flags as epl_flags  # defines --epl_config and --epl_set

FLAGS = flags.FLAGS
flags.DEFINE_integer("epochs", 5, "Passes over the training data.")
flags.DEFINE_integer(
    "batch_size",
    64,
    "Per-worker batch: split over this worker's model replicas x micro-batches.",
)
flags.DEFINE_integer(
    "steps_per_epoch",
    40,
    "Training steps per epoch; the training set holds exactly this many global batches.",
)
flags.DEFINE_string("output_dir", "/tmp/epl_quickstart", "TensorBoard logs and metrics.json.")
flags.DEFINE_float("learning_rate", 0.01, "Adam learning rate.")
flags.DEFINE_integer("seed", 0, "Seed of the data and of the model's initial weights.")

DEFAULT_VIRTUAL_DEVICES = 2
NUM_FEATURES = 16
NUM_TOKENS = 2  # categorical fields per sample
VOCAB_SIZE = 50
NUM_CLASSES = 4
NUM_VALIDATION = 1024
TEACHER_SEED = 1234  # the same teacher for every split, seed and worker


def make_data(num_samples: int, seed: int):
    """({"features", "tokens"}, labels) labelled by a fixed random linear teacher."""
    teacher = np.random.default_rng(TEACHER_SEED)
    feature_weights = teacher.normal(size=(NUM_FEATURES, NUM_CLASSES))
    token_logits = 2.0 * teacher.normal(size=(VOCAB_SIZE, NUM_CLASSES))
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(num_samples, NUM_FEATURES)).astype("float32")
    tokens = rng.integers(0, VOCAB_SIZE, size=(num_samples, NUM_TOKENS)).astype("int32")
    logits = features @ feature_weights + token_logits[tokens].sum(axis=1)
    labels = logits.argmax(axis=1).astype("int32")
    return {"features": features, "tokens": tokens}, labels


def build_model(seed: int) -> keras.Model:
    """A plain functional Keras classifier; nothing in it is EPL-specific."""
    keras.utils.set_random_seed(seed)
    features = keras.Input((NUM_FEATURES,), name="features")
    tokens = keras.Input((NUM_TOKENS,), dtype="int32", name="tokens")
    dense = keras.layers.Dense(64, activation="relu", name="dense_in")(features)
    dense = keras.layers.LayerNormalization(name="norm_in")(dense)
    embedded = keras.layers.Embedding(VOCAB_SIZE, 8, name="embed")(tokens)
    embedded = keras.layers.Flatten(name="flatten")(embedded)
    hidden = keras.layers.Concatenate(name="concat")([dense, embedded])
    hidden = keras.layers.Dense(64, activation="relu", name="hidden")(hidden)
    hidden = keras.layers.LayerNormalization(name="norm")(hidden)
    logits = keras.layers.Dense(NUM_CLASSES, name="logits")(hidden)
    return keras.Model({"features": features, "tokens": tokens}, logits, name="quickstart")


def environ_with_default_devices() -> dict[str, str]:
    """`os.environ` plus cluster.virtual_devices=2 when it is not set there.

    The environment is the config's lowest-precedence source, so `--epl_config` and
    `--epl_set` still override the default, and so does `epl-launch`'s own variable.
    """
    environ = dict(os.environ)
    environ.setdefault("EPL_CLUSTER_VIRTUAL_DEVICES", str(DEFAULT_VIRTUAL_DEVICES))
    return environ


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    start = time.perf_counter()
    config = epl_flags.config_from_flags(environ=environ_with_default_devices())
    cluster = epl.init(config).cluster  # configures the devices: before any TF work
    print(f"{config}")

    trainer = epl.EPLTrainer(
        build_model(FLAGS.seed),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=keras.optimizers.Adam(FLAGS.learning_rate),
        metrics=["accuracy"],
        config=epl_flags.deepspeed_config_from_flags(),  # None: epl.init's config
    )
    print(trainer.plan.summary())
    global_batch = FLAGS.batch_size * cluster.worker_num
    micro_batch, rest = divmod(global_batch, trainer.plan.global_batch_factor)
    if not rest:
        print(
            f"Global batch {global_batch} = data-parallel degree {trainer.plan.num_replicas}"
            f" x micro-batch {micro_batch} x num_micro_batch {trainer.plan.num_micro_batch}"
            f" ({cluster.worker_num} worker(s) x per-worker batch {FLAGS.batch_size})"
        )

    # Every worker builds the same arrays; fit deals their batches round-robin.
    x_train, y_train = make_data(FLAGS.steps_per_epoch * global_batch, seed=FLAGS.seed + 1)
    x_val, y_val = make_data(NUM_VALIDATION, seed=FLAGS.seed + 2)
    output_dir = Path(FLAGS.output_dir)
    callbacks = []
    if cluster.is_chief:
        callbacks.append(keras.callbacks.TensorBoard(str(output_dir / "logs")))
    history = trainer.fit(
        x_train,
        y_train,
        batch_size=FLAGS.batch_size,
        epochs=FLAGS.epochs,
        validation_data=(x_val, y_val),
        callbacks=callbacks,
        verbose=2,
    )
    final = trainer.evaluate(x_val, y_val, batch_size=FLAGS.batch_size, return_dict=True)
    wall_time = time.perf_counter() - start
    print(
        f"Validation: loss {final['loss']:.4f}, accuracy {final['accuracy']:.4f} "
        f"(chance {1 / NUM_CLASSES:.2f}); wall time {wall_time:.1f} s"
    )
    if cluster.is_chief:
        write_metrics(output_dir, trainer, config, history, final, global_batch, wall_time)


def write_metrics(output_dir, trainer, config, history, final, global_batch, wall_time):
    """Writes `metrics.json`: final and per-epoch numbers, plan and config."""
    metrics = {
        "validation": final,
        "chance_accuracy": 1 / NUM_CLASSES,
        "history": {k: [float(v) for v in values] for k, values in history.history.items()},
        "epochs": len(history.epoch),
        "steps_per_epoch": FLAGS.steps_per_epoch,
        "batch_size_per_worker": FLAGS.batch_size,
        "global_batch": global_batch,
        "num_workers": trainer.cluster.worker_num,
        "devices_per_worker": len(trainer.cluster.local_devices),
        "wall_time_sec": wall_time,
        "plan": trainer.plan.to_dict(),
        "config": config.to_dict(),
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "metrics.json"
    path.write_text(json.dumps(metrics, indent=2) + "\n")
    print(f"Wrote {path} and TensorBoard logs in {output_dir / 'logs'}")


if __name__ == "__main__":
    app.run(main)
