"""BERT fine-tuned for SQuAD v1.1 with an EPL pipeline: `python -m model_zoo.bert_squad`.

By default it generates the built-in dataset (invented towns, see `builtin_data.py`),
trains a tiny BERT from scratch as a 2-stage pipeline with 4 micro-batches on 2
simulated devices (`configs/bert_squad_pipeline.json`; data-parallel where oneDNN is off,
`recipe.default_num_stages`), writes `predictions.json` and
prints SQuAD v1.1 exact match / F1 next to two trivial baselines. With real inputs it
is Google's `run_squad.py` recipe::

    python -m model_zoo.bert_squad --train_file train-v1.1.json --predict_file dev-v1.1.json \\
        --vocab_file uncased_L-12_H-768_A-12/vocab.txt \\
        --bert_config_file uncased_L-12_H-768_A-12/bert_config.json \\
        --init_checkpoint uncased_L-12_H-768_A-12/bert_model.ckpt \\
        --max_seq_length 384 --doc_stride 128 --learning_rate 3e-5 --num_train_epochs 2

`--epl_config configs/bert_squad_auto.json` cuts the model automatically instead of by
the `epl.replicate` scopes that `--num_stages` places. Worker 0 writes TensorBoard logs
to `<output_dir>/logs`, `predictions.json` and `metrics.json`.
"""

import json
import os
import random
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
import tensorflow as tf
from absl import app, flags

import epl_trainer.runtime.flags as epl_flags  # defines --epl_config and --epl_set
from epl_trainer.core.graph.peak import onednn_enabled
from epl_trainer.runtime.cluster import is_single_worker_job
from model_zoo.bert_squad import builtin_data, evaluation, squad
from model_zoo.bert_squad.checkpoint import load_google_checkpoint
from model_zoo.bert_squad.modeling import PRESETS, BertConfig, build_squad_model
from model_zoo.bert_squad.recipe import (
    bert_optimizer,
    default_num_stages,
    environ_with_defaults,
)
from model_zoo.bert_squad.tokenization import FullTokenizer

