"""Optimizer update speed: Keras's ops vs the engine's XLA-compiled update vs the floor.

Usage: python bench/optim.py [--params 25e6] [--repeats 7] [--optimizers adam adamw ...]
       python bench/optim.py --sweep [--repeats 7]

One process, one device. For each optimizer, one update of `--params` float32
parameters (four tensors) is timed as:

* keras: `optimizer.apply` inside a `tf.function`, as Keras runs it without jit_compile;
* ours: `OptimizerStep` with `optimizer.jit_compile` (core/engine/update/apply.py);
* floor: the bytes the update must move (every array it reads and writes once: Adam
  reads parameter, gradient and two slots and writes three arrays) divided by the
  machine's measured copy bandwidth (an XLA-compiled `y = x * a` over the same bytes).

Median of `--repeats` interleaved rounds, after a warm-up that traces and compiles.

`--sweep` is the measurement behind `optimizer.jit_compile: auto` (apply.py): Adam over
updates of several sizes and variable counts, each as plain ops and compiled, with the
first call's time (trace, and XLA's compile for the compiled one) and the steady step.
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import keras
import numpy as np
import tensorflow as tf

from epl_trainer.core.engine.update.apply import AUTO_MIN_ELEMENTS, OptimizerStep, auto_compiles

# (constructor, arrays read + written per update, in units of the parameter size)
OPTIMIZERS = {
    "adam": (lambda: keras.optimizers.Adam(1e-3), 7),  # read p g m v, write p m v
    "adamw": (lambda: keras.optimizers.AdamW(1e-3, weight_decay=0.01), 7),
    "lion": (lambda: keras.optimizers.Lion(1e-4), 5),  # read p g m, write p m
    # Lamb needs the norm of its update before applying it: two passes. Read p g m v and
    # write m v u, then read p u and write p.
    "lamb": (lambda: keras.optimizers.Lamb(1e-3), 10),
    "adagrad": (lambda: keras.optimizers.Adagrad(1e-2), 5),  # read p g a, write p a
    "sgd_momentum": (lambda: keras.optimizers.SGD(1e-2, momentum=0.9), 5),
}


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def keras_apply(optimizer, variables):
    """`optimizer.apply` in a tf.function, as Keras's fit runs it without jit_compile."""

    @tf.function
    def update(grads):
        optimizer.apply(grads, variables)

    return update


def copy_bandwidth(num_elements: int, repeats: int) -> float:
    """Bytes per second of a compiled read + write over float32 arrays."""
    x = tf.Variable(tf.ones([num_elements]))
    y = tf.Variable(tf.zeros([num_elements]))

    @tf.function(jit_compile=True)
    def scale():
        y.assign(x * 1.0001)

    scale()
    seconds = statistics.median(timed(scale) for _ in range(repeats))
    return 2 * 4 * num_elements / seconds


# (parameters, variables) of the sweep: small models' updates to BERT-sized ones.
SWEEP = [(10**5, 8), (10**6, 8), (10**6, 64), (2 * 10**6, 16), (4 * 10**6, 64), (16 * 10**6, 64)]


def first_and_steady(step, grads, repeats: int) -> tuple[float, float]:
    """Seconds of the first call (trace + compile) and the median later one."""
    update = tf.function(step)
    first = timed(update, grads)
    return first, statistics.median(timed(update, grads) for _ in range(repeats))


def sweep(repeats: int) -> None:
    print(f"Adam; 'auto' compiles updates of >= {AUTO_MIN_ELEMENTS:,} parameters")
    print(f"{'params':>11} {'vars':>5} {'first plain s':>13} {'first XLA s':>11} "
          f"{'plain ms':>9} {'XLA ms':>7} {'saved ms':>8} {'steps to repay':>14} "
          f"{'auto':>5}")  # fmt: skip
    for total, count in SWEEP:
        shapes = [(total // count,)] * count
        grads = [tf.ones(s) for s in shapes]
        row = {}
        for jit in (False, True):
            variables = [keras.Variable(np.zeros(s, "float32")) for s in shapes]
            auto = auto_compiles(variables)
            optimizer = keras.optimizers.Adam(1e-3)
            optimizer.build(variables)
            step = OptimizerStep(optimizer, variables, variables[0].value.device, jit)
            row[jit] = first_and_steady(step, grads, repeats)
        saved = row[False][1] - row[True][1]
        extra = row[True][0] - row[False][0]
        repay = f"{extra / saved:14.0f}" if saved > 0 else f"{'never':>14}"
        print(
            f"{total:>11,} {count:>5} {row[False][0]:13.2f} {row[True][0]:11.2f} "
            f"{1e3 * row[False][1]:9.2f} {1e3 * row[True][1]:7.2f} {1e3 * saved:8.2f} "
            f"{repay} {auto!s:>5}"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=25e6)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    parser.add_argument("--sweep", action="store_true", help="the table behind 'auto'")
    args = parser.parse_args()
    if args.sweep:
        sweep(args.repeats)
        return
    total = int(args.params)
    shapes = [(total // 4,)] * 4
    rng = np.random.default_rng(0)
    grads = [tf.constant(rng.normal(size=s).astype("float32") * 1e-3) for s in shapes]
    bandwidth = copy_bandwidth(total, args.repeats)
    print(f"{total / 1e6:.1f}M float32 parameters; copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"{'optimizer':<13} {'keras ms':>9} {'ours ms':>8} {'floor ms':>9} "
          f"{'keras/ours':>10} {'ours/floor':>10} {'compiled':>8}")  # fmt: skip
    for name in args.optimizers:
        make, arrays = OPTIMIZERS[name]
        plain_vars = [keras.Variable(np.zeros(s, "float32")) for s in shapes]
        our_vars = [keras.Variable(np.zeros(s, "float32")) for s in shapes]
        plain, ours = make(), make()
        plain.build(plain_vars)
        ours.build(our_vars)
        device = our_vars[0].value.device
        step = OptimizerStep(ours, our_vars, device, jit_compile=True)

        keras_update = keras_apply(plain, plain_vars)
        our_update = tf.function(step)
        keras_update(grads)
        our_update(grads)
        keras_times, our_times = [], []
        for _ in range(args.repeats):
            keras_times.append(timed(keras_update, grads))
            our_times.append(timed(our_update, grads))
        keras_ms = 1e3 * statistics.median(keras_times)
        ours_ms = 1e3 * statistics.median(our_times)
        floor_ms = 1e3 * arrays * 4 * total / bandwidth
        print(
            f"{name:<13} {keras_ms:9.1f} {ours_ms:8.1f} {floor_ms:9.1f} "
            f"{keras_ms / ours_ms:9.2f}x {ours_ms / floor_ms:9.2f}x {step.jit_compile!s:>8}"
        )


if __name__ == "__main__":
    main()
