"""A KerasHub `BertTextClassifier` trained on raw strings with `EPLTrainer`.

Its preprocessor tokenises the strings inside `fit`, as in Keras: the script hands the
trainer text and labels and nothing else. Run from the repo root::

    python -m model_zoo.text_classifier                     # built-in topics, 2 devices
    python -m model_zoo.text_classifier --trainer=keras     # the same run in plain Keras
    python -m model_zoo.text_classifier --train_file glue/SST-2/train.tsv \\
        --dev_file glue/SST-2/dev.tsv --vocab_file uncased_L-12_H-768_A-12/vocab.txt
    epl-launch --num_workers 2 --gpu_per_worker 1 model_zoo/text_classifier/__main__.py

The built-in data (`data.py`) are sentences about one of 3 topics (weather, sports, food)
with filler words and sometimes a word of another topic. Files are GLUE-style TSV with a
header row (`sentence<TAB>label`). Without `--vocab_file` the vocabulary is built from the
training text. The default recipe, `configs/text_classifier_zero1.json`, trains data
parallel with ZeRO v1 (Adam's moments sharded over the replicas); `--epl_config
configs/dp.json` replaces it. `cluster.virtual_devices` defaults to 2 unless
`EPL_CLUSTER_VIRTUAL_DEVICES` (set by `epl-launch`), the recipe or `--epl_set` says
otherwise. Worker 0 writes `vocab.txt`, TensorBoard logs and `metrics.json` to
`--output_dir`.
"""

import os
import sys
from pathlib import Path

if not __package__:
    # Run as a file (epl-launch does this), not with -m: make the checkout importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ info banners

from absl import app, flags

import epl_trainer as epl
import epl_trainer.runtime.flags as epl_flags  # defines --epl_config and --epl_set
from model_zoo.text_classifier import recipe

FLAGS = flags.FLAGS
flags.DEFINE_string("train_file", None, "GLUE-style training TSV; default: built-in data.")
flags.DEFINE_string("dev_file", None, "GLUE-style dev TSV (with --train_file).")
flags.DEFINE_string("vocab_file", None, "BERT vocab.txt; default: built from the training text.")
flags.DEFINE_integer("num_classes", None, "Classes; default: the largest label + 1.")
flags.DEFINE_integer("sequence_length", 32, "Tokens per sentence: [CLS] text [SEP], padded.")
flags.DEFINE_integer("num_layers", 2, "Transformer layers of the BertBackbone.")
flags.DEFINE_integer("hidden_dim", 64, "Hidden size of the BertBackbone.")
flags.DEFINE_integer("num_heads", 4, "Attention heads.")
flags.DEFINE_integer("intermediate_dim", 128, "Feed-forward size.")
flags.DEFINE_float("dropout", 0.1, "Dropout of the backbone and the classifier head.")
flags.DEFINE_integer(
    "batch_size", 32, "Per-worker batch: split over this worker's replicas x micro-batches."
)
flags.DEFINE_integer("epochs", 3, "Passes over the training data.")
flags.DEFINE_float("learning_rate", 1e-3, "Adam learning rate.")
flags.DEFINE_integer("builtin_train_samples", 2048, "Built-in data: training sentences.")
flags.DEFINE_integer("builtin_dev_samples", 256, "Built-in data: dev sentences.")
flags.DEFINE_integer("seed", 0, "Seed of the built-in data and of the initial weights.")
flags.DEFINE_enum("trainer", "epl", recipe.TRAINERS, "epl: EPLTrainer; keras: task.fit.")
flags.DEFINE_string("output_dir", "/tmp/epl_text_classifier", "vocab.txt, logs, metrics.json.")

DEFAULT_RECIPE = str(Path(__file__).resolve().parents[2] / "configs" / "text_classifier_zero1.json")


def options_from_flags() -> recipe.Options:
    """Options from the parsed flags; the default recipe unless --epl_config names one."""
    environ = dict(os.environ)
    # The environment is the config's lowest-precedence source: files and --epl_set win.
    environ.setdefault("EPL_CLUSTER_VIRTUAL_DEVICES", "2")
    overrides = epl_flags.parse_assignments(FLAGS.epl_set or [])
    recipe_file = FLAGS.epl_config or DEFAULT_RECIPE
    config = epl.Config.from_file(os.path.expanduser(recipe_file), overrides, environ=environ)
    names = [field.name for field in recipe.dataclasses.fields(recipe.Options)]
    values = {name: FLAGS[name].value for name in names if name in FLAGS}
    return recipe.Options(config=config, **values)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    options = options_from_flags()
    print(options.config)
    metrics = recipe.train(options)
    initial, final = metrics["initial_dev"], metrics["dev"]
    accuracy = "sparse_categorical_accuracy"
    print(
        f"Dev loss {initial['loss']:.4f} -> {final['loss']:.4f}, accuracy "
        f"{initial[accuracy]:.4f} -> {final[accuracy]:.4f} (majority class "
        f"{metrics['majority_accuracy']:.4f}); {metrics['trainer']} trainer, wall time "
        f"{metrics['wall_time_sec']:.1f} s"
    )


if __name__ == "__main__":
    app.run(main)
