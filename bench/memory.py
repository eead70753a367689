"""Memory features, measured: peak memory and step time per configuration.

Usage: python bench/memory.py [--steps 10] [--only gc,amp,apply,amp_speed,zero]

Every configuration runs in a fresh process (peak memory is process-wide on CPU), which
builds the trainer, runs one step to trace, resets the allocator statistics and then
times `--steps` steps. "step peak" is the peak during those steps minus the memory held
before them (weights, optimizer state): the activations and temporaries of a step.
The "zero" group runs one data-parallel job on 4 logical devices per ZeRO level (a
parameter-heavy MLP, Adam, 2 micro-batches) and prints, per device, the measured peak
(the process's peak / 4: the replicas are identical and share one allocator) next to
`epl-plan`'s estimate of the same run (`estimate.estimate(...).max_peak`, from the
Keras graph as the automatic partition costs it). The last table evaluates the ZeRO
paper's per-device model-state formulas for the measured model: 2+2+12 bytes per
parameter (fp16 weights and gradients, fp32 Adam states and master weights), 2+2+12/N
with optimizer-state sharding, 2+14/N with gradients sharded too.
"""

import argparse
import json
import os
import sys

from _fresh_process import run_child, timed_peak

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)

# name -> (model, config overrides)
CONFIGS = {
    "gc": [
        ("8-layer transformer, GC off", "deep", {}),
        ("8-layer transformer, GC auto", "deep", {"gradient_checkpoint.type": "auto"}),
    ],
    # The same with 64-wide attention heads: attention dominates the recomputed forward.
    "gc_heads64": [
        ("transformer key_dim 64, GC off", "deep64", {}),
        ("transformer key_dim 64, GC auto", "deep64", {"gradient_checkpoint.type": "auto"}),
    ],
    # float16 is left out: this CPU has no fast float16 kernels (measured ~450x slower).
    "amp": [
        ("activation-heavy MLP, fp32", "wide", {}),
        ("activation-heavy MLP, O1 bf16", "wide", {"amp.level": "O1", "amp.dtype": "bfloat16"}),
    ],
    "amp_speed": [
        ("matmul-heavy MLP, fp32", "matmul", {}),
        ("matmul-heavy MLP, O1 bf16", "matmul", {"amp.level": "O1", "amp.dtype": "bfloat16"}),
    ],
    "apply": [
        ("many weights, apply groups 1", "many", {"optimizer.num_apply_group": 1}),
        ("many weights, apply groups 8", "many", {"optimizer.num_apply_group": 8}),
    ],
}


def build_model(kind):
    import keras

    keras.utils.set_random_seed(0)
    if kind in ("deep", "deep64"):  # activations dominate: pre-norm, d=128, T=64, batch 32
        tokens = keras.Input((64,), dtype="int32")
        h = keras.layers.Embedding(1000, 128, name="embed")(tokens)
        for i in range(8):
            a = keras.layers.LayerNormalization(name=f"ln_a{i}")(h)
            key_dim = 64 if kind == "deep64" else 4
            a = keras.layers.MultiHeadAttention(2, key_dim, name=f"attn{i}")(a, a)
            h = keras.layers.Add(name=f"res_a{i}")([h, a])
            f = keras.layers.LayerNormalization(name=f"ln_f{i}")(h)
            f = keras.layers.Dense(512, activation="gelu", name=f"up{i}")(f)
            f = keras.layers.Dense(128, name=f"down{i}")(f)
            h = keras.layers.Add(name=f"res_f{i}")([h, f])
        h = keras.layers.GlobalAveragePooling1D(name="pool")(keras.layers.LayerNormalization()(h))
        return keras.Model(tokens, keras.layers.Dense(10, name="head")(h)), 32, "tokens"
    if kind == "wide":  # activations >> weights: 4 x Dense(512) on batch 4096
        inputs = keras.Input((512,))
        h = inputs
        for i in range(4):
            h = keras.layers.Dense(512, activation="relu", name=f"dense_{i}")(h)
        return keras.Model(inputs, keras.layers.Dense(10, name="head")(h)), 4096, (512,)
    if kind == "matmul":  # matmul-heavy: 4 x Dense(2048) on batch 256
        inputs = keras.Input((2048,))
        h = inputs
        for i in range(4):
            h = keras.layers.Dense(2048, activation="relu", name=f"dense_{i}")(h)
        return keras.Model(inputs, keras.layers.Dense(10, name="head")(h)), 256, (2048,)
    # "many": optimizer-state heavy, small activations: 16 x Dense(1024) on batch 8
    inputs = keras.Input((1024,))
    h = inputs
    for i in range(16):
        h = keras.layers.Dense(1024, name=f"dense_{i}")(h)
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(h)), 8, (1024,)


