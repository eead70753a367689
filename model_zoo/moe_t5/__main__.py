"""MoE-T5: train a T5-style encoder-decoder with expert-parallel MoE feed-forward blocks.

By default the recipe `configs/moe_t5_split.json` sets 2 simulated devices with the
MoE experts split across them (colocated with the replicated rest of the model), and
the data is a generated task: reverse a sequence of 3-10 symbols and map each symbol to
its upper-case image ("c a f" -> "F A C"). Token accuracy starts near chance and rises
within a few minutes on a 2-core CPU.

Run from the repo root::

    python -m model_zoo.moe_t5 [--epochs 4] [--steps_per_epoch 100] [--batch_size 64]
        [--nosmall] [--epl_config configs/moe_t5_split.json] [--epl_set KEY=VALUE]
        [--train_files GLOB --eval_files GLOB --vocab_file PATH [--data_format tsv]]

Real data: TSV files of `source<TAB>target` lines, or TFRecord files of tf.train.Example
with bytes features `source` and `target`, tokenised by whitespace against a vocabulary
file (one token per line). Training files are read by `EPLTrainer.fit(files,
parse_fn=...)`, so `io.slicing` shares them out across workers. Worker 0 writes
TensorBoard logs to `<output_dir>/logs` and the final numbers to
`<output_dir>/metrics.json`.
"""

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

if not __package__:
    # Run as a file (epl-launch does this), not with -m: make the checkout importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ info banners

# Before Keras loads TensorFlow: unless the user chose, importing epl_trainer turns on
# oneDNN's CPU kernels (runtime/onednn.py), and TensorFlow reads that once, at import.
import epl_trainer as epl  # isort: split

import keras
import numpy as np
import tensorflow as tf
from absl import app, flags

import epl_trainer.runtime.flags as epl_flags  # defines --epl_config and --epl_set
from epl_trainer.training import data as data_lib
from model_zoo.moe_t5 import data
from model_zoo.moe_t5 import model as moe_t5

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "moe_t5_split.json"

FLAGS = flags.FLAGS
FLAGS.set_default("epl_config", str(RECIPE))
flags.DEFINE_bool(
    "small",
    True,
    "Model sizes for a CPU (d_model 64, 4 heads, 2+2 layers, expert hidden 128, no "
    "dropout); --nosmall uses T5-small's (512, 8, 6+6, 2048, dropout 0.1). The size "
    "flags below override either.",
)
flags.DEFINE_integer("d_model", None, "Model width (default from --small).")
flags.DEFINE_integer("num_heads", None, "Attention heads (default from --small).")
flags.DEFINE_integer("num_layers", None, "Encoder layers = decoder layers (default from --small).")
flags.DEFINE_integer("expert_hidden", None, "Hidden width of each expert (default from --small).")
flags.DEFINE_float("dropout", None, "Dropout rate (default from --small).")
flags.DEFINE_integer("num_experts", 8, "Experts per MoE layer.")
flags.DEFINE_integer("top_k", 2, "Experts per token: 2 (GShard) or 1 (Switch).")
flags.DEFINE_float("capacity_factor", 1.25, "Expert capacity factor while training.")
flags.DEFINE_float("eval_capacity_factor", 2.0, "Expert capacity factor in evaluation.")
flags.DEFINE_float("aux_loss_coef", 1e-2, "Weight of each MoE layer's load-balancing loss.")
flags.DEFINE_integer(
    "split_devices",
    None,
    "Devices each MoE layer's experts are split over (one model replica's width; the "
    "replicas are data parallel). Default: all devices of a worker.",
)
flags.DEFINE_integer("max_source_length", 12, "Source tokens per example, with </s>.")
flags.DEFINE_integer("max_target_length", 12, "Target tokens per example, with </s>.")
flags.DEFINE_string("train_files", None, "Glob of training files; unset: the generated task.")
flags.DEFINE_string("eval_files", None, "Glob of evaluation files (default: training files).")
flags.DEFINE_enum(
    "data_format", None, list(data.FORMATS), "File format; inferred from the names if unset."
)
flags.DEFINE_string("vocab_file", None, "Vocabulary, one token per line (needed with files).")
flags.DEFINE_string(
    "spm_model", None, "A SentencePiece model (T5's tokenisation) instead of --vocab_file."
)
flags.DEFINE_integer("shuffle_buffer", 10_000, "Training records shuffled in this window.")
flags.DEFINE_integer("epochs", 4, "Training epochs.")
flags.DEFINE_integer(
    "steps_per_epoch",
    None,
    "Training steps per epoch. Default: 100 on the generated task, one pass over files.",
)
flags.DEFINE_integer("batch_size", 64, "Per-worker batch (split over replicas x micro-batches).")
flags.DEFINE_float(
    "learning_rate",
    None,
    "Adam learning rate. Default: 2e-3 with --small, 1e-4 for T5-small's sizes (which "
    "diverge at 2e-3 without warm-up).",
)
flags.DEFINE_integer("num_eval_examples", 256, "Evaluation examples (and decoded ones).")
flags.DEFINE_integer("num_print_examples", 4, "Greedy decodings printed.")
flags.DEFINE_string("output_dir", "/tmp/epl_moe_t5", "TensorBoard logs and metrics.json.")
flags.DEFINE_integer("seed", 0, "Seed of the data and of the model's initial weights.")

