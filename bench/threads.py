"""Step time of the main job's model against the thread pools and XLA stages.

Usage: python bench/threads.py [--rounds 3] [--steps 480]

The model, optimizer and batch of `python -m model_zoo.bert_squad` (tiny BERT, sequence
80, batch 32, BERT's AdamW) on random tokens, as a 2-stage pipeline with 4 micro-batches
on 2 simulated CPU devices, 16 steps per call, against plain Keras `fit` on one device.
Each variant runs in a fresh process (thread pools are fixed when TensorFlow starts),
the variants interleaved, `--rounds` times. A run trains 64 + 128 untimed steps (tracing,
warm-up), then times `--steps` steps. Prints the median ms per step (wall and process
CPU) of each variant.

On this project's shared VM a run sometimes stretches to a fixed 42.6 ms/step while its
CPU time stays put (the host takes the vCPUs away); the median over rounds hides it.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from bench._fresh_process import run_child

# name -> (trainer, EPL config overrides, XLA-compiled stages / Keras step)
VARIANTS = {
    "EPL, 1 thread per op (default), stages as ops": ("epl", {}, False),
    "EPL, 1 thread per op (default), XLA stages": ("epl", {}, True),
    "EPL, TF's pools (2 threads per op), stages as ops": (
        "epl", {"cluster.intra_op_threads": 2}, False),
    "EPL, TF's pools (2 threads per op), XLA stages": (
        "epl", {"cluster.intra_op_threads": 2}, True),
    "Keras fit, 1 device, XLA step": ("keras", {}, True),
}  # fmt: skip


def child(arguments: dict) -> dict:
    trainer_kind, overrides, jit = arguments["trainer"], arguments["config"], arguments["jit"]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import epl_trainer as epl

    config = {
        "cluster.virtual_devices": 2 if trainer_kind == "epl" else 1,
        "pipeline.num_micro_batch": 4,
        **overrides,
    }
    epl.init(config)  # configures the devices and thread pools before TF starts
    import keras
    import numpy as np
    import tensorflow as tf

    from model_zoo.bert_squad.modeling import BertConfig, build_squad_model
    from model_zoo.bert_squad.recipe import bert_optimizer

    seq, batch = 80, 32
    keras.utils.set_random_seed(0)
    model = build_squad_model(
        BertConfig.preset("tiny", 1000), seq, num_stages=2 if trainer_kind == "epl" else 1
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    losses = {"start_logits": loss, "end_logits": loss}
    optimizer = bert_optimizer(model, 3000, 3e-3)
    rng = np.random.default_rng(0)
    n = batch * 64
    x = {
        "input_ids": rng.integers(0, 1000, (n, seq)).astype("int32"),
        "input_mask": np.ones((n, seq), "int32"),
        "segment_ids": np.zeros((n, seq), "int32"),
    }
    y = {name: rng.integers(0, seq, n).astype("int32") for name in losses}
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch, drop_remainder=True)
    if trainer_kind == "epl":
        fit = epl.EPLTrainer(
            model, loss=losses, optimizer=optimizer, jit_compile=jit, steps_per_execution=16
        )
    else:
        model.compile(optimizer=optimizer, loss=losses, jit_compile=jit, steps_per_execution=16)
        fit = model
    fit.fit(dataset.prefetch(4), epochs=1, steps_per_epoch=64, verbose=0)
    fit.fit(dataset.prefetch(4), epochs=1, steps_per_epoch=128, verbose=0)
    steps = arguments["steps"]
    start, cpu = time.perf_counter(), time.process_time()
    fit.fit(dataset.prefetch(4), epochs=1, steps_per_epoch=steps, verbose=0)
    return {
        "wall_ms": 1e3 * (time.perf_counter() - start) / steps,
        "cpu_ms": 1e3 * (time.process_time() - cpu) / steps,
        "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
    }


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=480)
    args = parser.parse_args()
    runs = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        for name, (trainer_kind, overrides, jit) in VARIANTS.items():
            row = run_child(
                __file__,
                {"trainer": trainer_kind, "config": overrides, "jit": jit, "steps": args.steps},
            )
            runs[name].append(row)
            print(f"round {r}: {name}: {row['wall_ms']:.1f} ms wall, {row['cpu_ms']:.1f} CPU")
    print("\n| variant | ms/step wall (median) | ms/step CPU | runs (wall) |\n|---|---|---|---|")
    for name, rows in runs.items():
        walls = [row["wall_ms"] for row in rows]
        cpus = [row["cpu_ms"] for row in rows]
        listed = ", ".join(f"{w:.1f}" for w in walls)
        print(
            f"| {name} | {statistics.median(walls):.1f} | {statistics.median(cpus):.1f} "
            f"| {listed} |"
        )


if __name__ == "__main__":
    main()
