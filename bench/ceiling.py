"""The most two cores can give the main job's model over Keras: two independent halves.

Usage: python bench/ceiling.py [--rounds 3] [--steps 960]

Two plain Keras processes, each pinned to its own core with one thread (intra- and
inter-op), each train the main job's model (tiny BERT, sequence 80, BERT's AdamW, whole
step in XLA, 16 steps per call; bench/threads.py's random windows) on half the batch
(16), at the same time and with no communication at all. Against them, Keras `fit` on
both cores trains the whole batch (32), as `--trainer=keras` does. A data-parallel step
waits for its slower lane, so the halves' step is the slower process's; "ceiling" is
Keras's ms per step over it: what data parallelism over the two cores would gain with
free gradient exchange and no engine overhead. Each round runs the halves and Keras
one after the other (alternating which goes first); the machine's speed drifts, so only
a round's numbers compare.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
from bench._fresh_process import child_result, serve_child, start_child
from bench.threads import call_times, main_job_model


def child(arguments: dict) -> dict:
    cores = arguments["cores"]
    os.sched_setaffinity(0, set(cores))  # before TensorFlow starts its threads
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # epl_trainer sets oneDNN's default at its import, before TensorFlow loads.
    import epl_trainer  # noqa: F401

    # isort: split
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(len(cores))
    tf.config.threading.set_inter_op_parallelism_threads(len(cores))
    model, losses, optimizer, dataset = main_job_model(batch=arguments["batch"])
    model.compile(optimizer=optimizer, loss=losses, jit_compile=True, steps_per_execution=16)
    model.fit(dataset.prefetch(4), epochs=1, steps_per_epoch=192, verbose=0)  # trace, warm up
    steps = arguments["steps"]
    calls = call_times()
    cpu = time.process_time()
    model.fit(dataset.prefetch(4), epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[calls])
    return {
        "calls_ms": 1e3 * calls.seconds / steps,
        "cpu_ms": 1e3 * (time.process_time() - cpu) / steps,
    }


def start(batch: int, cores: list[int], steps: int):
    return start_child(__file__, {"batch": batch, "cores": cores, "steps": steps})


def main():
    if serve_child(child):
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=960)
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("bench/ceiling.py needs 2 cores.")
    print(
        "| round | Keras, 2 cores, batch 32: ms/step | CPU ms | halves, 1 core each, batch "
        "16: ms/step (slower, faster) | CPU ms (each) | ceiling |\n|---|---|---|---|---|---|"
    )
    ceilings = []
    for r in range(args.rounds):
        rows = {}
        for part in ("halves", "keras") if r % 2 == 0 else ("keras", "halves"):
            if part == "keras":
                rows["keras"] = child_result(start(32, [0, 1], args.steps))
            else:
                halves = [start(16, [core], args.steps) for core in (0, 1)]
                rows["halves"] = sorted(map(child_result, halves), key=lambda h: -h["calls_ms"])
        keras, (slow, fast) = rows["keras"], rows["halves"]
        ceilings.append(keras["calls_ms"] / slow["calls_ms"])
        print(
            f"| {r} | {keras['calls_ms']:.1f} | {keras['cpu_ms']:.1f} | {slow['calls_ms']:.1f}, "
            f"{fast['calls_ms']:.1f} | {slow['cpu_ms']:.1f}, {fast['cpu_ms']:.1f} | "
            f"{ceilings[-1]:.2f}x |",
            flush=True,
        )
    print(f"\nceiling: median {statistics.median(ceilings):.2f}x over {len(ceilings)} rounds")


if __name__ == "__main__":
    main()
