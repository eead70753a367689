"""What saving every step costs: step time without saves, with synchronous and with
asynchronous (`checkpoint.async_save`) saves, one run.

Usage: python bench/checkpoint.py [--steps 40] [--repeats 3] [--batch 64] [--dir /tmp/...]

The model of issue 48: an MLP of 10.5M parameters (512 -> 2048 -> 2048 -> 2048 -> 512)
trained with Adam on 2 logical CPU devices (data parallelism), so a checkpoint holds about
126 MB (weights and two Adam slots, float32). `checkpoint.dir` saves every step
(`save_steps=1`, `keep_max=2`). Each runner gets a fresh folder and a warm-up `fit` that
traces the step and writes the first checkpoints; then `repeats` timed `fit`s of `steps`
steps, interleaved across the runners, and the median ms per step is printed. The
asynchronous row's time includes waiting for the last save at `fit`'s end.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from epl_trainer.runtime.cluster import configure_tensorflow

configure_tensorflow(2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import epl_trainer as epl  # noqa: E402

WIDTHS = (512, 2048, 2048, 2048, 512)


def make_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((WIDTHS[0],))
    h = inputs
    for i, width in enumerate(WIDTHS[1:]):
        h = keras.layers.Dense(width, activation="relu" if i < 3 else None, name=f"d{i}")(h)
    return keras.Model(inputs, h)


def make_dataset(batch, steps):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, WIDTHS[0])).astype("float32")
    y = rng.normal(size=(batch * steps, WIDTHS[-1])).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)


def make_trainer(mode, folder):
    config = {"cluster.virtual_devices": 2}
    if mode != "no saves":
        config.update({"checkpoint.dir": folder, "checkpoint.save_steps": 1})
        config["checkpoint.keep_max"] = 2
    if mode == "async saves":
        config["checkpoint.async_save"] = True
    model = make_model()
    return epl.EPLTrainer(model, "mse", keras.optimizers.Adam(1e-4), config=config)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir)
    data = make_dataset(args.batch, args.steps)
    modes = ("no saves", "sync saves", "async saves")
    trainers, epochs = {}, {}
    for i, mode in enumerate(modes):
        trainers[mode] = make_trainer(mode, os.path.join(root, str(i)))
        trainers[mode].fit(data.take(2), epochs=1, verbose=0)
        epochs[mode] = 1
    params = sum(int(np.prod(v.shape)) for v in trainers["no saves"].model.trainable_variables)
    times = {mode: [] for mode in modes}
    for _ in range(args.repeats):
        for mode in modes:
            trainer = trainers[mode]
            start = time.perf_counter()
            # The checkpoint's epochs are the initial epoch: fit one more each round.
            trainer.fit(data, epochs=epochs[mode] + 1, initial_epoch=epochs[mode], verbose=0)
            times[mode].append((time.perf_counter() - start) * 1e3 / args.steps)
            epochs[mode] += 1
    state_mb = params * 3 * 4 / 1e6
    print(
        f"\nSaving every step: MLP {' -> '.join(map(str, WIDTHS))} ({params / 1e6:.1f}M "
        f"parameters, Adam: {state_mb:.0f} MB of state), batch {args.batch}, 2 logical "
        f"devices, {args.steps} steps x {args.repeats}, median ms per step\n"
    )
    base = statistics.median(times["no saves"])
    print(f"| {'runner':<12} | ms / step | vs no saves |")
    print(f"|{'-' * 14}|-----------|-------------|")
    for mode in modes:
        ms = statistics.median(times[mode])
        print(f"| {mode:<12} | {ms:9.1f} | {ms / base:10.2f}x |")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
