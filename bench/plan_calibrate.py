"""Microbenchmarks behind epl-plan's "cpu" device (core/plan/devices.py): this machine's rates.

Usage: nice -n 10 python bench/plan_calibrate.py

Each quantity is measured in a fresh process with the thread pools the trainer gives one
logical device per core count (`runtime/cluster.py`), takes the best of a few repeats
(the machine is shared: the best is the least disturbed), and is printed as one JSON line
that `core/plan/devices.py` stores, with the date, in its "cpu" entry:

* matmul_flops: float32 [512, 512] x [512, 2048] matmuls (the zoo's small models' sizes)
  on all cores, FLOP/s.
* memory_bandwidth: an elementwise add over 2**22 float32 (3 x 16 MB moved), bytes/s.
* pool_overhead: EPLTrainer steps (plain ops, `jit_compile=False`) of Dense(8) stacks of
  4 and 36 layers, batch 8 per device (next to no FLOPs), data-parallel on 1, 2 and 4
  logical devices: per device count, the slope per layer (every device's forward,
  backward and Adam update of the layer's two variables, and its reduction) and the
  intercept (the step's own cost). The 1-device values are layer_overhead_s and
  step_overhead_s.
* collective_bandwidth / collective_latency_s: all-reduces (`CollectiveGroup.all_reduce`)
  of 16 kB and 16 MB between 2 logical devices: the slope (bytes each member sends, a ring
  sends 2(N-1)/N of the buffer) and the intercept. collective_speed: the same for
  reduce-scatters and all-gathers ((N-1)/N of the buffer), relative to the all-reduce
  (TensorFlow's CPU collectives move the kinds at different rates).

Nothing here depends on a configuration of bench/plan_accuracy.py: the constants are the
machine's, the same for every row.
"""

import argparse
import json
import os
import sys
import time

from _fresh_process import run_child, serve_child

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
REPEATS = 5


def _best(run, repeats=REPEATS):
    run()  # warm-up: thread pools, kernels, tracing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure(what):
    sys.path.insert(0, ROOT)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from epl_trainer.runtime.cluster import configure_tensorflow

    what, devices = (what, 1) if isinstance(what, str) else what
    configure_tensorflow(2 if what == "collective" else devices)
    import tensorflow as tf

    if what == "matmul":
        a = tf.random.normal((512, 512))
        b = tf.random.normal((512, 2048))
        fn = tf.function(lambda: tf.reduce_sum(a @ b @ tf.transpose(b) @ b))
        seconds = _best(lambda: fn().numpy())
        return {"matmul_flops": 3 * 2 * 512 * 512 * 2048 / seconds}
    if what == "memory":
        x = tf.random.normal((2**22,))
        y = tf.random.normal((2**22,))
        fn = tf.function(lambda: x + y)
        seconds = _best(lambda: fn().numpy())
        return {"memory_bandwidth": 3 * 4 * 2**22 / seconds}
    if what == "collective":
        from epl_trainer.core.comm.group import CollectiveGroup

        devices = tuple(d.name for d in tf.config.list_logical_devices("CPU")[:2])
        group = CollectiveGroup(devices, devices)

        def values(elements):
            made = []
            for device in devices:
                with tf.device(device):
                    made.append(tf.random.normal((elements,)))
            return made

        calls = {  # kind -> (call, bytes each member sends per buffer byte, buffer of n)
            "all_reduce": (lambda v: group.all_reduce(v, "sum"), 1.0, lambda n: n),
            "reduce_scatter": (lambda v: group.reduce_scatter(v, "sum"), 0.5, lambda n: n),
            "all_gather": (group.all_gather, 0.5, lambda n: n // 2),
        }
        rates = {}
        for kind, (call, sent, inputs) in calls.items():
            times = {}
            for elements in (2**12, 2**22):
                buffers = values(inputs(elements))
                fn = tf.function(lambda v=buffers, call=call: call(v))
                times[elements] = _best(lambda fn=fn: [t.numpy() for t in fn()], 10)
            slope = (times[2**22] - times[2**12]) / (sent * 4 * (2**22 - 2**12))
            rates[kind] = (1 / slope, max(0.0, times[2**12] - sent * 4 * 2**12 * slope))
        bandwidth, latency = rates["all_reduce"]
        return {
            "collective_bandwidth": bandwidth,
            "collective_latency_s": latency,
            # Bytes sent per second by each kind, relative to the all-reduce's.
            "collective_speed": {kind: rate / bandwidth for kind, (rate, _) in rates.items()},
        }
    # "overhead": EPLTrainer steps of tiny Dense stacks
    import keras
    import numpy as np

    import epl_trainer as epl

    def step_seconds(layers):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        h = inputs
        for i in range(layers):
            h = keras.layers.Dense(8, name=f"d{i}")(h)
        trainer = epl.EPLTrainer(
            keras.Model(inputs, h),
            keras.losses.MeanSquaredError(),
            keras.optimizers.Adam(1e-3),
            config={"cluster.virtual_devices": devices},
            jit_compile=False,
        )
        x = np.ones((8 * devices, 8), "float32")
        dataset = tf.data.Dataset.from_tensors((x, x)).repeat()
        trainer.fit(dataset, steps_per_epoch=2, verbose=0)
        return _best(lambda: trainer.fit(dataset, steps_per_epoch=20, verbose=0)) / 20

    few, many = step_seconds(4), step_seconds(36)
    per_layer = (many - few) / 32
    return {"pool_overhead": [[devices, per_layer, max(0.0, few - 4 * per_layer)]]}


def main():
    if serve_child(measure):
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="matmul,memory,collective,overhead")
    chosen = parser.parse_args().only.split(",")
    result = {}
    for what in ("matmul", "memory", "collective"):
        if what in chosen:
            result.update(run_child(__file__, what))
    if "overhead" in chosen:
        result["pool_overhead"] = [
            run_child(__file__, ["overhead", devices])["pool_overhead"][0] for devices in (1, 2, 4)
        ]
    result["measured"] = time.strftime("%Y-%m-%d")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
