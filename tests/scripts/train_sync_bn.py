"""Worker script of tests/test_sync_batch_norm.py: trains the BatchNorm model with
`batch_norm.synchronized=True`, saves its weights and moving statistics.

Run under `epl-launch` (TF_CONFIG set). Usage:
  train_sync_bn.py OUTPUT_DIR [--layout LAYOUT [LAYOUT ...]]
Each layout (data_parallel, pipelines, straddle) is one trainer, in turn in the same job;
worker w writes OUTPUT_DIR/<layout>_<w>.npz (the model's `get_weights()`). On 2 workers x 2
devices:
  data_parallel: 4 replicas of the whole model (each layer's group spans both workers);
  pipelines: two stages; worker w holds replica w (stage k on its device k): each
             stage's group is device k of both workers;
  straddle: two stages, cluster.device_place_prefer_intra_node=False: replica r is
            stage 0 on worker 0's device r and stage 1 on worker 1's device r (each
            replica spans both workers; each stage's group lives on one worker).
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))

import numpy as np

import epl_trainer as epl

BATCH = 8
STEPS = 3
LEARNING_RATE = 0.1
STAGES = {"conv|bn_conv|relu|flatten": 0, "dense|bn_dense|tanh|logits": 1}


def make_data(n=BATCH * STEPS, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6, 6, 2)).astype("float32")
    # The second half of every batch comes from another distribution, so one replica's
    # statistics differ a lot from the global batch's.
    shifted = np.arange(n) % BATCH >= BATCH // 2
    x[shifted] = x[shifted] * 3 + 2
    y = rng.integers(0, 3, n).astype("int32")
    return x, y


def make_model(seed=7, synchronized=False):
    """Conv + BatchNorm (statistics over rows and positions) and Dense + BatchNorm.

    No bias before a BatchNorm (as usual): its gradient is 0 up to rounding, which Adam
    would divide by its own tiny root mean square into steps of +-learning rate."""
    import keras

    keras.utils.set_random_seed(seed)
    bn = dict(momentum=0.8, synchronized=synchronized)
    inputs = keras.Input((6, 6, 2), name="image")
    h = keras.layers.Conv2D(4, 3, use_bias=False, name="conv")(inputs)
    h = keras.layers.BatchNormalization(**bn, name="bn_conv")(h)
    h = keras.layers.Activation("relu", name="relu")(h)
    h = keras.layers.Flatten(name="flatten")(h)
    h = keras.layers.Dense(8, use_bias=False, name="dense")(h)
    h = keras.layers.BatchNormalization(**bn, name="bn_dense")(h)
    h = keras.layers.Activation("tanh", name="tanh")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(h))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--layout",
        nargs="+",
        default=["data_parallel"],
        choices=["data_parallel", "pipelines", "straddle"],
    )
    parser.add_argument("output_dir")
    args = parser.parse_args()
    cluster = epl.init({"batch_norm.synchronized": True}).cluster
    import keras

    os.makedirs(args.output_dir, exist_ok=True)
    x, y = make_data()
    for layout in args.layout:
        # straddle's placement is its trainer's own config (as in train_modes.py).
        config = {"cluster.device_place_prefer_intra_node": False} if layout == "straddle" else {}
        trainer = epl.EPLTrainer(
            make_model(),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            keras.optimizers.SGD(LEARNING_RATE),
            stages=None if layout == "data_parallel" else STAGES,
            config=config,
        )
        batch = BATCH // trainer.data_shards  # workers computing the same replicas share one
        trainer.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
        path = os.path.join(args.output_dir, f"{layout}_{cluster.worker_index}.npz")
        np.savez(path, *trainer.model.get_weights())
        print(f"worker {cluster.worker_index}/{cluster.worker_num} {layout} "
              f"devices={len(cluster.local_devices)}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