FLAGS = flags.FLAGS
flags.DEFINE_string("train_file", None, "SQuAD v1.1 training JSON; default: built-in data.")
flags.DEFINE_string("predict_file", None, "SQuAD v1.1 JSON to predict and score.")
flags.DEFINE_string("vocab_file", None, "WordPiece vocab.txt (required with real data).")
flags.DEFINE_bool("do_lower_case", True, "Lower-case text (True for uncased checkpoints).")
flags.DEFINE_enum("bert_size", "tiny", sorted(PRESETS), "Model size when no config file.")
flags.DEFINE_string("bert_config_file", None, "Google bert_config.json; overrides --bert_size.")
flags.DEFINE_string("init_checkpoint", None, "Google BERT TF checkpoint (bert_model.ckpt).")
flags.DEFINE_integer("max_seq_length", 80, "Tokens per window: [CLS] question [SEP] context.")
flags.DEFINE_integer("doc_stride", 32, "Tokens between the starts of a context's windows.")
flags.DEFINE_integer("max_query_length", 24, "Questions are truncated to this many tokens.")
flags.DEFINE_integer("train_batch_size", 32, "Per-worker batch (replicas x micro-batches).")
flags.DEFINE_integer("predict_batch_size", 64, "Batch size for prediction.")
flags.DEFINE_float("learning_rate", 3e-3, "Peak AdamW learning rate.")
flags.DEFINE_float("weight_decay", 0.01, "AdamW weight decay (not on LayerNorm and biases).")
flags.DEFINE_float("warmup_proportion", 0.1, "Fraction of the steps with linear LR warmup.")
# 2 epochs of 12,000 paragraphs' 48,000 windows: 3,000 steps. With the tiny preset's
# initializer (modeling.py) and BERT's AdamW + linear decay, plain Keras reached dev F1
# 99.9 / 100.0 / 99.7 (seeds 0 / 1 / 2). 1,500 paragraphs x 16 epochs (the same steps)
# gave 99.8 / 94.8 in plain Keras and 99.7 / 78.2 through the engine (seeds 0 / 1): seen
# 16 times, a paragraph is partly memorised, and the time the model takes to learn to
# find the fact by position varies more from seed to seed.
flags.DEFINE_integer("num_train_epochs", 2, "Passes over the training windows.")
flags.DEFINE_integer("n_best_size", 20, "Start/end candidates per window.")
flags.DEFINE_integer("max_answer_length", 30, "Longest answer, in WordPiece tokens.")
flags.DEFINE_integer(
    "num_stages",
    None,
    "Pipeline stages marked by epl.replicate scopes (1: no pipeline, data parallelism "
    "without micro-batches); ignored when auto.auto_parallel cuts the model. Default: 2 "
    "where TensorFlow runs oneDNN's kernels or --epl_config is given, else 1 in one process "
    "(recipe.py measured it).",
)
flags.DEFINE_integer("builtin_train_paragraphs", 12000, "Built-in data: training paragraphs.")
flags.DEFINE_integer("builtin_dev_paragraphs", 100, "Built-in data: dev paragraphs.")
flags.DEFINE_string("output_dir", "/tmp/epl_bert_squad", "Logs, predictions and metrics.")
flags.DEFINE_integer("seed", 0, "Seed of the built-in data, the shuffling and the weights.")
# 16 steps per call: the tiny model's step is short, so host round trips show.
# XLA by default for Keras (its whole step is one computation); EPLTrainer's "auto" keeps
# the pipeline's stages as plain ops, one thread per op on each of its two simulated
# devices (cluster.py), side by side: XLA stages took 25.8 ms per step against 12.5
# (python bench/threads.py).
flags.DEFINE_bool(
    "jit_compile",
    None,
    "XLA: Keras compiles its whole step, EPLTrainer each stage's forward and backward "
    "(one device: the whole step; data parallelism: each lane). Default: on for "
    "--trainer=keras, EPLTrainer's 'auto' (core/engine/jit_choice.py).",
)
flags.DEFINE_integer("steps_per_execution", 16, "Training steps per call of the compiled step.")
flags.DEFINE_enum(
    "trainer",
    "epl",
    ["epl", "keras"],
    "epl: EPLTrainer with the EPL config (default: a 2-stage pipeline); keras: the same "
    "model, data and steps with plain Keras `fit` on one device, for comparison.",
)


def input_files(output_dir: Path) -> dict:
    """The train / predict / vocab paths: the flags', or freshly generated built-in data."""
    given = {"train": FLAGS.train_file, "dev": FLAGS.predict_file, "vocab": FLAGS.vocab_file}
    if not any(given.values()):
        return builtin_data.write_builtin_data(
            output_dir / "data",
            FLAGS.builtin_train_paragraphs,
            FLAGS.builtin_dev_paragraphs,
            FLAGS.seed,
        )
    if not given["vocab"] or not (given["train"] or given["dev"]):
        raise app.UsageError(
            "Real data needs --vocab_file and at least one of --train_file / --predict_file. "
            f"Received: {given}"
        )
    return given


def bert_config(vocab_size: int) -> BertConfig:
    if FLAGS.bert_config_file:
        config = BertConfig.from_json_file(FLAGS.bert_config_file)
        if config.vocab_size != vocab_size:
            raise app.UsageError(
                f"{FLAGS.bert_config_file} has vocab_size {config.vocab_size} but "
                f"{FLAGS.vocab_file} has {vocab_size} tokens."
            )
        return config
    return BertConfig.preset(FLAGS.bert_size, vocab_size)


def featurize(path, tokenizer, is_training):
    examples = squad.read_squad_examples(path, is_training)
    features = squad.convert_examples_to_features(
        examples,
        tokenizer,
        FLAGS.max_seq_length,
        FLAGS.doc_stride,
        FLAGS.max_query_length,
        is_training,
    )
    return examples, features


