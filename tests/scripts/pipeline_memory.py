"""Peak host memory of one pipeline training step, in a fresh process.

Usage: pipeline_memory.py STRATEGY [--stages 4] [--micro_batches 8] [--micro_batch_size 16]
Prints one JSON line: {"strategy", "peak_bytes", "stages", "micro_batches"}.
The first step traces and builds everything; the peak is measured over the second one
(`tf.config.experimental.get_memory_info('CPU:0')['peak']` after a reset: on CPU the
logical devices share one allocator, so this is the whole process's tensor memory).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))

from epl_trainer.runtime.cluster import configure_tensorflow


def build_model(stages, seq=32, width=256, hidden=1024):
    import keras

    keras.utils.set_random_seed(0)
    inputs = keras.Input((seq, width))
    h = inputs
    for s in range(stages):
        h = keras.layers.Dense(hidden, activation="gelu", name=f"stage{s}_up")(h)
        h = keras.layers.Dense(width, name=f"stage{s}_down")(h)
    outputs = keras.layers.Dense(4, name="head")(
        keras.layers.GlobalAveragePooling1D(name="pool")(h)
    )
    return keras.Model(inputs, outputs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("strategy", choices=["PreferForward", "PreferBackward"])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro_batches", type=int, default=8)
    parser.add_argument("--micro_batch_size", type=int, default=16)
    args = parser.parse_args()
    configure_tensorflow(args.stages, inter_op_threads=args.stages + 1)
    import keras
    import numpy as np
    import tensorflow as tf

    import epl_trainer as epl
    from epl_trainer.training.memory import allocator_memory, reset_peak_memory

    stages = {
        f"stage{s}_up|stage{s}_down" + ("|pool|head" if s == args.stages - 1 else ""): s
        for s in range(args.stages)
    }
    trainer = epl.EPLTrainer(
        build_model(args.stages),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.SGD(0.01),
        stages=stages,
        config={
            "cluster.virtual_devices": args.stages,
            "pipeline.strategy": args.strategy,
            "pipeline.num_micro_batch": args.micro_batches,
        },
    )
    batch = args.micro_batches * args.micro_batch_size
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2 * batch, 32, 256)).astype("float32")
    y = rng.integers(0, 4, 2 * batch).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    trainer.fit(dataset.take(1), verbose=0)  # trace and build
    reset_peak_memory()
    trainer.fit(dataset.skip(1), verbose=0)
    peak = allocator_memory()["peak"]
    print(
        json.dumps(
            {
                "strategy": args.strategy,
                "peak_bytes": peak,
                "stages": args.stages,
                "micro_batches": args.micro_batches,
            }
        )
    )


if __name__ == "__main__":
    main()
