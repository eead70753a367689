"""Microbenchmarks behind epl-plan's "cpu" device (core/plan/devices.py): this machine's rates.

Usage: python bench/plan_calibrate.py [--only matmul,attention] [--runs 3] [--write]

Each quantity is measured in a fresh process with the thread pools the trainer gives one
logical device per core count (`runtime/cluster.py`), takes the best of a few repeats
(the machine is shared: the best is the least disturbed) of one and of 4 copies of its
body run one after the other, and keeps the slope (`_side_by_side`: not the function
call's own cost, which a step pays once); the whole is run `--runs`
times (3) and each number's median kept. The result is printed as one JSON line;
`--write` stores it, with the date and this CPU, in the file behind the "cpu" device
(`core/plan/cpu_calibration.json`; a part alone only on the CPU the rest was measured on):

* matmul_flops: float32 forward products of the zoo's models' Dense layers
  (`_DENSE_SHAPES`, each with an input and a weight of its own) on one device (all cores
  in each op), FLOP/s; pool_matmul_flops: the same on 1, 2 and 4 logical devices side by
  side, each with the trainer's one thread per op, all of them together (two
  single-threaded matmuls outrun one matmul over two threads).
* memory_bandwidth: an elementwise add over 2**22 float32 (3 x 16 MB moved), bytes/s;
  pool_memory_bandwidth: the same on 1, 2 and 4 devices side by side.
* batched_matmul_efficiency: attention's per-head products as Keras's MultiHeadAttention
  runs them (its two einsums with their gradients, at the zoo's transformer's sizes: 32
  samples, 64 positions, 4 heads of 32), FLOP/s over the matmuls' on the same devices
  measured just before (`attention_share`); the median over 1, 2 and 4 devices.
* pool_layer_norm_bandwidth: a LayerNormalization's forward and backward on a [32, 64,
  128] activation (its bytes counted from its traced ops, as `core/graph/traffic.py`
  counts a model's), bytes/s on 1, 2 and 4 devices side by side (`layer_norm_share`): a
  layer's ops read what the op before wrote, from the caches; devices.py divides them by
  the adds' (pool_memory_bandwidth).
* thread_matmul_flops, thread_memory_bandwidth: the same on one device with one thread
  per op: what one of several devices runs at while the others idle (a pipeline's
  warm-up). thread_pair_matmul_flops: a backward's input and weight gradients of the
  zoo's models' Dense layers (`_DENSE_SHAPES`), which depend on nothing but the upstream
  gradient, on one device with one thread per op, the others idle: the runtime's
  inter-op threads run the two side by side, on both cores.
* pool_overhead: EPLTrainer steps (plain ops, `jit_compile=False`; each step timed by a
  callback, not the fit call's copies of the weights) of Dense(8) stacks of 4 and 36
  layers, batch 8 per device (next to no FLOPs), data-parallel on 1, 2 and 4 logical
  devices: per device count, the slope per layer (every device's forward,
  backward and Adam update of the layer's two variables, and its reduction) and the
  intercept (the step's own cost). The 1-device values are layer_overhead_s and
  step_overhead_s.
* collective_bandwidth / collective_latency_s: all-reduces (`CollectiveGroup.all_reduce`)
  of 16 kB and 16 MB between 2 logical devices: the slope (bytes each member sends, a ring
  sends 2(N-1)/N of the buffer) and the intercept. collective_speed: the same for
  reduce-scatters and all-gathers ((N-1)/N of the buffer), relative to the all-reduce
  (TensorFlow's CPU collectives move the kinds at different rates).

Nothing here depends on a configuration of bench/plan_accuracy.py: the constants are the
machine's, the same for every row (measured at the zoo's small models' sizes).
"""

import argparse
import json
import os
import statistics
import sys
import time

from _fresh_process import run_child, serve_child

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
REPEATS = 5
POOL_DEVICES = (1, 2, 4)  # logical devices measured side by side
COPIES = 4  # a body run this many times over against once: _side_by_side's slope
PARTS = ("matmul", "memory", "gradient_pairs", "attention", "layer_norm", "collective", "overhead")


def _best(run, repeats=REPEATS):
    """The fastest of `repeats` calls of `run` (a `tf.function`: eager calls return once
    it has run, so nothing is read back). Reading the results back (`.numpy()`) copied
    every output inside the timed call: the adds measured 13 GB/s with it against 41
    without, a 16 MB all-reduce 14 ms against 8, and a step reads none of its tensors."""
    run()  # warm-up: thread pools, kernels, tracing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def _devices(tf, count):
    return [d.name for d in tf.config.list_logical_devices("CPU")[:count]]


