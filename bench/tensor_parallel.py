"""A Megatron MLP pair, tensor parallel over 2 devices, against data parallelism and Keras.

Usage: python bench/tensor_parallel.py [--width 4096] [--batch 32] [--steps 10] [--repeats 3]
       python bench/tensor_parallel.py --model llama [--width 512] [--batch 8] ...

With `--model llama`, the model is a KerasHub `LlamaCausalLM` (random weights, nothing
downloaded: 4 decoder blocks of hidden size `width`, 8 heads, intermediate 2.75 x width,
vocabulary 8192, sequence 128) and the tensor-parallel runner uses KerasHub's own
`LlamaBackbone.get_layout_map` on a (1, 2) mesh: attention by heads and the MLP pairs
computed sharded in the decoder blocks (split/decoder_blocks.py), query, key and value
gathered whole (the map shards their hidden dimension).

One process, 2 logical CPU devices. The model is an MLP block (width -> 4 * width, gelu,
-> width) and a 16-class head. Three runners train it with SGD on the same batches:
plain Keras `fit` on one device; EPLTrainer with `keras.distribution.DataParallel` over
the 2 devices (each holds the whole MLP); EPLTrainer with a `ModelParallel` layout map on
a (1, 2) mesh laying the MLP out column -> row (each device holds half of it and computes
its half); and the same map without up's bias laid out, which makes no Megatron pair, so
both kernels are held as halves and gathered whole on use (split/layers.py). Each is
timed `repeats` times after a warm-up `fit` that traces the step; the table shows the
median ms per step and the bytes of model variables per device (`trainer.placement()`).
Logical devices share the machine's cores: the rows compare the machinery and the
memory, not a speed-up.
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

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
LLAMA_VOCABULARY, LLAMA_SEQUENCE = 8192, 128


def make_model(width):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((width,))
    h = keras.layers.Dense(4 * width, activation="gelu", name="up")(inputs)
    h = keras.layers.Dense(width, name="down")(h)
    return keras.Model(inputs, keras.layers.Dense(16, name="head")(h))


def tensor_parallel_layouts(pair=True):
    devices = keras.distribution.list_devices()[:2]
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")
    if pair:  # a column layer's bias is sharded with its kernel
        layout_map["up/bias"] = ("model",)
    layout_map["down/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(layout_map=layout_map)


def make_llama(width):
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=LLAMA_VOCABULARY,
        num_layers=4,
        num_query_heads=8,
        num_key_value_heads=8,
        hidden_dim=width,
        intermediate_dim=width * 11 // 4,
    )
    return keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)


def llama_layouts():
    import keras_hub

    devices = keras.distribution.list_devices()[:2]
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices)
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    return keras.distribution.ModelParallel(layout_map=layout_map)


def runners(width, model):
    """name -> (fit(dataset, steps), bytes of model variables per device)."""
    make = make_llama if model == "llama" else make_model
    keras_model = make(width)
    keras_model.compile(keras.optimizers.SGD(0.01), LOSS, jit_compile=False)
    whole = sum(int(np.prod(v.shape)) * 4 for v in keras_model.variables)
    made = {
        "Keras fit, 1 device": (
            lambda data, steps: keras_model.fit(data, steps_per_epoch=steps, verbose=0),
            {"CPU:0": whole},
        )
    }
    data_parallel = keras.distribution.DataParallel(devices=keras.distribution.list_devices()[:2])
    if model == "llama":
        strategies = {
            "EPLTrainer DataParallel, 2 devices": data_parallel,
            "EPLTrainer Llama's layout map (1, 2)": llama_layouts(),
        }
    else:
        strategies = {
            "EPLTrainer DataParallel, 2 devices": data_parallel,
            "EPLTrainer tensor parallel (1, 2)": tensor_parallel_layouts(),
            "EPLTrainer (1, 2), gathered on use": tensor_parallel_layouts(pair=False),
        }
    for name, strategy in strategies.items():
        trainer = epl.EPLTrainer(make(width), LOSS, keras.optimizers.SGD(0.01), strategy=strategy)
        made[name] = (
            lambda data, steps, t=trainer: t.fit(data, steps_per_epoch=steps, verbose=0),
            trainer,
        )
    return made


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("mlp", "llama"), default="mlp")
    parser.add_argument("--width", type=int, help="(default 4096; llama: 512)")
    parser.add_argument("--batch", type=int, help="(default 32; llama: 8 sequences)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llama = args.model == "llama"
    width = args.width or (512 if llama else 4096)
    batch = args.batch or (8 if llama else 32)
    rng = np.random.default_rng(0)
    if llama:
        tokens = rng.integers(1, LLAMA_VOCABULARY, (batch, LLAMA_SEQUENCE + 1)).astype("int32")
        x = {
            "token_ids": tokens[:, :-1],
            "padding_mask": np.ones((batch, LLAMA_SEQUENCE), bool),
        }
        y = tokens[:, 1:]
    else:
        x = rng.normal(size=(batch, width)).astype("float32")
        y = rng.integers(0, 16, batch).astype("int32")
    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    rows = []
    for name, (fit, holder) in runners(width, args.model).items():
        fit(data, 2)  # trace and build
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fit(data, args.steps)
            times.append((time.perf_counter() - start) / args.steps * 1e3)
        placement = holder if isinstance(holder, dict) else holder.placement()
        per_device = max(placement.values()) / 1e6
        rows.append((name, statistics.median(times), per_device))
    base = rows[0][1]
    if llama:
        print(
            f"\nKerasHub Llama: 4 blocks, hidden {width}, 8 heads, vocabulary "
            f"{LLAMA_VOCABULARY}, {batch} x {LLAMA_SEQUENCE} tokens a step, SGD"
        )
    else:
        print(f"\nMLP {width} -> {4 * width} -> {width}, batch {batch}, SGD")
    print(f"{'runner':38s} {'ms/step':>9s} {'vs Keras':>9s} {'MB per device':>14s}")
    for name, ms, mb in rows:
        print(f"{name:38s} {ms:9.1f} {ms / base:8.2f}x {mb:14.1f}")


if __name__ == "__main__":
    main()