GENERATED_STEPS_PER_EPOCH = 100


def model_config(vocab_size: int) -> moe_t5.T5Config:
    """The model's sizes: the --small / --nosmall preset, then the explicit flags."""
    sizes = dict(moe_t5.CPU_SMALL if FLAGS.small else moe_t5.T5_SMALL)
    for name in sizes:
        if getattr(FLAGS, name) is not None:
            sizes[name] = getattr(FLAGS, name)
    return moe_t5.T5Config(
        vocab_size=vocab_size,
        max_source_length=FLAGS.max_source_length,
        max_target_length=FLAGS.max_target_length,
        num_experts=FLAGS.num_experts,
        top_k=FLAGS.top_k,
        capacity_factor=FLAGS.capacity_factor,
        eval_capacity_factor=FLAGS.eval_capacity_factor,
        aux_loss_coef=FLAGS.aux_loss_coef,
        **sizes,
    )


def load_data(global_batch: int):
    """(vocab, train spec, (x_eval, y_eval), description).

    The train spec is the keyword arguments of `fit`'s data: numpy arrays for the
    generated task, or files with a parse_fn.
    """
    lengths = (FLAGS.max_source_length, FLAGS.max_target_length)
    if FLAGS.train_files is None:
        if FLAGS.eval_files or FLAGS.vocab_file or FLAGS.spm_model:
            raise app.UsageError("--eval_files, --vocab_file and --spm_model need --train_files.")
        vocab = data.task_vocabulary()
        steps = FLAGS.steps_per_epoch or GENERATED_STEPS_PER_EPOCH
        train_pairs = data.task_pairs(steps * global_batch, FLAGS.seed + 1)
        x, y = data.encode_pairs(train_pairs, vocab, *lengths)
        eval_pairs = data.task_pairs(FLAGS.num_eval_examples, FLAGS.seed + 2)
        train = {"x": x, "y": y, "steps_per_epoch": steps}
        return vocab, train, data.encode_pairs(eval_pairs, vocab, *lengths), "generated task"
    if (FLAGS.vocab_file is None) == (FLAGS.spm_model is None):
        raise app.UsageError(
            "--train_files needs one of --vocab_file (one token per line) or --spm_model "
            f"(SentencePiece). Received: --vocab_file={FLAGS.vocab_file} "
            f"--spm_model={FLAGS.spm_model}"
        )
    if FLAGS.spm_model:
        from model_zoo.moe_t5.spm import SentencePieceVocabulary

        vocab = SentencePieceVocabulary(FLAGS.spm_model)
    else:
        vocab = data.Vocabulary.from_file(FLAGS.vocab_file)
    train_files = _glob("--train_files", FLAGS.train_files)
    data_format = FLAGS.data_format or data.infer_format(train_files)
    eval_files = _glob("--eval_files", FLAGS.eval_files) if FLAGS.eval_files else train_files
    examples = data.read_files(eval_files, data_format, vocab, *lengths)
    batch = next(iter(examples.take(FLAGS.num_eval_examples).batch(FLAGS.num_eval_examples)), None)
    if batch is None:
        raise app.UsageError(f"The evaluation files hold no example: {eval_files}")
    evaluation = tf.nest.map_structure(np.asarray, batch)

    def records(files):
        return data.records(files, data_format).shuffle(FLAGS.shuffle_buffer, seed=FLAGS.seed)

    train = {
        "x": train_files,
        "parse_fn": data.parse_fn_for(data_format, vocab, *lengths),
        "file_format": records,
        "steps_per_epoch": FLAGS.steps_per_epoch,
    }
    source = "eval files" if FLAGS.eval_files else "training files"
    return vocab, train, evaluation, f"{data_format} files (evaluation: first examples of {source})"


