"""Data-parallel step rate: EPLTrainer vs Keras `fit` and vs MirroredStrategy + `fit`.

Usage: python bench/dp.py [--steps 60] [--repeats 3] [--batch 256] [--width 512]
                          [--only compute|optimizer]

One process, 2 logical CPU devices. Each configuration is timed `repeats` times
(interleaved, after a warm-up `fit` that traces the step) and the median is reported.
Logical devices share this machine's cores: the 2-device rows measure overhead of the
data-parallel machinery, not a speedup.

The second table is an optimizer-bound model (4 x Dense(2048), 16.8M parameters, batch
4), where the update dominates the step: one device, Keras `fit` with `jit_compile`
False and True and `steps_per_execution` 1 and 16, against EPLTrainer (XLA-compiled
updates, `optimizer.jit_compile`) with `steps_per_execution` 1 and 16. Its ratios are
medians of per-round ratios, the three runners timed back to back in each round
(`optimizer_bound_table` says why).
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from epl_trainer.runtime.cluster import configure_tensorflow

configure_tensorflow(2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import epl_trainer as epl  # noqa: E402


def make_model(width):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((128,))
    h = inputs
    for i in range(3):
        h = keras.layers.Dense(width, activation="relu", name=f"dense_{i}")(h)
    outputs = keras.layers.Dense(10, name="logits")(h)
    return keras.Model(inputs, outputs)


def make_dataset(batch):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * 8, 128)).astype("float32")
    y = rng.integers(0, 10, batch * 8).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True).repeat()


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def optimizer_bound_runners(optimizer_name, steps_per_execution):
    """(name, run) for the optimizer-bound model: Keras fit and EPLTrainer."""

    def model():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((2048,))
        h = inputs
        for i in range(4):
            h = keras.layers.Dense(2048, name=f"dense_{i}")(h)
        return keras.Model(inputs, h)

    def optimizer():
        if optimizer_name == "adamw":
            return keras.optimizers.AdamW(1e-4, weight_decay=0.01)
        return keras.optimizers.Adam(1e-4)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 2048)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, x)).batch(4).repeat()
    runners = []
    for jit in (False, True):
        keras_model = model()
        keras_model.compile(
            optimizer(), "mse", jit_compile=jit, steps_per_execution=steps_per_execution
        )
        runners.append(
            (
                f"Keras fit jit={jit}",
                lambda steps, m=keras_model: m.fit(
                    dataset, epochs=1, steps_per_epoch=steps, verbose=0
                ),
            )
        )
    trainer = epl.EPLTrainer(
        model(),
        "mse",
        optimizer(),
        config={"cluster.virtual_devices": 1},
        steps_per_execution=steps_per_execution,
    )
    runners.append(
        (
            "EPLTrainer",
            lambda steps: trainer.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0),
        )
    )
    return runners


def optimizer_bound_table(steps, repeats):
    """Each round times Keras fit, Keras fit with jit_compile and EPLTrainer back to back
    (the first of them rotating), and the table gives the median of the per-round ratios.

    Separate medians do not compare on this VM: the CPU's own speed moves by up to 2x
    from one quarter second to the next (a fixed busy loop ran 6,500-12,000 iterations
    per 0.25 s while process CPU time counted the whole 0.25 s), so wall rates and even
    CPU time per step drift with it. Runs timed within seconds of each other see about
    the same machine, and their ratio keeps little of the drift."""
    print(
        f"\nOptimizer-bound: 4 x Dense(2048) (16.8M parameters), batch 4, one device; "
        f"{steps} steps x {repeats} rounds. steps/s: median over rounds; ratios: median of\n"
        "the per-round ratios (wall and process CPU), the three timed back to back each round"
    )
    header = f"{'optimizer':<9} {'spe':>4}  {'Keras fit':>9} {'Keras jit':>9} {'EPLTrainer':>10}"
    cpu = f"{'CPU ms: fit':>11} {'jit':>5} {'ours':>5}  {'vs fit':>6} {'vs jit':>6}"
    print(f"{header}  {'vs fit':>7} {'vs jit':>7}   {cpu}")
    for name in ("adam", "adamw"):
        for spe in (1, 16):
            runners = optimizer_bound_runners(name, spe)
            for _, run in runners:
                run(2 * spe)  # warm-up: trace and compile
            rounds = [paired_round(runners, steps, first=r) for r in range(repeats)]
            fit, jit, ours = (label for label, _ in runners)
            rate = {label: over_rounds(rounds, label, None, 0) for label in (fit, jit, ours)}
            cpu_ms = {label: over_rounds(rounds, label, None, 1) for label in (fit, jit, ours)}
            print(
                f"{name:<9} {spe:>4}  {rate[fit]:9.1f} {rate[jit]:9.1f} {rate[ours]:10.1f}  "
                f"{over_rounds(rounds, ours, fit, 0):6.2f}x "
                f"{over_rounds(rounds, ours, jit, 0):6.2f}x   "
                f"{cpu_ms[fit]:11.1f} {cpu_ms[jit]:5.1f} {cpu_ms[ours]:5.1f}  "
                f"{over_rounds(rounds, fit, ours, 1):5.2f}x "
                f"{over_rounds(rounds, jit, ours, 1):5.2f}x"
            )


def over_rounds(rounds, numerator, denominator, field):
    """Median over rounds of `field` (0: steps/s, 1: CPU ms per step) of runner
    `numerator`, divided in each round by the same field of `denominator` (if given)."""
    return statistics.median(
        r[numerator][field] / (r[denominator][field] if denominator else 1.0) for r in rounds
    )


def paired_round(runners, steps, first):
    """{label: (steps/s, CPU ms per step)} of every runner, timed back to back starting
    with runner `first` (modulo their number), so no runner always goes first."""
    first %= len(runners)
    return {label: timed_steps(run, steps) for label, run in runners[first:] + runners[:first]}


def keras_runner(width, batch, strategy=None):
    scope = strategy.scope() if strategy else _null_scope()
    with scope:
        model = make_model(width)
        model.compile(keras.optimizers.SGD(0.01), LOSS)
    dataset = make_dataset(batch)
    return lambda steps: model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)


def epl_runner(width, batch, devices):
    trainer = epl.EPLTrainer(
        make_model(width),
        LOSS,
        keras.optimizers.SGD(0.01),
        config={"cluster.virtual_devices": devices},
    )
    dataset = make_dataset(batch)
    return lambda steps: trainer.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)


class _null_scope:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def steps_per_second(run, steps):
    return timed_steps(run, steps)[0]


def timed_steps(run, steps):
    """(steps per second of wall time, process CPU milliseconds per step)."""
    start, cpu = time.perf_counter(), time.process_time()
    run(steps)
    return steps / (time.perf_counter() - start), 1e3 * (time.process_time() - cpu) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--only", choices=["compute", "optimizer"])
    args = parser.parse_args()
    if args.only != "compute":
        optimizer_bound_table(args.steps, args.repeats)
    if args.only == "optimizer":
        return
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    mirrored = tf.distribute.MirroredStrategy(devices)
    pairs = [
        (
            "1 device",
            "Keras fit",
            keras_runner(args.width, args.batch),
            "EPLTrainer",
            epl_runner(args.width, args.batch, 1),
        ),
        (
            "2 logical devices",
            "MirroredStrategy + fit",
            keras_runner(args.width, args.batch, mirrored),
            "EPLTrainer",
            epl_runner(args.width, args.batch, 2),
        ),
    ]
    for _, _, baseline, _, ours in pairs:  # warm-up: trace and build everything
        baseline(3)
        ours(3)
    rows = []
    for setting, baseline_name, baseline, ours_name, ours in pairs:
        base_rates, our_rates = [], []
        for _ in range(args.repeats):
            base_rates.append(steps_per_second(baseline, args.steps))
            our_rates.append(steps_per_second(ours, args.steps))
        base, mine = statistics.median(base_rates), statistics.median(our_rates)
        rows.append((setting, baseline_name, base, ours_name, mine, mine / base))
    print(
        f"\nDense {args.width}x3, batch {args.batch}, {args.steps} steps x {args.repeats} "
        f"repeats (median); {os.cpu_count()} CPU cores"
    )
    header = ("setting", "baseline", "steps/s", "ours", "steps/s", "ours/baseline")
    widths = (18, 24, 9, 11, 9, 13)
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for setting, bname, base, oname, mine, ratio in rows:
        cells = (setting, bname, f"{base:.1f}", oname, f"{mine:.1f}", f"{ratio:.2f}x")
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths)))


if __name__ == "__main__":
    main()
