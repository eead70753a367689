"""Worker script: workers whose models start from different random weights.

Each worker seeds Keras with its own seed on purpose (what an unseeded job gets), gives
its frozen BatchNormalization statistics (non-trainable state that the forward reads) its
own random values, and moves its optimizer's step counter, then
trains one short epoch of SGD. Usage:
  train_start_equal.py OUTPUT_DIR [--mode MODE [MODE ...]] [--steps N]
Each mode is one trainer, in turn in the same job. Worker w writes, per mode,
OUTPUT_DIR/<mode>/own_<w>.npz (its weights before the trainer ran),
OUTPUT_DIR/<mode>/start_<w>.npz (its Keras model's weights at the first step, after the
engine was built), OUTPUT_DIR/<mode>/weights_<w>.npz (after fit) and
OUTPUT_DIR/<mode>/result_<w>.json (with what start_state.py logged for that trainer).
  dp:    data parallel, one replica per worker;
  zero1: the same with zero.level="v1";
  span:  a pipeline of 2 stages, stage 0 on worker 0 and stage 1 on worker 1;
  subclassed: data parallel, a subclassed model that its first batch builds (no
         BatchNormalization: its own weights come from a twin built with the same seed).
"""

import argparse
import json
import logging
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))

import numpy as np
from _runs import Messages

import epl_trainer as epl

GLOBAL_BATCH = 16
LEARNING_RATE = 0.1
STAGES = {"dense_a|stats": 0, "dense_b|logits": 1}


def make_data(n=96):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = rng.integers(0, 3, n)
    return x, y


def make_model(seed):
    """Dense -> BatchNormalization -> Dense -> Dense, with random BatchNorm statistics
    drawn from `seed` too. The BatchNormalization is frozen (`trainable=False`: Keras runs
    it in inference mode), so its statistics are state that the forward reads and that
    training leaves alone, as in a fine-tuned model; per-worker batch statistics would
    differ from the global batch's."""
    import keras

    keras.utils.set_random_seed(seed)
    inp = keras.Input((6,))
    h = keras.layers.Dense(16, activation="relu", name="dense_a")(inp)
    stats = keras.layers.BatchNormalization(name="stats")
    stats.trainable = False
    h = stats(h)
    h = keras.layers.Dense(16, activation="tanh", name="dense_b")(h)
    out = keras.layers.Dense(3, name="logits")(h)
    model = keras.Model(inp, out)
    rng = np.random.default_rng(seed)
    stats.moving_mean.assign(rng.normal(size=16).astype("float32"))
    stats.moving_variance.assign(rng.uniform(0.5, 2.0, size=16).astype("float32"))
    return model


def make_subclassed(seed):
    """An unbuilt subclassed model; its first call draws its weights from `seed`."""
    import keras

    class ThreeDense(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense_a = keras.layers.Dense(16, activation="relu")
            self.dense_b = keras.layers.Dense(16, activation="tanh")
            self.logits = keras.layers.Dense(3)

        def call(self, x):
            return self.logits(self.dense_b(self.dense_a(x)))

    keras.utils.set_random_seed(seed)
    return ThreeDense()


def own_model(mode, seed, x):
    """(the model the trainer gets, its weights before the trainer ran)."""
    if mode != "subclassed":
        model = make_model(seed)
        return model, model.get_weights()
    twin = make_subclassed(seed)
    twin(x[:1])
    return make_subclassed(seed), twin.get_weights()


def main():
    parser = argparse.ArgumentParser()
    modes = ["dp", "zero1", "span", "subclassed"]
    parser.add_argument("output_dir")
    parser.add_argument("--mode", nargs="+", default=["dp"], choices=modes)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(format="%(name)s %(levelname)s: %(message)s")
    start_log = logging.getLogger("epl_trainer.training.start_state")
    start_log.setLevel(logging.INFO)  # its checksum
    cluster = epl.init().cluster
    for mode in args.mode:
        messages = Messages()
        start_log.addHandler(messages)
        train(mode, cluster.worker_index, os.path.join(args.output_dir, mode), args.steps, messages)
        start_log.removeHandler(messages)


def train(mode, worker, output_dir, steps, messages):
    import keras

    x, y = make_data()
    # A different initialisation on every worker.
    model, own = own_model(mode, seed=100 + worker, x=x)
    optimizer = keras.optimizers.SGD(LEARNING_RATE)
    optimizer.iterations.assign(7 * worker)  # worker 0's counter (0) must win
    os.makedirs(output_dir, exist_ok=True)
    np.savez(os.path.join(output_dir, f"own_{worker}.npz"), *own)
    trainer = epl.EPLTrainer(
        model,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer,
        stages=STAGES if mode == "span" else None,
        config={"zero.level": "v1"} if mode == "zero1" else None,
    )

    class SaveStart(keras.callbacks.Callback):
        """The Keras model at the first step: the engine is built, nothing trained."""

        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                path = os.path.join(output_dir, f"start_{worker}.npz")
                np.savez(path, *model.get_weights())

    # Workers of one replica (span) read the same batches; otherwise each reads its share.
    per_worker = GLOBAL_BATCH // trainer.data_shards
    history = trainer.fit(
        x,
        y,
        batch_size=per_worker,
        epochs=1,
        steps_per_epoch=steps,
        callbacks=[SaveStart()],
        verbose=0,
        shuffle=False,
    )
    np.savez(os.path.join(output_dir, f"weights_{worker}.npz"), *model.get_weights())
    result = {
        "loss": history.history["loss"][-1],
        "iterations": int(optimizer.iterations.numpy()),
        "data_shards": trainer.data_shards,
        "start_state_log": messages.messages,
    }
    with open(os.path.join(output_dir, f"result_{worker}.json"), "w") as f:
        json.dump(result, f)
    print(f"worker {worker} {mode} done loss={result['loss']:.6f}", flush=True)


if __name__ == "__main__":
    main()