def _on(tf, device, make):
    with tf.device(device):
        return make()


def measure(what):
    sys.path.insert(0, ROOT)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from plan_accuracy import configure_trainer_threads, fit_step_seconds

    what, devices, *threads = (what, 1) if isinstance(what, str) else what
    if threads:  # a device with this many threads per op, as it runs beside others
        from epl_trainer.runtime.cluster import configure_tensorflow

        configure_tensorflow(devices, intra_op_threads=threads[0])
    else:
        configure_trainer_threads(2 if what == "collective" else devices)
    import tensorflow as tf

    if what == "matmul":  # on each of `devices` side by side, each with its own operands
        return {"matmul_flops": _dense_forward_rate(tf, _devices(tf, devices))}
    if what == "gradient_pairs":  # each device's input and weight gradients side by side
        places = _devices(tf, devices)
        seconds = _side_by_side(tf, places, _dense_operands(tf), _gradient_pairs)
        return {"matmul_flops": devices * _PAIR_FLOPS / seconds}
    if what == "attention":  # the same devices: the big matmuls, then attention's
        places = _devices(tf, devices)
        return attention_share(tf, places)
    if what == "layer_norm":
        places = _devices(tf, devices)
        return layer_norm_share(tf, places)
    if what == "memory":
        return {"memory_bandwidth": _adds_bandwidth(tf, _devices(tf, devices))}
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
                times[elements] = _best(fn, 10)
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
        # A step as a long job runs it: not what each fit call does once (copying the
        # weights in and out, plan_accuracy.fit_step_seconds).
        return min(fit_step_seconds(trainer, dataset, 20) for _ in range(REPEATS))

    few, many = step_seconds(4), step_seconds(36)
    per_layer = (many - few) / 32
    return {"pool_overhead": [[devices, per_layer, max(0.0, few - 4 * per_layer)]]}


def _adds_bandwidth(tf, places):
    """Bytes per second of elementwise adds over 2**22 float32 (3 x 16 MB moved) on every
    device of `places` at once, all of them together."""
    seconds = _side_by_side(
        tf, places,
        lambda: (tf.random.normal((2**22,)), tf.random.normal((2**22,))),
        lambda x, y: x + y,
    )  # fmt: skip
    return len(places) * 3 * 4 * 2**22 / seconds


def _side_by_side(tf, places, make, body):
    """Seconds of `body(*operands)` on every device of `places` at once, each device with
    operands of its own from `make()`: the slope between a `tf.function` that runs one
    copy on each device and one that runs COPIES, each copy with its own operands after
    the copy before. The slope leaves out the function call's own cost, which a step
    pays once (`step_overhead_s`), not per layer: 50-100 us here, 3-10% of a body of
    1-3 ms (the Dense layers' products measured 318 GFLOP/s timed whole, where each of
    them alone ran at 380-441)."""
    operands = [[_on(tf, d, make) for _ in range(COPIES)] for d in places]

    def run(copies):
        outputs = []  # every copy's: the runtime prunes ops that are only control inputs
        for d, own in zip(places, operands):
            with tf.device(d):
                previous = []
                for args in own[:copies]:
                    with tf.control_dependencies(previous):
                        previous = tf.nest.flatten(body(*args))
                    outputs.append(previous)
        return outputs

    one = _best(tf.function(lambda: run(1)))
    many = _best(tf.function(lambda: run(COPIES)))
    return (many - one) / (COPIES - 1)


# A backward's two products of a Dense layer of the zoo's models (tests/scripts/
# estimate_peak.py): the input gradient dy @ W^T and the weight gradient x^T @ dy, which
# depend on nothing but dy, at the transformer's feed-forward shapes (32 x 64 tokens,
# 128 -> 512 and 512 -> 128) and the MLP's hidden layer (256 samples, 1024 -> 1024).
_DENSE_SHAPES = ((2048, 128, 512), (2048, 512, 128), (256, 1024, 1024))
_FORWARD_FLOPS = sum(2 * rows * inner * cols for rows, inner, cols in _DENSE_SHAPES)
_PAIR_FLOPS = 2 * _FORWARD_FLOPS


def _dense_operands(tf):
    def make():
        return tuple((tf.random.normal((rows, inner)), tf.random.normal((inner, cols)),
                      tf.random.normal((rows, cols)))
                     for rows, inner, cols in _DENSE_SHAPES)  # fmt: skip

    return make