ZERO_DEVICES = 4
ZERO_MICRO_BATCH = 2
# (name, zero.level, gradient checkpointing): v2 gathers each stage's parameters once per
# step, or with checkpointing one segment at a time (again in its backward).
ZERO_LEVELS = [
    ("none", "", ""),
    ("v0 (optimizer states)", "v0", ""),
    ("v1 (+ gradients)", "v1", ""),
    ("v2 (+ parameters)", "v2", ""),
    ("v2 + checkpointing", "v2", "auto"),
]


def build_zero_model():
    """Parameter-heavy: 4 x Dense(1024) on 512 inputs (3.7M parameters), batch 16 per
    device: model states dominate, as in the ZeRO paper's figure."""
    import keras

    keras.utils.set_random_seed(0)
    inputs = keras.Input((512,))
    h = inputs
    for i in range(4):
        h = keras.layers.Dense(1024, activation="relu", name=f"dense_{i}")(h)
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(h))


def measure_zero(level, checkpointing, steps):
    """Child process: one ZeRO level on ZERO_DEVICES logical devices."""
    sys.path.insert(0, ROOT)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from epl_trainer.runtime.cluster import configure_tensorflow

    configure_tensorflow(ZERO_DEVICES)
    import keras
    import numpy as np
    import tensorflow as tf

    import epl_trainer as epl

    trainer = epl.EPLTrainer(
        build_zero_model(),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.Adam(1e-4),
        config={
            "cluster.virtual_devices": ZERO_DEVICES,
            "zero.level": level,
            "pipeline.num_micro_batch": ZERO_MICRO_BATCH,
            "gradient_checkpoint.type": checkpointing,
        },
    )
    batch = 16 * ZERO_DEVICES * ZERO_MICRO_BATCH
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, 512)).astype("float32")
    y = rng.integers(0, 10, batch).astype("int32")
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
    trainer.fit(dataset, steps_per_epoch=1, verbose=0)  # trace and build
    measured = timed_peak(
        lambda count: trainer.fit(dataset, steps_per_epoch=count, verbose=0), steps
    )
    report = trainer.memory_report(print_table=False)
    row = report[trainer.lanes[0].devices[0]]
    return {**measured, "states": [row.parameters, row.gradients, row.optimizer]}


def predict_zero(level, checkpointing):
    """epl-plan's per-device peak for the same run."""
    sys.path.insert(0, ROOT)
    from epl_trainer.core.graph.auto_partition import model_cost
    from epl_trainer.core.plan import estimate, planner
    from epl_trainer.core.plan.ir import StrategySpec

    plan = planner.build_plan(
        [StrategySpec("replicate", 1, "stage_0")],
        estimate.virtual_cluster(1, ZERO_DEVICES, "CPU"),
        0,
        num_micro_batch=ZERO_MICRO_BATCH,
    )
    options = estimate.TrainOptions(micro_batch_size=16, zero=level, gc=bool(checkpointing))
    return estimate.estimate(model_cost(build_zero_model()), plan, options).max_peak


