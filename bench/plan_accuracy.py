"""epl-plan's predictions against measured runs: peak memory and step time, per layout.

Usage: nice -n 10 python bench/plan_accuracy.py [--only 1,5,7] [--steps 5] [--json FILE]

Each configuration is a `step_time.Layout` of one of two small models (the 4-layer
transformer of tests/scripts/estimate_peak.py, and a 4 x Dense(1024) MLP), trained by
EPLTrainer with the config keys `Layout.config()` gives (what `epl-plan --search
--save_config` writes) on logical CPU devices with the trainer's threads per op
(`configure_trainer_threads`), one fresh process per configuration, one at a time, each
started once the machine is quiet (`wait_for_quiet`). The child traces one step, resets
the allocator's peak, then runs 5 fit calls of `--steps` steps and keeps the fastest
call's time per step, timed from the end of its first step to the end of its last
(`fit_step_seconds`: not the weight copies each fit call makes once; the machine is
shared, the fastest is the least disturbed). The prediction is `step_time.predict` of the
model's Keras graph (`auto_partition.model_cost`, what the automatic partition cuts; each
layer's elementwise bytes counted from its traced step's ops, `core/graph/traffic.py`)
on the "cpu" device, whose constants are bench/plan_calibrate.py's microbenchmarks:
nothing here is fitted to a configuration.

Memory: on CPU the logical devices share one allocator, so the measured peak is the
process's, and the prediction is too (`step_time.process_peak_bytes`: the host copy of
the model and its optimizer, every replica's states, and the replicas' activations as
the runtime runs them, `cores` at a time). The per-device column divides both by the
devices. As in tests/test_estimate.py, steps run as plain ops (`jit_compile=False`): the
estimate describes them.
"""

import argparse
import json
import os
import sys

from _fresh_process import run_child, serve_child

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
sys.path.insert(0, ROOT)

MEMORY_TOLERANCE, TIME_TOLERANCE = 0.10, 0.20
REPEATS = 5  # timed fit calls of --steps steps; the fastest counts

# (model, samples per micro-batch, Layout fields): the transformer and the MLP under every
# parallel mode the trainer runs on logical CPU devices.
T, M = "transformer", "mlp"
CONFIGS = [
    (T, 32, {}),
    (T, 32, {"gc": True}),
    (T, 8, {"num_micro_batch": 4}),
    (T, 16, {"data_parallel": 2}),
    (T, 16, {"data_parallel": 2, "zero": "v1"}),
    (T, 16, {"data_parallel": 2, "zero": "v2"}),
    (T, 16, {"data_parallel": 2, "gc": True}),
    (T, 8, {"data_parallel": 4}),
    (T, 8, {"data_parallel": 4, "zero": "v0"}),
    (T, 8, {"data_parallel": 4, "zero": "v1"}),
    (T, 8, {"pipeline_parallel": 2, "num_micro_batch": 4}),
    (T, 8, {"pipeline_parallel": 2, "num_micro_batch": 4, "schedule": "PreferForward"}),
    (T, 8, {"pipeline_parallel": 2, "num_micro_batch": 4, "schedule": "ZeroBubbleH1"}),
    (T, 8, {"pipeline_parallel": 2, "num_micro_batch": 4, "schedule": "Interleaved1F1B",
            "virtual_stages": 2}),
    (T, 8, {"pipeline_parallel": 2, "num_micro_batch": 4, "gc": True}),
    (T, 8, {"pipeline_parallel": 4, "num_micro_batch": 8}),
    (T, 8, {"pipeline_parallel": 4, "num_micro_batch": 8, "schedule": "PreferForward"}),
    (T, 8, {"pipeline_parallel": 2, "data_parallel": 2, "num_micro_batch": 4}),
    (T, 32, {"offload": True}),
    (T, 8, {"data_parallel": 2, "num_micro_batch": 2, "zero": "v1", "gc": True}),
    (M, 256, {}),
    (M, 256, {"gc": True}),
    (M, 128, {"data_parallel": 2}),
    (M, 128, {"data_parallel": 2, "zero": "v0"}),
    (M, 128, {"data_parallel": 2, "zero": "v1"}),
    (M, 128, {"data_parallel": 2, "zero": "v2"}),
    (M, 64, {"data_parallel": 4}),
    (M, 64, {"data_parallel": 4, "zero": "v1"}),
    (M, 64, {"data_parallel": 4, "zero": "v2"}),
    (M, 64, {"pipeline_parallel": 2, "num_micro_batch": 4}),
    (M, 64, {"pipeline_parallel": 2, "num_micro_batch": 4, "schedule": "ZeroBubbleH1"}),
    (M, 128, {"data_parallel": 2, "offload": True}),
]  # fmt: skip