def _glob(flag: str, pattern: str) -> list[str]:
    files = sorted(tf.io.gfile.glob(pattern))
    if not files:
        raise app.UsageError(f"{flag} matches no file. Received: {pattern!r}")
    return files


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    start = time.perf_counter()
    config = epl_flags.config_from_flags()
    cluster = epl.init(config).cluster  # configures the devices: before any TF work
    print(config)
    global_batch = FLAGS.batch_size * cluster.worker_num
    vocab, train, (x_eval, y_eval), description = load_data(global_batch)
    settings = model_config(len(vocab))
    print(f"Data: {description}; vocabulary of {len(vocab)} tokens.\nModel: {settings}")

    # One replica per worker at most (the engine keeps a replica inside one worker).
    split_devices = FLAGS.split_devices or len(cluster.local_devices)
    model = moe_t5.build_model(settings, seed=FLAGS.seed, split_devices=split_devices)
    trainer = epl.EPLTrainer(
        model,
        loss=moe_t5.SequenceCrossEntropy(),
        optimizer=keras.optimizers.Adam(FLAGS.learning_rate or (2e-3 if FLAGS.small else 1e-4)),
        metrics=[moe_t5.TokenAccuracy()],
    )
    print(trainer.plan.summary())
    print(f"{model.count_params():,} parameters; {len(moe_t5.moe_layers(model))} MoE layers.")

    probe = {k: v[: FLAGS.batch_size] for k, v in x_eval.items()}  # router statistics batch
    # This worker's evaluation batches. Arrays are dealt to the workers in whole rounds
    # of batches (every worker runs as many steps); a batch size that fills the rounds
    # evaluates every example.
    rounds = -(-len(y_eval) // (cluster.worker_num * FLAGS.batch_size))
    evaluation = data_lib.as_dataset(
        x_eval,
        y_eval,
        -(-len(y_eval) // (cluster.worker_num * rounds)),
        worker_index=cluster.worker_index,
        worker_num=cluster.worker_num,
    )
    initial = {
        **trainer.evaluate(evaluation, return_dict=True),
        **moe_t5.router_statistics(model, probe),
    }
    print("Before training: " + _format(initial))

    output_dir = Path(FLAGS.output_dir)
    callbacks = [moe_t5.RouterStatisticsLogger(probe)]
    if cluster.is_chief:
        callbacks.append(keras.callbacks.TensorBoard(str(output_dir / "logs")))
    train_start = time.perf_counter()
    history = trainer.fit(
        batch_size=FLAGS.batch_size,
        epochs=FLAGS.epochs,
        validation_data=evaluation,
        callbacks=callbacks,
        verbose=2,
        **train,
    )
    train_time = time.perf_counter() - train_start
    final = {
        **trainer.evaluate(evaluation, return_dict=True),
        **moe_t5.router_statistics(model, probe),
    }
    print("After training:  " + _format(final))

    decoded = moe_t5.greedy_decode(
        lambda x: trainer.predict(x, batch_size=FLAGS.batch_size),
        x_eval["encoder_tokens"],
        settings.max_target_length,
    )
    references = [vocab.decode(ids) for ids in y_eval]
    predictions = [vocab.decode(ids) for ids in decoded]
    exact = float(np.mean([p == r for p, r in zip(predictions, references)]))
    print(f"Greedy decoding: {exact:.1%} of {len(references)} evaluation targets exactly right")
    for source, reference, prediction in list(
        zip(x_eval["encoder_tokens"], references, predictions)
    )[: FLAGS.num_print_examples]:
        print(f"  {vocab.decode(source)!r} -> {prediction!r} (reference {reference!r})")

    wall_time = time.perf_counter() - start
    print(
        f"Token accuracy {initial['token_accuracy']:.4f} -> {final['token_accuracy']:.4f}; "
        f"aux loss {initial['aux_loss']:.4f} -> {final['aux_loss']:.4f}; "
        f"training {train_time:.1f} s, wall time {wall_time:.1f} s"
    )
    if cluster.is_chief:
        metrics = {
            "data": description,
            "initial": initial,
            "final": final,
            "greedy_exact_match": exact,
            "examples": [
                {"source": vocab.decode(s), "prediction": p, "reference": r}
                for s, p, r in zip(x_eval["encoder_tokens"], predictions, references)
            ][: FLAGS.num_print_examples],
            "history": {k: [float(v) for v in vals] for k, vals in history.history.items()},
            "model": dataclasses.asdict(settings),
            "global_batch": global_batch,
            "num_workers": cluster.worker_num,
            "devices_per_worker": len(cluster.local_devices),
            "train_time_sec": train_time,
            "wall_time_sec": wall_time,
            "plan": trainer.plan.to_dict(),
            "config": config.to_dict(),
        }
        output_dir.mkdir(parents=True, exist_ok=True)
        path = output_dir / "metrics.json"
        path.write_text(json.dumps(metrics, indent=2) + "\n")
        print(f"Wrote {path} and TensorBoard logs in {output_dir / 'logs'}")


def _format(logs: dict) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in logs.items())


if __name__ == "__main__":
    app.run(main)