def _dense_forward(*layers):
    """The Dense layers' forward products one after the other, as a model's forward runs
    them: the transformer's feed-forward up and down, then the MLP's hidden layer on an
    input of its own. One product at a time: independent products would run side by
    side on the runtime's inter-op threads, and one device with one thread per op
    measured 322 GFLOP/s as three of them, its 2 cores' rate."""
    import tensorflow as tf

    (x, up, _), (_, down, _), (inputs, weight, _) = layers
    hidden = x @ up @ down
    with tf.control_dependencies([hidden]):
        return [hidden, inputs @ weight]


def _dense_forward_rate(tf, places):
    """FLOP/s of the Dense layers' forward products (`_DENSE_SHAPES`) on every device of
    `places` at once, all of them together. It replaced a chain a @ b @ b^T @ b of
    [512, 512] x [512, 2048] products, which measured 152 GFLOP/s where the same shapes,
    each product with operands of its own, ran at 198-200 and a grid of shapes (rows
    128-8192, inner and columns 128-2048) at 167-221: that chain was what ran slow, and
    every rate measured against it (attention's share, the pools) with it."""
    seconds = _side_by_side(tf, places, _dense_operands(tf), _dense_forward)
    return len(places) * _FORWARD_FLOPS / seconds


def _gradient_pairs(*layers):
    """Each layer's input and weight gradients: independent products, which the
    runtime's inter-op threads run side by side."""
    import tensorflow as tf

    outputs = []
    for x, w, dy in layers:
        outputs += [tf.matmul(dy, w, transpose_b=True), tf.matmul(x, dy, transpose_a=True)]
    return outputs


# The zoo's transformer (tests/scripts/estimate_peak.py) at 32 samples per micro-batch:
# 64 positions, 4 heads of 32, hidden 128.
_BATCH, _POSITIONS, _HEADS, _HEAD_SIZE = 32, 64, 4, 32


def attention_share(tf, places):
    """The rate of attention's per-head products as Keras's MultiHeadAttention runs them
    (its two einsums, scores and context, at the zoo's transformer's sizes) with their
    gradients, over the rate of the Dense layers' forward products on the same devices,
    measured one after the other (a share the machine's load leaves alike)."""
    big = _dense_forward_rate(tf, places) / len(places)
    shape = (_BATCH, _POSITIONS, _HEADS, _HEAD_SIZE)

    def forward_and_backward(query, key, value):
        with tf.GradientTape() as tape:
            tape.watch([query, key, value])
            scores = tf.einsum("aecd,abcd->acbe", key, query)  # Keras's equations
            context = tf.einsum("acbe,aecd->abcd", scores, value)
        return tape.gradient(context, [query, key, value])

    products = 2 * 2 * _BATCH * _HEADS * _POSITIONS * _POSITIONS * _HEAD_SIZE  # both, forward
    seconds = _side_by_side(
        tf, places, lambda: tuple(tf.random.normal(shape) for _ in range(3)), forward_and_backward
    )
    attention = 3 * products / seconds
    return {"attention_flops": len(places) * attention, "matmul_flops": len(places) * big,
            "batched_matmul_efficiency": attention / big}  # fmt: skip


def layer_norm_share(tf, places):
    """The bytes per second of a Keras LayerNormalization's forward and backward ops (an
    activation of the zoo's transformer, [32, 64, 128] float32, 1 MB: the ops of a layer
    read what the one before wrote, from the caches), its bytes counted from its traced
    ops as `core/graph/traffic.py` counts a model's, over the adds' bandwidth of 2**22
    float32 on the same devices."""
    import keras

    from epl_trainer.core.graph import flops as flops_module
    from epl_trainer.core.graph import traffic

    adds = _adds_bandwidth(tf, places)
    shape = (_BATCH, _POSITIONS, _HEADS * _HEAD_SIZE)

    def make():
        layer, x = keras.layers.LayerNormalization(), tf.random.normal(shape)
        layer(x)  # built outside the timed functions
        return layer, x, tf.random.normal(shape)

    def forward_and_backward(layer, x, upstream):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
        return tape.gradient(y, [x, *layer.trainable_weights], output_gradients=upstream)

    seconds = _side_by_side(tf, places, make, forward_and_backward)
    one = _on(tf, places[0], make)
    graph = tf.function(lambda: forward_and_backward(*one)).get_concrete_function().graph
    walker = traffic._TrafficWalker(flops_module._LayerTree(None), set(), {})
    moved = len(places) * sum(op.moved_bytes for op in walker.walk(graph, "", 1))
    rate = moved / seconds
    return {"layer_norm_bandwidth": rate, "memory_bandwidth": adds,
            "elementwise_speedup": rate / adds}  # fmt: skip