def training_dataset(features, cluster, seed):
    """Shuffled per-worker batches, repeated; every worker gets the same step count."""
    x, y = squad.features_to_arrays(features, with_labels=True)
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    dataset = dataset.shard(cluster.worker_num, cluster.worker_index)
    dataset = dataset.shuffle(len(features), seed=seed, reshuffle_each_iteration=True)
    dataset = dataset.repeat().batch(FLAGS.train_batch_size, drop_remainder=True)
    steps_per_epoch = len(features) // (FLAGS.train_batch_size * cluster.worker_num)
    if steps_per_epoch < 1:
        raise app.UsageError(
            f"{len(features)} training windows do not fill one global batch of "
            f"{FLAGS.train_batch_size} x {cluster.worker_num} worker(s)."
        )
    return dataset.prefetch(tf.data.AUTOTUNE), steps_per_epoch


class SquadEvaluator(keras.callbacks.Callback):
    """Predicts the dev set and adds `dev_exact_match` / `dev_f1` to each epoch's logs
    (placed before TensorBoard in the callback list, so they are logged there too).

    `predict(x, batch_size)` gives the model's outputs (EPLTrainer's or Keras's)."""

    def __init__(self, predict, dataset, examples, features):
        super().__init__()
        self.predict, self.dataset = predict, dataset
        self.examples, self.features = examples, features
        self.x, _ = squad.features_to_arrays(features, with_labels=False)
        self.predictions: dict[str, str] = {}
        self.scores: dict[str, float] | None = None  # of the last evaluate()
        self.seconds = 0.0  # spent predicting and scoring, for the report's breakdown

    def evaluate(self) -> dict:
        start = time.perf_counter()
        outputs = self.predict(self.x, FLAGS.predict_batch_size)
        self.predictions = evaluation.extract_predictions(
            self.examples,
            self.features,
            outputs["start_logits"],
            outputs["end_logits"],
            FLAGS.n_best_size,
            FLAGS.max_answer_length,
            FLAGS.do_lower_case,
        )
        self.scores = evaluation.squad_v1_scores(self.dataset, self.predictions)
        self.seconds += time.perf_counter() - start
        return self.scores

    def on_epoch_end(self, epoch, logs=None):
        scores = self.evaluate()
        if logs is not None:
            logs.update({f"dev_{k}": v for k, v in scores.items()})
        print(f"epoch {epoch + 1}: dev EM {scores['exact_match']:.1f}, F1 {scores['f1']:.1f}")


def baselines(dataset: dict, examples, seed: int) -> dict:
    """EM/F1 of trivial answerers: the first context word, and a random 1-3 word span."""
    rng = random.Random(seed)
    first = {e.qas_id: e.doc_tokens[0] for e in examples}
    spans = {}
    for e in examples:
        start = rng.randrange(len(e.doc_tokens))
        spans[e.qas_id] = " ".join(e.doc_tokens[start : start + rng.randint(1, 3)])
    return {
        "first_context_word": evaluation.squad_v1_scores(dataset, first),
        "random_span": evaluation.squad_v1_scores(dataset, spans),
    }


def optimizer(model, total_steps: int):
    return bert_optimizer(
        model, total_steps, FLAGS.learning_rate, FLAGS.weight_decay, FLAGS.warmup_proportion
    )