def build_model(kind):
    sys.path.insert(0, os.path.join(ROOT, "tests", "scripts"))
    from estimate_peak import build_model as build  # the models tests/test_estimate.py measures

    return build(kind)


def configure_trainer_threads(device_count):
    """The logical devices and thread pools the trainer gives `device_count` devices
    (`runtime/cluster.build_cluster`: cores // devices threads per op), made before the
    model is built (which starts TensorFlow, after which the trainer cannot set them).
    Without the threads, every op of every device would take all the cores: not what a
    job runs, and 1.2-1.3x slower for 4 data-parallel devices and a 2-stage GPipe."""
    from epl_trainer.runtime.cluster import (
        available_cores,
        configure_tensorflow,
        default_intra_op_threads,
    )

    threads = default_intra_op_threads(device_count, available_cores())
    configure_tensorflow(device_count, intra_op_threads=threads)


def fit_step_seconds(trainer, dataset, steps):
    """Seconds per step of one `trainer.fit` of `steps` steps (>= 2), from the end of its
    first step to the end of its last: a step as a long job runs it, without what a
    fit call does once. Each call copies the Keras model's weights into the trainer
    (and the optimizer's state) at its start and back at its end, eager ops per
    variable. Timed whole and divided by 5 steps, row 6 (ZeRO v2, whose copies cut and
    join every variable's pieces: 83 ms in, 22 out) measured 141-148 ms a step where its
    steps took 80-98; row 1 (no ZeRO) 111-121 where they took 96-100."""
    import time

    import keras

    class StepClock(keras.callbacks.Callback):
        reads_logs_only = True  # no write-back of the weights after each step

        def __init__(self):
            super().__init__()
            self.ends = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

    clock = StepClock()
    trainer.fit(dataset, steps_per_epoch=steps, verbose=0, callbacks=[clock])
    return (clock.ends[-1] - clock.ends[0]) / (len(clock.ends) - 1)


def measure(arguments):
    """Child: one configuration's measured peak and step time, and the prediction."""
    kind, micro_batch_size, fields, steps = arguments
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from epl_trainer.core.plan import devices, step_time

    layout = step_time.Layout(micro_batch_size=micro_batch_size, **fields)
    device_count = layout.data_parallel * layout.pipeline_parallel
    configure_trainer_threads(device_count)
    import keras
    import numpy as np
    import tensorflow as tf

    import epl_trainer as epl
    from epl_trainer.training.memory import allocator_memory, reset_peak_memory

    model = build_model(kind)
    config = layout.config()
    trainer = epl.EPLTrainer(
        model,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.Adam(1e-4),
        config={"cluster.virtual_devices": device_count, **config},
        jit_compile=False,
    )
    batch = layout.global_batch
    rng = np.random.default_rng(0)
    if kind == "transformer":
        x = rng.integers(0, 1000, size=(batch, 64)).astype("int32")
    else:
        x = rng.normal(size=(batch, 512)).astype("float32")
    y = rng.integers(0, 10, batch).astype("int32")
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
    trainer.fit(dataset, steps_per_epoch=2, verbose=0)  # trace and build
    reset_peak_memory()
    best = min(fit_step_seconds(trainer, dataset, steps) for _ in range(REPEATS))
    peak = allocator_memory()["peak"]
    load = os.getloadavg()[0]

    return {
        "layout": layout.describe(),
        "machine": devices.this_cpu(),
        "devices": device_count,
        "measured_peak": peak,
        "measured_step_s": best,
        "load_average": load,
    }


def process_peak(cost, layout):
    """The process's predicted peak (`step_time.process_peak_bytes` on the "cpu" device:
    its logical devices share one allocator)."""
    from epl_trainer.core.plan import devices, step_time

    result = step_time.estimate_layout(cost, layout)
    return step_time.process_peak_bytes(result, layout, devices.device_by_name("cpu"))