def main():
    if serve_child(measure):
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        default=",".join(PARTS),
        help="comma-separated parts to measure (default: all)",
    )
    parser.add_argument("--runs", type=int, default=3, help="fresh runs; each number's median")
    parser.add_argument(
        "--write", action="store_true",
        help="store the result in the \"cpu\" device's calibration file "
        "(epl_trainer/core/plan/cpu_calibration.json), replacing what it measured",
    )  # fmt: skip
    args = parser.parse_args()
    chosen = args.only.split(",")
    unknown = sorted(set(chosen) - set(PARTS))
    if unknown:
        parser.error(f"unknown --only parts {unknown}; known: {','.join(PARTS)}")
    if args.write:
        check_writable(chosen)
    runs = [calibrate_once(chosen) for _ in range(args.runs)]
    result = median_of(runs)
    check_rates(result)
    result["measured"] = time.strftime("%Y-%m-%d")
    result["runs"] = args.runs
    print(json.dumps(result))
    if args.write:
        write_calibration(result)


def check_rates(result):
    """Every rate and share must be positive: a slope of 0 or less means the copies of
    a body did not run one after the other (pruned, or the machine busier for one)."""
    for key, value in result.items():
        if not key.endswith(("flops", "bandwidth", "efficiency")):
            continue
        pairs = value if isinstance(value, list) else [[None, value]]
        bad = [rate for _, rate in pairs if not rate > 0]
        if bad:
            sys.exit(f"{key} measured {bad}: not a rate; rerun on a quiet machine")


def check_writable(chosen):
    """A calibration file describes one machine: a part of a calibration may replace its
    values only on the CPU the rest was measured on."""
    from epl_trainer.core.plan import devices

    stale = devices.stale_cpu_calibration()
    if stale and set(chosen) != set(PARTS):
        sys.exit(f"--write with --only {','.join(chosen)}: {stale}. Calibrate every part "
                 "here (no --only) so that no rate of the other machine stays.")  # fmt: skip


def write_calibration(result):
    """Replace the file's values with `result`'s, keep the rest, and record this CPU."""
    from epl_trainer.core.plan import devices

    with open(devices.CPU_CALIBRATION_FILE) as f:
        stored = json.load(f)
    stored.update(result, machine=devices.this_cpu())
    text = ",\n".join(f" {json.dumps(key)}: {json.dumps(value)}" for key, value in stored.items())
    temporary = devices.CPU_CALIBRATION_FILE + ".tmp"
    with open(temporary, "w") as f:
        f.write("{\n" + text + "\n}\n")
    os.replace(temporary, devices.CPU_CALIBRATION_FILE)  # never a half-written file
    print(f"wrote {devices.CPU_CALIBRATION_FILE}", file=sys.stderr)


def _measured(arguments):
    """One measurement in a fresh process, started once the machine is quiet."""
    from plan_accuracy import wait_for_quiet

    wait_for_quiet()
    return run_child(__file__, arguments)


def calibrate_once(chosen):
    result = {}
    for what, key in (("matmul", "matmul_flops"), ("memory", "memory_bandwidth")):
        if what in chosen:
            rates = [[n, _measured([what, n])[key]] for n in POOL_DEVICES]
            result[key] = rates[0][1]
            result[f"pool_{key}"] = rates
            result[f"thread_{key}"] = _measured([what, 1, 1])[key]
    if "gradient_pairs" in chosen:  # one device, one thread per op, the others idle
        result["thread_pair_matmul_flops"] = _measured(["gradient_pairs", 1, 1])["matmul_flops"]
    if "attention" in chosen:  # on 1, 2 and 4 devices; the constant is their median
        key = "batched_matmul_efficiency"
        shares = [[n, _measured(["attention", n])[key]] for n in POOL_DEVICES]
        result[f"pool_{key}"] = shares
        result[key] = statistics.median(share for _, share in shares)
    if "layer_norm" in chosen:  # bytes/s on 1, 2 and 4 devices side by side
        result["pool_layer_norm_bandwidth"] = [
            [n, _measured(["layer_norm", n])["layer_norm_bandwidth"]] for n in POOL_DEVICES
        ]
    if "collective" in chosen:
        result.update(_measured("collective"))
    if "overhead" in chosen:
        result["pool_overhead"] = [
            _measured(["overhead", devices])["pool_overhead"][0] for devices in POOL_DEVICES
        ]
    return result


def median_of(runs):
    """Each number's median over the runs (the same structure in each): one run's best
    of REPEATS still moves by 10-30% between runs on this shared machine."""
    first = runs[0]
    if isinstance(first, dict):
        return {key: median_of([run[key] for run in runs]) for key in first}
    if isinstance(first, list):
        return [median_of(list(items)) for items in zip(*runs)]
    return statistics.median(runs)


if __name__ == "__main__":
    main()