def print_zero_table(rows):
    print(
        f"\nZeRO on {ZERO_DEVICES} logical devices (data parallel, Adam, "
        f"{ZERO_MICRO_BATCH} micro-batches): MiB per device"
    )
    header = ("zero.level", "measured peak", "epl-plan peak", "error", "params/grads/opt (report)")
    widths = (24, 13, 13, 7, 28)
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for name, measured, predicted in rows:
        per_device = measured["peak"] / ZERO_DEVICES
        states = "/".join(mib(b) for b in measured["states"])
        cells = (
            name,
            mib(per_device),
            mib(predicted),
            f"{predicted / per_device - 1:+.0%}",
            states,
        )
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths)))


def measure(kind, overrides, steps):
    """Runs in the child process; returns a dict of measurements."""
    sys.path.insert(0, ROOT)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from epl_trainer.runtime.cluster import configure_tensorflow

    configure_tensorflow(1)
    import keras
    import numpy as np
    import tensorflow as tf

    import epl_trainer as epl

    model, batch, shape = build_model(kind)
    trainer = epl.EPLTrainer(
        model,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.Adam(1e-4),
        config={"cluster.virtual_devices": 1, **overrides},
    )
    rng = np.random.default_rng(0)
    if shape == "tokens":
        x = rng.integers(0, 1000, size=(batch, 64)).astype("int32")
    else:
        x = rng.normal(size=(batch, *shape)).astype("float32")
    y = rng.integers(0, 10, batch).astype("int32")
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
    trainer.fit(dataset, steps_per_epoch=1, verbose=0)  # trace and build
    measured = timed_peak(
        lambda count: trainer.fit(dataset, steps_per_epoch=count, verbose=0), steps
    )
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    return {**measured, "params": params}


def mib(count):
    return f"{count / 2**20:.1f}"


def print_table(title, rows):
    header = ("configuration", "peak MiB", "step peak MiB", "ms/step", "vs first")
    widths = (32, 9, 14, 8, 26)
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    first = rows[0][1]
    for name, r in rows:
        ratio = (
            f"step peak {r['step_peak'] / first['step_peak']:.2f}x, "
            f"time {r['step_ms'] / first['step_ms']:.2f}x"
        )
        cells = (name, mib(r["peak"]), mib(r["step_peak"]), f"{r['step_ms']:.1f}", ratio)
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths)))


def print_zero_formulas(params, n=4):
    print(
        f"\nZeRO paper model-state bytes per device for this model's {params:,} parameters "
        f"(mixed-precision Adam), N = {n} data-parallel devices"
    )
    rows = [
        ("baseline 2+2+12 bytes/param", 16 * params),
        ("optimizer states sharded 2+2+12/N", (4 + 12 / n) * params),
        ("+ gradients sharded 2+14/N", (2 + 14 / n) * params),
    ]
    for name, value in rows:
        print(f"  {name:<34} {value / 2**20:9.1f} MiB")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--only", default="gc,gc_heads64,amp,amp_speed,apply")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        arguments = json.loads(args.child)
        if arguments[0] == "zero":
            print(json.dumps(measure_zero(*arguments[1:])))
        else:
            print(json.dumps(measure(*arguments)))
        return
    params = None
    for group in args.only.split(","):
        if group == "zero":
            rows = [
                (
                    name,
                    run_child(__file__, ["zero", level, gc, args.steps]),
                    predict_zero(level, gc),
                )
                for name, level, gc in ZERO_LEVELS
            ]
            print_zero_table(rows)
            continue
        rows = [
            (name, run_child(__file__, [kind, overrides, args.steps]))
            for name, kind, overrides in CONFIGS[group]
        ]
        print_table(
            {
                "gc": "Gradient checkpointing (attention key_dim 4)",
                "gc_heads64": "Gradient checkpointing (attention key_dim 64)",
                "amp": "Memory-efficient AMP (memory)",
                "amp_speed": "AMP step time (matmul-heavy)",
                "apply": "Grouped apply (Adam)",
            }[group],
            rows,
        )
        if group == "apply":
            params = rows[0][1]["params"]
    if params:
        print_zero_formulas(params)


if __name__ == "__main__":
    main()