def predict_rows(indices):
    """Child: the predictions of the configurations `indices` (1-based), from the
    models' Keras graphs, with the step-time model as it is now; the transformer's also
    from its sizes (`sizes_` keys: what `epl-plan --model transformer` describes)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from epl_trainer.core.plan import devices, step_time
    from epl_trainer.runtime.cluster import configure_tensorflow

    configure_tensorflow(1)
    costs = {kind: graph_cost(kind) for kind in (T, M)}
    sizes = transformer_from_sizes()
    cpu = devices.device_by_name("cpu")
    rows = []
    for index in indices:
        kind, micro_batch_size, fields = CONFIGS[index - 1]
        layout = step_time.Layout(micro_batch_size=micro_batch_size, **fields)
        prediction = step_time.predict(costs[kind], layout, cpu)
        row = {
            "predicted_peak": process_peak(costs[kind], layout),
            "predicted_step_s": prediction.step_time_s,
            "terms_s": prediction.terms,
        }
        if kind == T:
            by_sizes = step_time.predict(sizes, layout, cpu)
            row.update(
                sizes_predicted_peak=process_peak(sizes, layout),
                sizes_predicted_step_s=by_sizes.step_time_s,
                sizes_terms_s=by_sizes.terms,
            )
        rows.append(row)
    return rows


def graph_cost(kind):
    """The model's costs from its Keras graph (`auto_partition.model_cost`), each layer's
    elementwise bytes counted from the ops of its traced training step
    (`core/graph/traffic.py`)."""
    import keras
    import tensorflow as tf

    from epl_trainer.core.graph import traffic
    from epl_trainer.core.graph.auto_partition import model_cost

    model = build_model(kind)
    inputs = tf.TensorSpec((1, 64), tf.int32) if kind == T else tf.TensorSpec((1, 512))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    counts = traffic.elementwise_traffic(
        model, inputs, tf.TensorSpec((1,), tf.int32), lambda y, p, w: loss(y, p)
    )
    return traffic.with_elementwise_traffic(model_cost(model), counts)


def transformer_from_sizes():
    """The zoo's transformer as epl-plan describes it from its sizes (`analytic`: each
    layer's matmuls by shape, its normalisations, softmax and activations by bytes)."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "scripts"))
    from estimate_peak import TRANSFORMER

    from epl_trainer.core.plan import analytic

    return analytic.transformer(**TRANSFORMER, max_position=0, head="pool", num_classes=10)


def child(arguments):
    if arguments[0] == "predict":
        return predict_rows(arguments[1])
    return measure(arguments)


def _from_sizes(row):
    """The transformer's step time predicted from its sizes, and its error."""
    if "sizes_predicted_step_s" not in row:
        return ""
    _, error = _errors(row, "sizes_")
    return f"{row['sizes_predicted_step_s'] * 1e3:.1f} ({error:+.0%})"


def _errors(row, prefix=""):
    """(peak error, step-time error) of a row's prediction (`prefix` "sizes_": the one
    from the transformer's sizes)."""
    return (row[f"{prefix}predicted_peak"] / row["measured_peak"] - 1,
            row[f"{prefix}predicted_step_s"] / row["measured_step_s"] - 1)  # fmt: skip


def _within(row, prefix=""):
    """(peak within MEMORY_TOLERANCE, step time within TIME_TOLERANCE)."""
    memory_error, time_error = _errors(row, prefix)
    return abs(memory_error) <= MEMORY_TOLERANCE, abs(time_error) <= TIME_TOLERANCE