def build_model(config, bert, num_stages):
    keras.utils.set_random_seed(FLAGS.seed)
    # With auto.auto_parallel the trainer cuts the model itself and refuses scopes.
    stages = 1 if config.auto.auto_parallel else num_stages
    model = build_squad_model(bert, FLAGS.max_seq_length, num_stages=stages)
    if FLAGS.init_checkpoint:
        loaded = load_google_checkpoint(model, FLAGS.init_checkpoint)
        print(f"Loaded {len(loaded)} variables from {FLAGS.init_checkpoint}")
    return model


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    start_time = time.perf_counter()
    num_stages, why = FLAGS.num_stages, "--num_stages"
    if num_stages is None:
        num_stages, why = default_num_stages(
            onednn_enabled(), is_single_worker_job(), recipe_given=bool(FLAGS.epl_config)
        )
    environ = environ_with_defaults(FLAGS.epl_config, num_stages=num_stages)
    config = epl_flags.config_from_flags(environ=environ)
    if FLAGS.trainer == "keras":
        # Keras trains on one device, with all the cores (the pipeline's two simulated
        # devices would give each op half of them, cluster.py).
        config = config.replace({"cluster.virtual_devices": 1})
    cluster = epl.init(config).cluster  # configures the devices: before any TF work
    if FLAGS.trainer == "keras" and cluster.worker_num > 1:
        raise app.UsageError(
            f"--trainer=keras trains on one device in one process. Received: "
            f"{cluster.worker_num} workers; run it without epl-launch."
        )
    output_dir = Path(FLAGS.output_dir)
    paths = input_files(output_dir)
    tokenizer = FullTokenizer(paths["vocab"], do_lower_case=FLAGS.do_lower_case)
    bert = bert_config(len(tokenizer.vocab))
    train = None
    if paths.get("train"):
        _, train_features = featurize(paths["train"], tokenizer, is_training=True)
        train = training_dataset(train_features, cluster, FLAGS.seed)
        print(f"Train: {len(train_features)} windows, {train[1]} steps per epoch")
    # The learning rate follows a schedule over the whole run, so it needs the step count.
    total_steps = train[1] * FLAGS.num_train_epochs if train else 1
    # The loss is the sum of the start and end cross-entropies; Google's run_squad.py
    # averages them. Adam's steps do not depend on that factor of 2, except through the
    # clipping at global norm 1.0 (over all stages, as Google's optimizer clips), which
    # therefore bites at half of Google's gradient norm.
    losses = {
        "start_logits": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "end_logits": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    }
    if FLAGS.trainer == "epl":
        model = build_model(config, bert, num_stages)
        print(f"Stages: {num_stages} ({why})")
        trainer = epl.EPLTrainer(
            model,
            loss=losses,
            optimizer=optimizer(model, total_steps),
            jit_compile=FLAGS.jit_compile,  # None: "auto"
            steps_per_execution=FLAGS.steps_per_execution,
        )
        print(f"{config}\n{trainer.plan.summary()}")

        def predict(x, batch_size):
            return trainer.predict(x, batch_size=batch_size)
    else:  # the comparison: the same model, data and steps without the engine
        model = trainer = build_model(config, bert, num_stages=1)
        model.compile(
            optimizer=optimizer(model, total_steps),
            loss=losses,
            jit_compile=FLAGS.jit_compile is not False,  # None: on
            steps_per_execution=FLAGS.steps_per_execution,
        )
        print("Plain Keras fit on one device (no EPL engine), for comparison.")

        def predict(x, batch_size):
            return model.predict(x, batch_size=batch_size, verbose=0)

    evaluator = None
    if paths.get("dev"):
        dev_dataset = squad.read_squad_json(paths["dev"])
        dev_examples, dev_features = featurize(paths["dev"], tokenizer, is_training=False)
        evaluator = SquadEvaluator(predict, dev_dataset, dev_examples, dev_features)
        print(f"Predict: {len(dev_examples)} questions, {len(dev_features)} windows")

    seconds = {"data": time.perf_counter() - start_time}
    history = None
    if train:
        callbacks = [evaluator] if evaluator else []
        if cluster.is_chief:
            callbacks.append(keras.callbacks.TensorBoard(str(output_dir / "logs")))
        history = trainer.fit(
            train[0],
            epochs=FLAGS.num_train_epochs,
            steps_per_epoch=train[1],
            callbacks=callbacks,
            verbose=2,
        )
        seconds["training"] = time.perf_counter() - start_time - seconds["data"]

    results = {}
    if evaluator:
        # After training, the last epoch's scores are the trained model's (fit changes no
        # weight after its last on_epoch_end): predicting the dev set again repeated them.
        results = {
            "dev": evaluator.scores or evaluator.evaluate(),
            "baselines": baselines(evaluator.dataset, evaluator.examples, FLAGS.seed),
        }
    wall_time = time.perf_counter() - start_time
    if evaluator and "training" in seconds:  # the per-epoch dev predictions ran inside fit
        seconds["training"] -= evaluator.seconds
    seconds["evaluation"] = evaluator.seconds if evaluator else 0.0
    report(results, wall_time, seconds, total_steps if train else 0)
    if cluster.is_chief:
        # The stage count the run used (the num_stages flag records only what was given).
        stages = {"count": num_stages, "why": why} if FLAGS.trainer == "epl" else None
        write_outputs(
            output_dir, trainer, config, history, results, evaluator, wall_time, seconds, stages
        )


