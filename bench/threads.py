"""Step time of the main job's model by layout, thread pools and XLA, against Keras.

Usage: python bench/threads.py [--rounds 3] [--steps 480] [--only NAME ...]

The model, optimizer and batch of `python -m model_zoo.bert_squad` (tiny BERT, sequence
80, batch 32, BERT's AdamW) on random tokens, 16 steps per call: EPLTrainer as a 2-stage
pipeline with 4 micro-batches or as data parallelism (one lane per device), on 2
simulated CPU devices, against plain Keras `fit` on one device with its whole step in
XLA. Each variant runs in a fresh process (thread pools are fixed when TensorFlow
starts), the variants interleaved, `--rounds` times. A run trains 64 + 128 untimed steps
(tracing, warm-up), then times `--steps` steps. Prints the median ms per step (wall and
process CPU) of each variant, and the median over rounds of its ratio to Keras in the
same round (the machine's speed drifts by up to 1.5x over minutes; a round's runs are
within a minute of each other).

On this project's shared VM `fit` sometimes takes a fixed time (5.1 s for 320 steps in
one process, run after run, while its calls of the step took 3.8-4.1 s; fit's wall then
comes out at exactly 16.0 or 32.0 ms per step, Keras's too): the table also gives the
wall time inside the step's calls, summed by a callback, which that stall leaves out.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from bench._fresh_process import run_child, serve_child

KERAS = "Keras fit, 1 device, XLA step"
KEYS = ("wall_ms", "calls_ms", "cpu_ms")
# name -> (trainer, EPL config overrides, XLA (Keras: the step; EPL: its jit_compile),
# stages)
VARIANTS = {
    "EPL pipeline, 1 thread per op (default), stages as ops": ("epl", {}, False, 2),
    "EPL pipeline, XLA stages": ("epl", {}, True, 2),
    "EPL pipeline, TF's pools (2 threads per op)": (
        "epl", {"cluster.intra_op_threads": 2}, False, 2),
    "EPL pipeline, compiled updates": ("epl", {"optimizer.jit_compile": True}, False, 2),
    "EPL data parallel, plain ops": ("epl", {"pipeline.num_micro_batch": 1}, False, 1),
    "EPL data parallel, XLA per lane (the main job's default without oneDNN)": (
        "epl", {"pipeline.num_micro_batch": 1}, "auto", 1),
    "EPL data parallel, XLA per lane, compiled updates": (
        "epl", {"pipeline.num_micro_batch": 1, "optimizer.jit_compile": True}, True, 1),
    KERAS: ("keras", {}, True, 1),
}  # fmt: skip


def call_times():
    """A Keras callback summing the wall time of the calls of the compiled step (16 steps
    each), without what `fit` does around them."""
    import keras

    class Times(keras.callbacks.Callback):
        seconds = 0.0
        # It reads no weights: without this EPLTrainer writes them back into the Keras
        # model after every call, inside the time measured here (Keras has no such step).
        reads_logs_only = True

        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.seconds += time.perf_counter() - self.start

    return Times()


def main_job_model(batch: int, stages: int = 1):
    """The main job's model (tiny BERT, sequence 80), its losses, BERT's AdamW and an
    endless dataset of `batch` random windows: (model, losses, optimizer, dataset)."""
    import keras
    import numpy as np
    import tensorflow as tf

    from model_zoo.bert_squad.modeling import BertConfig, build_squad_model
    from model_zoo.bert_squad.recipe import bert_optimizer

    seq = 80
    keras.utils.set_random_seed(0)
    model = build_squad_model(BertConfig.preset("tiny", 1000), seq, num_stages=stages)
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
    return model, losses, optimizer, dataset


def child(arguments: dict) -> dict:
    trainer_kind, overrides, jit = arguments["trainer"], arguments["config"], arguments["jit"]
    stages = arguments["stages"]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import epl_trainer as epl

    config = {
        "cluster.virtual_devices": 2 if trainer_kind == "epl" else 1,
        "pipeline.num_micro_batch": 4,
        **overrides,
    }
    epl.init(config)  # configures the devices and thread pools before TF starts
    import tensorflow as tf

    model, losses, optimizer, dataset = main_job_model(batch=32, stages=stages)
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
    calls = call_times()
    start, cpu = time.perf_counter(), time.process_time()
    fit.fit(dataset.prefetch(4), epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[calls])
    return {
        "wall_ms": 1e3 * (time.perf_counter() - start) / steps,
        "calls_ms": 1e3 * calls.seconds / steps,
        "cpu_ms": 1e3 * (time.process_time() - cpu) / steps,
        "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
    }


def main():
    if serve_child(child):
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=480)
    parser.add_argument("--only", nargs="+", help="variant names (Keras always runs)")
    args = parser.parse_args()
    names = [n for n in VARIANTS if not args.only or n in args.only or n == KERAS]
    runs = {name: [] for name in names}
    for r in range(args.rounds):
        # Rotate the order, so no variant always runs first (or right after Keras).
        for name in names[r % len(names) :] + names[: r % len(names)]:
            trainer_kind, overrides, jit, stages = VARIANTS[name]
            arguments = {"trainer": trainer_kind, "config": overrides, "jit": jit,
                         "stages": stages, "steps": args.steps}  # fmt: skip
            row = run_child(__file__, arguments)
            runs[name].append(row)
            print(
                f"round {r}: {name}: {row['wall_ms']:.1f} ms wall ({row['calls_ms']:.1f} in "
                f"the step's calls), {row['cpu_ms']:.1f} CPU"
            )
    print(
        "\n| variant | ms/step: fit's wall | the calls' wall | CPU | speed vs Keras (median "
        "of rounds): fit's wall | calls' wall | CPU | runs (calls' wall) |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    for name, rows in runs.items():
        cells = [statistics.median(row[key] for row in rows) for key in KEYS]
        ratios = [
            statistics.median(k[key] / row[key] for k, row in zip(runs[KERAS], rows))
            for key in KEYS
        ]
        listed = ", ".join(f"{row['calls_ms']:.1f}" for row in rows)
        print(
            f"| {name} | " + " | ".join(f"{c:.1f}" for c in cells) + " | "
            + " | ".join(f"{r:.2f}x" for r in ratios) + f" | {listed} |"
        )  # fmt: skip


if __name__ == "__main__":
    main()