def print_table(rows):
    header = ["#", "model", "layout", "dev", "peak MB meas", "pred", "err",
              "step ms meas", "pred", "err", "from sizes", "load"]  # fmt: skip
    lines = [header]
    for index, (kind, row) in rows:
        (memory_error, time_error), (memory_ok, time_ok) = _errors(row), _within(row)
        lines.append([
            str(index), kind, row["layout"], str(row["devices"]),
            f"{row['measured_peak'] / 1e6:.1f}", f"{row['predicted_peak'] / 1e6:.1f}",
            f"{memory_error:+.1%}" + ("" if memory_ok else " !"),
            f"{row['measured_step_s'] * 1e3:.1f}", f"{row['predicted_step_s'] * 1e3:.1f}",
            f"{time_error:+.1%}" + ("" if time_ok else " !"),
            _from_sizes(row),
            f"{row['load_average']:.1f}" if "load_average" in row else "",
        ])  # fmt: skip
    print("| " + " | ".join(lines[0]) + " |")
    print("|" + "---|" * len(lines[0]))
    for line in lines[1:]:
        print("| " + " | ".join(line) + " |")
    within = [_within(row) for _, (_, row) in rows]
    print(
        f"\nWithin {MEMORY_TOLERANCE:.0%} (peak): {sum(m for m, _ in within)} of {len(rows)}; "
        f"within {TIME_TOLERANCE:.0%} (step time): {sum(t for _, t in within)} of {len(rows)}; "
        f"both: {sum(m and t for m, t in within)} ('!' marks a miss)."
    )
    by_sizes = [_within(r, "sizes_") for _, (_, r) in rows if "sizes_predicted_peak" in r]
    if by_sizes:
        print(
            f"The transformer's {len(by_sizes)} rows predicted from its sizes (epl-plan "
            f"--model transformer) instead: peak within {MEMORY_TOLERANCE:.0%} in "
            f"{sum(m for m, _ in by_sizes)}, step time within {TIME_TOLERANCE:.0%} in "
            f"{sum(t for _, t in by_sizes)}."
        )


def warn_of_other_machines(rows):
    """The step times are predicted with the "cpu" device's rates: say so where they
    were calibrated on another kind of CPU than the one that ran the rows."""
    from epl_trainer.core.plan import devices

    calibrated = devices.read_cpu_calibration()["machine"]
    ran = [row.get("machine") for row in rows]
    if any(machine != calibrated for machine in ran):
        names = sorted({m["cpu"] if m else "a CPU not recorded" for m in ran})
        print(f"\nWarning: the rows ran on {', '.join(names)}; the \"cpu\" device's rates "
              f"were measured on {calibrated['cpu']} (bench/plan_calibrate.py --write there "
              "recalibrates).")  # fmt: skip


def idle_share(seconds=3.0):
    """The share of the machine's CPU time that was idle over the last `seconds`
    (/proc/stat; 1.0 where it cannot be read)."""
    import time

    def read():
        try:
            with open("/proc/stat") as f:
                values = [int(v) for v in f.readline().split()[1:]]
        except OSError:
            return None
        return values[3] + values[4], sum(values)  # idle + iowait, all

    before = read()
    time.sleep(seconds)
    after = read()
    if before is None or after is None or after[1] == before[1]:
        return 1.0
    return (after[0] - before[0]) / (after[1] - before[1])


def wait_for_quiet(idle=0.75, timeout=900):
    """Waits (up to `timeout` seconds) until at least `idle` of the cores were idle over
    3 seconds: the machine is shared, and another process on one of its two cores slows a
    step by up to 1.8x (the zoo transformer's forward and backward: 91-99 ms quiet, 172
    with one core taken). The 1-minute load average lags by a minute and counted the
    bench's own finished child."""
    import time

    deadline = time.monotonic() + timeout
    while idle_share() < idle and time.monotonic() < deadline:
        pass


def main():
    if serve_child(child):
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated configuration numbers (1-based)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument(
        "--measured",
        help="a --json file of an earlier run: predict again against its measurements "
        "(no configuration runs)",
    )
    args = parser.parse_args()
    chosen = [int(i) for i in args.only.split(",")] if args.only else range(1, len(CONFIGS) + 1)
    rows = []
    if args.measured:
        with open(args.measured) as f:
            saved = {row["index"]: row for row in json.load(f)}
        rows = [(i, (saved[i]["model"], saved[i])) for i in chosen if i in saved]
    for index in [] if args.measured else chosen:
        wait_for_quiet()
        kind, micro_batch_size, fields = CONFIGS[index - 1]
        row = run_child(__file__, [kind, micro_batch_size, fields, args.steps], timeout=600)
        rows.append((index, (kind, row)))
        print(f"{index}: {row['layout']} done", file=sys.stderr)
    # Every prediction by the model as it is now, in one child (the measuring children
    # predicted too; a model changed since a run is applied to its measurements here).
    predictions = run_child(__file__, ["predict", [index for index, _ in rows]])
    for (_, (_, row)), prediction in zip(rows, predictions):
        row.update(prediction)
    print_table(rows)
    warn_of_other_machines([row for _, (_, row) in rows])
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"index": i, "model": k, **r} for i, (k, r) in rows], f, indent=1)


if __name__ == "__main__":
    main()
