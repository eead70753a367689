"""One text-classifier run: a KerasHub `BertTextClassifier` with its preprocessor, compiled
by KerasHub's defaults (sparse crossentropy, accuracy) with Adam at the given rate, and
trained on raw strings by `EPLTrainer(task).fit(texts, labels)`, or by Keras's own
`task.fit` for comparison (`trainer="keras"`)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import keras
import numpy as np

import epl_trainer as epl
from model_zoo.text_classifier import data as data_lib

TRAINERS = ("epl", "keras")


@dataclasses.dataclass
class Options:
    """One run; the absl flags of `__main__.py` map onto these fields."""

    config: epl.Config
    train_file: str | None = None  # GLUE-style TSV; None: built-in data
    dev_file: str | None = None
    vocab_file: str | None = None  # BERT vocab.txt; None: built from the training text
    num_classes: int | None = None  # None: the largest label + 1
    sequence_length: int = 32
    num_layers: int = 2
    hidden_dim: int = 64
    num_heads: int = 4
    intermediate_dim: int = 128
    dropout: float = 0.1
    batch_size: int = 32
    epochs: int = 3
    learning_rate: float = 1e-3
    builtin_train_samples: int = 2048
    builtin_dev_samples: int = 256
    seed: int = 0
    trainer: str = "epl"
    output_dir: str | None = None  # vocab.txt, TensorBoard logs, metrics.json (chief only)
    verbose: int = 2


def load_data(options: Options):
    """((train texts, labels), (dev texts, labels)): the TSV files, or the built-in set."""
    if (options.train_file is None) != (options.dev_file is None):
        raise ValueError(
            "Give both --train_file and --dev_file, or neither (built-in data). Received: "
            f"train_file={options.train_file!r}, dev_file={options.dev_file!r}"
        )
    if options.train_file is not None:
        return data_lib.read_tsv(options.train_file), data_lib.read_tsv(options.dev_file)
    train = data_lib.builtin_split(options.builtin_train_samples, seed=options.seed + 1)
    dev = data_lib.builtin_split(options.builtin_dev_samples, seed=options.seed + 2)
    return train, dev


def num_classes(options: Options, train_labels, dev_labels) -> int:
    largest = int(max(np.max(train_labels), np.max(dev_labels)))
    if options.num_classes is None:
        return largest + 1
    if largest >= options.num_classes:
        raise ValueError(
            f"A label is {largest}, but num_classes={options.num_classes} allows labels "
            f"0..{options.num_classes - 1}."
        )
    return options.num_classes


def build_task(options: Options, vocabulary: str, classes: int) -> keras.Model:
    """The KerasHub task: BertBackbone + classifier head, with its preprocessor."""
    try:
        import keras_hub
    except ImportError as error:
        raise ImportError(
            "model_zoo.text_classifier trains a KerasHub task: pip install keras-hub "
            '(or pip install -e ".[hub]")'
        ) from error
    keras.utils.set_random_seed(options.seed)
    tokenizer = keras_hub.models.BertTokenizer(vocabulary=vocabulary, lowercase=True)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=tokenizer.vocabulary_size(),
        num_layers=options.num_layers,
        num_heads=options.num_heads,
        hidden_dim=options.hidden_dim,
        intermediate_dim=options.intermediate_dim,
        max_sequence_length=options.sequence_length,
        dropout=options.dropout,
    )
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(
        tokenizer, sequence_length=options.sequence_length
    )
    task = keras_hub.models.BertTextClassifier(
        backbone, num_classes=classes, preprocessor=preprocessor, dropout=options.dropout
    )
    # KerasHub's defaults (its loss and metrics), with a learning rate for training from
    # scratch instead of its fine-tuning default (Adam 5e-5).
    task.compile(optimizer=keras.optimizers.Adam(options.learning_rate))
    return task


def train(options: Options) -> dict:
    """Trains and evaluates; returns (and on the chief writes) the run's metrics."""
    if options.trainer not in TRAINERS:
        raise ValueError(f"trainer must be one of {TRAINERS}. Received: {options.trainer!r}")
    start = time.perf_counter()
    cluster = epl.init(options.config).cluster  # configures the devices: before any TF work
    (train_texts, train_labels), (dev_texts, dev_labels) = load_data(options)
    classes = num_classes(options, train_labels, dev_labels)
    output_dir = Path(options.output_dir) if options.output_dir else None
    vocabulary = options.vocab_file
    if vocabulary is None:
        folder = output_dir or Path.cwd()
        vocabulary = data_lib.build_vocabulary(train_texts, folder / "vocab.txt")
    task = build_task(options, vocabulary, classes)
    runner = task if options.trainer == "keras" else epl.EPLTrainer(task)
    plan = None if options.trainer == "keras" else runner.plan
    if plan is not None:
        print(plan.summary())
    callbacks = []
    if output_dir is not None and cluster.is_chief:
        callbacks.append(keras.callbacks.TensorBoard(str(output_dir / "logs")))
    initial = runner.evaluate(
        dev_texts, dev_labels, batch_size=options.batch_size, verbose=0, return_dict=True
    )
    history = runner.fit(
        train_texts,
        train_labels,
        batch_size=options.batch_size,
        epochs=options.epochs,
        validation_data=(dev_texts, dev_labels),
        callbacks=callbacks,
        verbose=options.verbose,
    )
    final = runner.evaluate(
        dev_texts, dev_labels, batch_size=options.batch_size, verbose=0, return_dict=True
    )
    metrics = {
        "trainer": options.trainer,
        "initial_dev": _floats(initial),
        "dev": _floats(final),
        "majority_accuracy": data_lib.majority_accuracy(train_labels, dev_labels),
        "num_classes": classes,
        "train_samples": len(train_texts),
        "dev_samples": len(dev_texts),
        "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
        "wall_time_sec": time.perf_counter() - start,
        "plan": None if plan is None else plan.to_dict(),
        "config": options.config.to_dict(),
    }
    if output_dir is not None and cluster.is_chief:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def _floats(logs: dict) -> dict:
    return {key: float(value) for key, value in logs.items()}