# EPL's published BERT recipe (BERT-base, 2-stage pipeline, SQuAD v1.1 dev).
PUBLISHED = {"exact_match": 79.8, "f1": 88.0}


def report(results: dict, wall_time: float, seconds: dict, steps: int) -> None:
    if results:
        dev, base = results["dev"], results["baselines"]
        print(
            f"SQuAD v1.1 dev: exact match {dev['exact_match']:.1f}, F1 {dev['f1']:.1f} "
            f"(baselines: first context word EM {base['first_context_word']['exact_match']:.1f} "
            f"F1 {base['first_context_word']['f1']:.1f}; random span "
            f"EM {base['random_span']['exact_match']:.1f} F1 {base['random_span']['f1']:.1f})"
        )
        print(
            f"EPL's published BERT recipe: EM {PUBLISHED['exact_match']:.1f}, F1 "
            f"{PUBLISHED['f1']:.1f}. It differs from this run in " + _what_differs()
        )
    breakdown = f"data {seconds['data']:.1f} s"
    if steps:
        per_step = 1e3 * seconds["training"] / steps
        breakdown += f", training {seconds['training']:.1f} s ({per_step:.1f} ms/step with tracing)"
    breakdown += f", dev predictions {seconds['evaluation']:.1f} s"
    print(f"Wall time {wall_time:.1f} s: {breakdown}")


def _what_differs() -> str:
    """One line: what separates this run from the published BERT-base / SQuAD v1.1 one."""
    model = f"BERT-{FLAGS.bert_size}" if not FLAGS.bert_config_file else FLAGS.bert_config_file
    pretrained = "pre-trained" if FLAGS.init_checkpoint else "trained from scratch"
    data = "the real SQuAD v1.1" if FLAGS.train_file else "the built-in generated data"
    return (
        f"model ({model}, {pretrained}, vs pre-trained BERT-base) and data ({data}, vs "
        "SQuAD v1.1's 88k questions)."
    )


def write_outputs(
    output_dir, trainer, config, history, results, evaluator, wall_time, seconds, stages
):
    """predictions.json ({question id: answer}, the official script's input), metrics.json."""
    output_dir.mkdir(parents=True, exist_ok=True)
    if evaluator:
        path = output_dir / "predictions.json"
        path.write_text(json.dumps(evaluator.predictions, indent=1) + "\n")
        print(f"Wrote {path}")
    metrics = {
        **results,
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()}
        if history
        else {},
        "wall_time_sec": wall_time,
        "seconds": seconds,  # data, training (without the dev predictions), evaluation
        "flags": {name: FLAGS[name].value for name in FLAGS_TO_RECORD},
        "trainer": FLAGS.trainer,
        "stages": stages,
        "plan": trainer.plan.to_dict() if FLAGS.trainer == "epl" else None,
        "config": config.to_dict(),
    }
    path = output_dir / "metrics.json"
    path.write_text(json.dumps(metrics, indent=2, default=str) + "\n")
    print(f"Wrote {path} and TensorBoard logs in {output_dir / 'logs'}")


FLAGS_TO_RECORD = (
    "train_file",
    "predict_file",
    "vocab_file",
    "bert_size",
    "bert_config_file",
    "init_checkpoint",
    "max_seq_length",
    "doc_stride",
    "max_query_length",
    "train_batch_size",
    "learning_rate",
    "num_train_epochs",
    "num_stages",
    "seed",
    "weight_decay",
    "warmup_proportion",
)


if __name__ == "__main__":
    app.run(main)
