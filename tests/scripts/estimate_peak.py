"""Measured peak memory of EPLTrainer steps, for comparison with epl-plan's estimate.

Usage: estimate_peak.py MODEL DEVICES MICRO_BATCH_SIZE [CONFIG_JSON]
MODEL is "transformer" or "mlp" (`build_model`, shared with tests/test_estimate.py).
Prints one JSON line {"peak", "resident", "params", "batch"}. As bench/memory.py and
docs/architecture.md ("Peak memory") measure: a fresh process, one step to trace and build, then
the allocator's peak (`epl_trainer.training.memory.allocator_memory`) over the next steps after a
reset (on CPU the logical devices share one allocator: the whole process's tensors).
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))

from epl_trainer.runtime.cluster import configure_tensorflow

# The transformer as `epl-plan --model transformer` describes it with these sizes.
TRANSFORMER = {"layers": 4, "hidden": 128, "heads": 4, "ffn": 512, "vocab": 1000, "seq_len": 64}


def build_model(kind):
    import keras

    keras.utils.set_random_seed(0)
    if kind == "transformer":  # pre-LN, no position embeddings, mean-pool classifier
        t = TRANSFORMER
        tokens = keras.Input((t["seq_len"],), dtype="int32")
        h = keras.layers.Embedding(t["vocab"], t["hidden"], name="embed")(tokens)
        for i in range(t["layers"]):
            a = keras.layers.LayerNormalization(name=f"ln_a{i}")(h)
            a = keras.layers.MultiHeadAttention(
                t["heads"], t["hidden"] // t["heads"], name=f"attn{i}"
            )(a, a)
            h = keras.layers.Add(name=f"res_a{i}")([h, a])
            f = keras.layers.LayerNormalization(name=f"ln_f{i}")(h)
            f = keras.layers.Dense(t["ffn"], activation="gelu", name=f"up{i}")(f)
            f = keras.layers.Dense(t["hidden"], name=f"down{i}")(f)
            h = keras.layers.Add(name=f"res_f{i}")([h, f])
        h = keras.layers.LayerNormalization(name="ln_final")(h)
        h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
        return keras.Model(tokens, keras.layers.Dense(10, name="head")(h))
    inputs = keras.Input((512,))  # MLP: 4 x Dense(1024, relu)
    h = inputs
    for i in range(4):
        h = keras.layers.Dense(1024, activation="relu", name=f"dense_{i}")(h)
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(h))


def main():
    kind, devices, micro_batch_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    overrides = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    configure_tensorflow(devices)
    import keras
    import numpy as np
    import tensorflow as tf

    import epl_trainer as epl
    from epl_trainer.training.memory import allocator_memory, reset_peak_memory

    model = build_model(kind)
    trainer = epl.EPLTrainer(
        model,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.Adam(1e-4),
        config={"cluster.virtual_devices": devices, **overrides},
        # The estimate models plain ops. The whole step in XLA ("auto" on one device
        # without oneDNN, jit_choice.py) keeps less: the transformer with bfloat16 AMP
        # peaked at 154.6 MB there against 221 MB estimated (and measured as plain ops).
        jit_compile=False,
    )
    plan = trainer.plan
    batch = micro_batch_size * plan.num_micro_batch * plan.num_replicas
    rng = np.random.default_rng(0)
    if kind == "transformer":
        x = rng.integers(0, TRANSFORMER["vocab"], size=(batch, TRANSFORMER["seq_len"]))
        x = x.astype("int32")
    else:
        x = rng.normal(size=(batch, 512)).astype("float32")
    y = rng.integers(0, 10, batch).astype("int32")
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
    trainer.fit(dataset, steps_per_epoch=1, verbose=0)  # trace and build
    resident = allocator_memory()["current"]
    reset_peak_memory()
    trainer.fit(dataset, steps_per_epoch=2, verbose=0)
    peak = allocator_memory()["peak"]
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    print(json.dumps({"peak": peak, "resident": resident, "params": params, "batch": batch}))


if __name__ == "__main__":
    main()
