"""MFU of the zoo's jobs: EPLTrainer (each recipe's config) against plain Keras `fit`.

Usage: python bench/mfu.py [--steps 10] [--jobs bert_squad resnet50 moe_t5 text_classifier]
                           [--markdown FILE]

Each (job, trainer) runs in a fresh process, one at a time (the machine's cores are
shared): the zoo model at its CPU recipe size on synthetic data, 2 epochs of `--steps`
steps, with the FLOPs profiler on (`profiler.flops` for EPLTrainer; a `FlopsProfiler`
callback for Keras). The row reports the second epoch (traced steps excluded):

- model GFLOP/step: the plain Keras training step's matmul/conv/einsum FLOPs, counted
  from its traced graph (epl_trainer/core/graph/flops_profile.py), the same for both;
- ms/step and TFLOP/s as measured, MFU = TFLOP/s / the machine's float32 matmul peak
  (epl_trainer/core/graph/peak.py, measured once per machine and cached).

EPLTrainer runs the recipe's layout on 2 simulated CPU devices of this machine
(`cluster.virtual_devices: 2`), Keras on one device with all cores: the comparison shows
what the parallel machinery costs on one host, not a speedup.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from _fresh_process import run_child

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
JOBS = {  # job -> (recipe config, global batch)
    "bert_squad": ("bert_squad_pipeline.json", 32),
    "resnet50": ("resnet50_dp.json", 32),
    "moe_t5": ("moe_t5_split.json", 64),
    "text_classifier": ("text_classifier_zero1.json", 32),
}


# ---------------------------------------------------------------- the child process
def _bert_squad(epl, keras, np, for_epl, batch):
    from model_zoo.bert_squad.modeling import BertConfig, build_squad_model

    seq = 80  # the recipe's --max_seq_length
    config = BertConfig.preset("tiny", vocab_size=1000)
    model = build_squad_model(config, seq, num_stages=2 if for_epl else 1)
    rng = np.random.default_rng(0)
    n = 4 * batch
    x = {
        "input_ids": rng.integers(1, 1000, (n, seq)).astype("int32"),
        "input_mask": np.ones((n, seq), "int32"),
        "segment_ids": rng.integers(0, 2, (n, seq)).astype("int32"),
    }
    y = {k: rng.integers(0, seq, n).astype("int32") for k in ("start_logits", "end_logits")}
    sparse = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    loss = {"start_logits": sparse, "end_logits": sparse}
    return model, x, y, loss, keras.optimizers.AdamW(1e-3)


def _resnet50(epl, keras, np, for_epl, batch):
    from model_zoo.resnet50 import model as resnet

    model = resnet.build_model(10, small=True)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * batch, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, 4 * batch).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, x, y, loss, keras.optimizers.Adam(1e-3)


def _moe_t5(epl, keras, np, for_epl, batch):
    from model_zoo.moe_t5 import data
    from model_zoo.moe_t5 import model as moe_t5

    length = 12  # the recipe's --max_source_length / --max_target_length
    vocab = data.task_vocabulary()
    config = moe_t5.T5Config(
        vocab_size=len(vocab), max_source_length=length, max_target_length=length,
        **moe_t5.CPU_SMALL,
    )  # fmt: skip
    model = moe_t5.build_model(config)
    rng = np.random.default_rng(0)
    n = 4 * batch
    tokens = rng.integers(3, len(vocab), (n, length)).astype("int32")
    x = {"encoder_tokens": tokens, "decoder_tokens": np.roll(tokens, 1, axis=1)}
    return model, x, tokens, moe_t5.SequenceCrossEntropy(), keras.optimizers.Adam(2e-3)


def _text_classifier(epl, keras, np, for_epl, batch):
    """The recipe's KerasHub BertTextClassifier (compiled with KerasHub's loss), on raw
    strings that its preprocessor tokenises in the data pipeline."""
    import tempfile

    from model_zoo.text_classifier import data, recipe

    options = recipe.Options(config=epl.Config(), dropout=0.0)
    texts, labels = data.builtin_split(4 * batch, seed=1)
    vocabulary = data.build_vocabulary(texts, os.path.join(tempfile.mkdtemp(), "vocab.txt"))
    task = recipe.build_task(options, vocabulary, int(np.max(labels)) + 1)
    return task, np.asarray(texts), np.asarray(labels, "int32"), None, None


BUILDERS = {
    "bert_squad": _bert_squad,
    "resnet50": _resnet50,
    "moe_t5": _moe_t5,
    "text_classifier": _text_classifier,
}


def _step_specs(model, dataset, rows):
    """(features, labels) specs of a step of `rows` rows, as the model sees them: a
    KerasHub task's features are its preprocessor's outputs, not the raw strings."""
    import tensorflow as tf

    features, labels = dataset.element_spec
    preprocessor = getattr(model, "preprocessor", None)
    if preprocessor is not None:
        sample = next(iter(dataset.take(1)))[0]
        features = tf.nest.map_structure(tf.TensorSpec.from_tensor, preprocessor(sample))
    return tf.nest.map_structure(
        lambda s: tf.TensorSpec((rows, *s.shape[1:]), s.dtype), (features, labels)
    )


def child(job: str, trainer: str, steps: int) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import epl_trainer as epl

    config_file, batch = JOBS[job]
    profiler = {"profiler.flops": True, "profiler.profile_step": -1}
    if trainer == "epl":
        config = epl.Config.from_file(os.path.join(ROOT, "configs", config_file), profiler)
        epl.init(config)  # the devices, before TensorFlow starts
    import keras
    import numpy as np
    import tensorflow as tf

    from epl_trainer.core.graph.flops_profile import train_step_flops
    from epl_trainer.core.graph.peak import matmul_peak
    from epl_trainer.training.monitors import FlopsProfiler

    keras.utils.set_random_seed(0)
    model, x, y, loss, optimizer = BUILDERS[job](epl, keras, np, trainer == "epl", batch)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch, drop_remainder=True)
    if loss is not None:  # the same compiled loss for EPLTrainer (no loss=) and Keras
        model.compile(optimizer=optimizer, loss=loss)

    def count_step(rows):
        return train_step_flops(model, *_step_specs(model, dataset, rows))

    if trainer == "epl":
        history = epl.EPLTrainer(model).fit(dataset, epochs=2, steps_per_epoch=steps, verbose=0)
    else:
        callback = FlopsProfiler(count_step, matmul_peak(), batch_size=batch, profile_step=-1)
        history = model.fit(
            dataset, epochs=2, steps_per_epoch=steps, verbose=0, callbacks=[callback], shuffle=False
        )
    flops = count_step(batch).flops
    tflops, mfu = history.history["tflops"][-1], history.history["mfu"][-1]
    return {
        "job": job,
        "trainer": trainer,
        "batch": batch,
        "config": config_file if trainer == "epl" else "1 device",
        "gflop_per_step": flops / 1e9,
        "ms_per_step": flops / (tflops * 1e12) * 1e3,
        "tflops": tflops,
        "mfu": mfu,
        "peak": matmul_peak().describe(),
    }


# ---------------------------------------------------------------- the table
def table(rows: list[dict]) -> str:
    by_job: dict[str, dict] = {}
    for row in rows:
        by_job.setdefault(row["job"], {})[row["trainer"]] = row
    lines = [
        "| job | global batch | model GFLOP/step | Keras ms/step | Keras TFLOP/s | Keras MFU "
        "| EPL layout | EPL ms/step | EPL TFLOP/s | EPL MFU | EPL / Keras |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for job, pair in by_job.items():
        keras_row, epl_row = pair["keras"], pair["epl"]
        lines.append(
            f"| {job} | {keras_row['batch']} | {keras_row['gflop_per_step']:.3g} "
            f"| {keras_row['ms_per_step']:.1f} | {keras_row['tflops']:.4f} "
            f"| {keras_row['mfu']:.1%} | {epl_row['config']} | {epl_row['ms_per_step']:.1f} "
            f"| {epl_row['tflops']:.4f} | {epl_row['mfu']:.1%} "
            f"| {epl_row['mfu'] / keras_row['mfu']:.2f} |"
        )
    peak = rows[0]["peak"] if rows else ""
    lines.append("")
    lines.append(f"Peak: {peak}. MFU = model FLOPs per second / peak.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per epoch (2 epochs)")
    parser.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    parser.add_argument("--markdown", help="also write the table to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        job, trainer, steps = json.loads(args.child)
        print(json.dumps(child(job, trainer, steps)))
        return
    rows = []
    for job in args.jobs:
        for trainer in ("keras", "epl"):
            row = run_child(__file__, [job, trainer, args.steps])
            print(
                f"{job:<11} {trainer:<5} {row['ms_per_step']:8.1f} ms/step  "
                f"{row['tflops']:.4f} TFLOP/s  MFU {row['mfu']:.1%}",
                flush=True,
            )
            rows.append(row)
    text = table(rows)
    print("\n" + text)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
