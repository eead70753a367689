"""Pipeline step time vs micro-batches, GPipe vs 1F1B, against plain Keras on one device.

Usage: python bench/pipeline.py [--stages 2] [--steps 20] [--repeats 3] [--batch 256]

One process; TensorFlow runs ops one thread each (intra-op 1) with `stages + 1` inter-op
threads, so the logical devices of different stages can run at the same time. With S
stages on S cores the ideal pipeline speedup over one device is S x m/(m+S-1) (GPipe's
bubble); the "efficiency" column is the measured speedup divided by S, to compare with
m/(m+S-1). On this 2-core machine only 2 stages can truly overlap.
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from epl_trainer.runtime.cluster import configure_tensorflow

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--stages", type=int, default=2)
ARGS.add_argument("--steps", type=int, default=20)
ARGS.add_argument("--repeats", type=int, default=3)
ARGS.add_argument("--batch", type=int, default=256)
ARGS.add_argument("--width", type=int, default=1024)
ARGS.add_argument("--layers_per_stage", type=int, default=2)
FLAGS = ARGS.parse_args()
configure_tensorflow(FLAGS.stages, intra_op_threads=1, inter_op_threads=FLAGS.stages + 1)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import epl_trainer as epl  # noqa: E402
from epl_trainer.core.plan.schedule import bubble_fraction  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def make_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FLAGS.width,))
    h = inputs
    for s in range(FLAGS.stages):
        for i in range(FLAGS.layers_per_stage):
            h = keras.layers.Dense(FLAGS.width, activation="relu", name=f"s{s}_dense{i}")(h)
    outputs = keras.layers.Dense(10, name=f"s{FLAGS.stages - 1}_head")(h)
    return keras.Model(inputs, outputs)


def make_dataset():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(FLAGS.batch * 4, FLAGS.width)).astype("float32")
    y = rng.integers(0, 10, FLAGS.batch * 4).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(FLAGS.batch).repeat()


def step_seconds(runners: dict) -> dict:
    """Median seconds per step of each runner, timed in interleaved rounds.

    Interleaving spreads machine noise (other processes, CPU steal) over all
    configurations instead of biasing whichever ran during a noisy moment.
    """
    for run in runners.values():
        run(2)  # trace and warm up
    times: dict = {name: [] for name in runners}
    for _ in range(FLAGS.repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            run(FLAGS.steps)
            times[name].append((time.perf_counter() - start) / FLAGS.steps)
    return {name: statistics.median(values) for name, values in times.items()}


def keras_runner():
    model = make_model()
    model.compile(keras.optimizers.SGD(0.01), LOSS)
    dataset = make_dataset()
    return lambda steps: model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)


def pipeline_runner(num_micro_batch, strategy):
    stages = {f"s{s}_.*": s for s in range(FLAGS.stages)}
    trainer = epl.EPLTrainer(
        make_model(),
        LOSS,
        keras.optimizers.SGD(0.01),
        stages=stages,
        config={
            "cluster.virtual_devices": FLAGS.stages,
            "pipeline.strategy": strategy,
            "pipeline.num_micro_batch": num_micro_batch,
        },
    )
    dataset = make_dataset()
    return lambda steps: trainer.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)


def main():
    S = FLAGS.stages
    micro_batches = [m for m in (1, 2, 4, 8) if FLAGS.batch % m == 0]
    runners = {"keras": keras_runner()}
    for m in micro_batches:
        runners[("PreferForward", m)] = pipeline_runner(m, "PreferForward")
        runners[("PreferBackward", m)] = pipeline_runner(m, "PreferBackward")
    seconds = step_seconds(runners)
    single = seconds["keras"]
    print(
        f"\n{S} stages x {FLAGS.layers_per_stage} Dense({FLAGS.width}), global batch "
        f"{FLAGS.batch}, intra-op threads 1, inter-op threads {S + 1}, {os.cpu_count()} "
        f"cores; median of {FLAGS.repeats} interleaved rounds of {FLAGS.steps} steps"
    )
    print(f"plain Keras fit on one device: {single * 1e3:.1f} ms/step\n")
    header = (
        "micro-batches",
        "ideal m/(m+S-1)",
        "GPipe ms",
        "1F1B ms",
        "GPipe eff",
        "1F1B eff",
        "1F1B/GPipe",
    )
    widths = (13, 15, 9, 8, 9, 8, 10)
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for m in micro_batches:
        gpipe, one_f_one_b = seconds[("PreferForward", m)], seconds[("PreferBackward", m)]
        cells = (
            str(m),
            f"{1 - bubble_fraction(S, m):.2f}",
            f"{gpipe * 1e3:.1f}",
            f"{one_f_one_b * 1e3:.1f}",
            f"{single / (S * gpipe):.2f}",
            f"{single / (S * one_f_one_b):.2f}",
            f"{one_f_one_b / gpipe:.2f}x",
        )
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths)))


if __name__ == "__main__":
    main()
