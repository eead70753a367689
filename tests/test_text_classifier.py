"""model_zoo.text_classifier: a KerasHub BertTextClassifier trained on raw strings by
EPLTrainer. Its data (built-in set, GLUE-style TSV files the test writes, the vocabulary),
its flags, and a short run of the recipe on files, end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import epl_trainer as epl
from model_zoo.text_classifier import data as data_lib
from model_zoo.text_classifier import recipe

pytest.importorskip("keras_hub")

ROOT = Path(__file__).resolve().parents[1]


def test_builtin_data_is_seeded_balanced_and_decided_by_topic_words():
    texts, labels = data_lib.builtin_split(300, seed=4)
    assert (texts, list(labels)) == tuple(
        [data_lib.builtin_split(300, seed=4)[0], list(data_lib.builtin_split(300, seed=4)[1])]
    )
    assert texts != data_lib.builtin_split(300, seed=5)[0]
    assert np.bincount(labels).min() > 70  # about 100 per topic
    for text, label in zip(texts, labels):
        counts = [
            sum(word in data_lib.TOPICS[name] for word in text.split())
            for name in data_lib.TOPIC_NAMES
        ]
        assert counts[label] >= 2 and counts[label] > max(np.delete(counts, label))


def test_tsv_files_are_read_by_their_header(tmp_path):
    path = tmp_path / "train.tsv"
    path.write_text("idx\tlabel\tsentence\n0\t1\tit was fun\n\n1\t0\tdull , slow\n")
    texts, labels = data_lib.read_tsv(path)
    assert texts == ["it was fun", "dull , slow"] and labels.tolist() == [1, 0]
    data_lib.write_tsv(tmp_path / "copy.tsv", texts, labels)
    assert data_lib.read_tsv(tmp_path / "copy.tsv")[0] == texts


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "the file is empty"),
        ("text\tlabel\n", r"no column\(s\) \['sentence'\]"),
        ("sentence\tlabel\n", "no rows after the header"),
        (
            "sentence\tlabel\nfine\t1\nbad\tpositive\n",
            r"line 3: the label must be an int >= 0. Received: 'positive'",
        ),
        ("sentence\tlabel\nshort\n", "line 2: 1 field"),
    ],
)
def test_bad_tsv_files_are_errors_naming_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.tsv"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        data_lib.read_tsv(path)


def test_vocabulary_has_the_special_tokens_then_words_by_frequency(tmp_path):
    path = data_lib.build_vocabulary(["b a b", "C b a", "d"], tmp_path / "v" / "vocab.txt")
    assert Path(path).read_text().split("\n")[:-1] == [*data_lib.SPECIAL_TOKENS, "b", "a", "c", "d"]


# Parses each command line (a JSON list of them) as main() does, from the defaults each
# time, and prints what the test checks.
_PARSE = """
import json, sys
from absl import flags
from model_zoo.text_classifier import __main__ as main_module
parsed = []
for argv in json.loads(sys.argv[1]):
    flags.FLAGS.unparse_flags()  # the defaults again: each command line on its own
    flags.FLAGS(["text_classifier", *argv])
    options = main_module.options_from_flags()
    parsed.append({
        "epochs": options.epochs, "hidden_dim": options.hidden_dim, "trainer": options.trainer,
        "zero": options.config.zero.level, "devices": options.config.cluster.virtual_devices,
    })
print(json.dumps(parsed))
"""


def _parsed_options(*argvs) -> list:
    """The options main() would use for each command line, parsed in one fresh process:
    the zoo entries define their flags in absl's global registry, and another entry's
    flags of the same names (test_resnet50 imports model_zoo.resnet50's __main__) would
    clash in this one. (One process for all: each takes ~3.5 s to import the entry.)"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("EPL_CLUSTER_VIRTUAL_DEVICES", None)
    result = subprocess.run(
        [sys.executable, "-c", _PARSE, json.dumps(argvs)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_flags_reach_the_options_and_the_default_recipe_is_zero_v1():
    options, given = _parsed_options(
        ["--epochs=5", "--hidden_dim=32", "--trainer=keras"],
        [f"--epl_config={ROOT / 'configs/dp.json'}"],
    )
    assert (options["epochs"], options["hidden_dim"], options["trainer"]) == (5, 32, "keras")
    assert options["zero"] == "v1"
    assert options["devices"] == 2
    assert given["zero"] == ""
    assert (given["epochs"], given["hidden_dim"], given["trainer"]) == (3, 64, "epl")


def test_one_of_train_and_dev_files_is_an_error(tmp_path):
    options = recipe.Options(config=epl.Config({}), train_file=str(tmp_path / "t.tsv"))
    with pytest.raises(ValueError, match="Give both --train_file and --dev_file"):
        recipe.load_data(options)


def test_recipe_trains_on_tsv_files_end_to_end(tmp_path):
    """The default recipe (ZeRO v1 on 2 devices) on files: the dev loss falls and the
    run's metrics, vocabulary and TensorBoard logs are written."""
    train, dev = data_lib.builtin_split(160, seed=1), data_lib.builtin_split(32, seed=2)
    data_lib.write_tsv(tmp_path / "train.tsv", *train)
    data_lib.write_tsv(tmp_path / "dev.tsv", *dev)
    options = recipe.Options(
        config=epl.Config.from_file(
            ROOT / "configs/text_classifier_zero1.json", {"cluster.virtual_devices": 2}
        ),
        train_file=str(tmp_path / "train.tsv"),
        dev_file=str(tmp_path / "dev.tsv"),
        sequence_length=16,
        num_layers=1,  # tracing the train step of 2 layers on 2 replicas takes 30 s
        hidden_dim=16,
        num_heads=2,
        intermediate_dim=32,
        dropout=0.0,
        batch_size=16,
        epochs=1,
        learning_rate=1e-2,
        output_dir=str(tmp_path / "run"),
        verbose=0,
    )
    metrics = recipe.train(options)
    assert metrics["dev"]["loss"] < metrics["initial_dev"]["loss"]
    assert metrics["plan"]["num_replicas"] == 2 and metrics["num_classes"] == 3
    written = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert written["config"]["zero.level"] == "v1"
    assert (tmp_path / "run" / "vocab.txt").exists()
    assert list((tmp_path / "run" / "logs").rglob("events.out.tfevents.*"))
