"""Split vs replicated large classifier: peak memory and step time on 4 logical devices.

Usage: python bench/split.py [--classes 100000] [--steps 5] [--rounds 2]

The model is EPL's large-classification recipe in miniature: a small MLP feature
extractor (replicated) and a Dense classifier over `--classes` classes, trained with
Adam on a global batch of 64. Configurations:

* "EPL split": `replicate(4)` features + `split(4)` classifier, colocated: each device
  holds a quarter of the classifier (and of its Adam slots) and computes its classes'
  logits for all 64 rows; the softmax cross-entropy is reduced across devices;
* "EPL replicated": plain data parallelism, every device holds the whole classifier;
* "Keras + MirroredStrategy": what a user would write with `tf.distribute` today.

Each configuration runs in a fresh process (peak memory is process-wide on CPU: the
logical devices share one allocator). "step peak" is the peak during the timed steps
minus the memory held before them. Rounds are interleaved and the median is printed, as
the machine's timings are noisy. Logical devices share two cores: the step times show
relative work, not multi-GPU speed.
"""

import argparse
import json
import os
import statistics
import sys

from _fresh_process import run_child, timed_peak

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
DEVICES, BATCH, FEATURES, INPUT = 4, 64, 256, 64
CONFIGS = ("EPL split", "EPL replicated", "Keras + MirroredStrategy")


def build_model(classes):
    import keras

    keras.utils.set_random_seed(0)
    inputs = keras.Input((INPUT,), name="x")
    h = keras.layers.Dense(FEATURES, activation="relu", name="features_0")(inputs)
    h = keras.layers.Dense(FEATURES, activation="relu", name="features_1")(h)
    out = keras.layers.Dense(classes, name="classifier")(h)
    return keras.Model(inputs, out)


def measure(name, classes, steps):
    """Runs in the child process; returns a dict of measurements."""
    sys.path.insert(0, ROOT)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from epl_trainer.runtime.cluster import configure_tensorflow

    configure_tensorflow(DEVICES)
    import keras
    import numpy as np
    import tensorflow as tf

    import epl_trainer as epl

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, INPUT)).astype("float32")
    y = rng.integers(0, classes, BATCH).astype("int32")
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
    report = None
    if name == "Keras + MirroredStrategy":
        devices = [d.name for d in tf.config.list_logical_devices("CPU")][:DEVICES]
        with tf.distribute.MirroredStrategy(devices).scope():
            model = build_model(classes)
            model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)

        def run(count):
            model.fit(dataset, steps_per_epoch=count, verbose=0)
    else:
        epl.init({"cluster.virtual_devices": DEVICES})
        model = build_model(classes)
        config = {"cluster.virtual_devices": DEVICES}
        if name == "EPL split":
            config["cluster.colocate_split_and_replicate"] = True
            strategy = epl.Strategy(default=epl.replicate(DEVICES), split=["classifier"])
        else:
            strategy = epl.replicate(1)
        trainer = epl.EPLTrainer(
            model, loss, keras.optimizers.Adam(1e-3), strategy=strategy, config=config
        )

        def run(count):
            trainer.fit(dataset, steps_per_epoch=count, verbose=0)

    run(1)  # trace and build
    if name != "Keras + MirroredStrategy":
        memory = trainer.memory_report(print_table=False)
        report = max(row.total for row in memory.devices.values())
    return {**timed_peak(run, steps), "state_per_device": report}


def mib(count):
    return "-" if count is None else f"{count / 2**20:.0f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, default=100_000)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*json.loads(args.child))))
        return
    results = {name: [] for name in CONFIGS}
    for _ in range(args.rounds):
        for name in CONFIGS:
            results[name].append(run_child(__file__, [name, args.classes, args.steps]))
    params = FEATURES * args.classes + args.classes
    print(
        f"\n{args.classes:,}-class classifier ({params / 1e6:.1f}M parameters) on {DEVICES} "
        f"logical CPU devices, Adam, global batch {BATCH}; median of {args.rounds} rounds"
    )
    header = (
        "configuration",
        "peak MiB",
        "step peak MiB",
        "params+grads+Adam per device MiB",
        "ms/step",
    )
    widths = (26, 9, 14, 33, 8)
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    medians = {}
    for name in CONFIGS:
        runs = results[name]
        medians[name] = {
            key: (statistics.median(r[key] for r in runs) if runs[0][key] is not None else None)
            for key in runs[0]
        }
        m = medians[name]
        cells = (
            name,
            mib(m["peak"]),
            mib(m["step_peak"]),
            mib(m["state_per_device"]),
            f"{m['step_ms']:.0f}",
        )
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths)))
    split, replicated = medians["EPL split"], medians["EPL replicated"]
    mirrored = medians["Keras + MirroredStrategy"]
    print(
        f"\nsplit vs replicated: peak {split['peak'] / replicated['peak']:.2f}x, "
        f"per-device state {split['state_per_device'] / replicated['state_per_device']:.2f}x, "
        f"time {split['step_ms'] / replicated['step_ms']:.2f}x; "
        f"split vs MirroredStrategy: peak {split['peak'] / mirrored['peak']:.2f}x, "
        f"time {split['step_ms'] / mirrored['step_ms']:.2f}x"
    )


if __name__ == "__main__":
    main()
