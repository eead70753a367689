"""The MoE-T5 zoo recipe: data readers, loss and metric, the model's auxiliary loss,
expert-parallel training on the recipe config, and the command line.

The split-vs-unsplit check follows tests/test_split_moe.py: 2 lanes routing one group
each equal the Keras model routing the whole batch as 2 contiguous groups. Tolerance:
1e-5 on losses, predictions and weights after 2 SGD steps.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import epl_trainer as epl
from model_zoo.moe_t5 import data
from model_zoo.moe_t5 import model as moe_t5

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "moe_t5_split.json"
ATOL = 1e-5
LENGTH = 6


def tiny_config(**overrides) -> moe_t5.T5Config:
    sizes = dict(d_model=16, num_heads=2, num_layers=1, expert_hidden=16, dropout=0.0)
    sizes.update(max_source_length=LENGTH, max_target_length=LENGTH)
    return moe_t5.T5Config(vocab_size=len(data.task_vocabulary()), **{**sizes, **overrides})


def task_data(n=16, seed=0):
    pairs = [(s, t) for s, t in data.task_pairs(n, seed)]
    return data.encode_pairs(pairs, data.task_vocabulary(), LENGTH, LENGTH)


# ---- vocabulary and readers ----------------------------------------------------------------


def test_vocabulary_keeps_special_ids_and_round_trips(tmp_path):
    vocab = data.Vocabulary(["b", "</s>", "a"])
    assert vocab.tokens == ("<pad>", "</s>", "<unk>", "b", "a")
    ids = vocab.encode("a b zzz", 6)
    np.testing.assert_array_equal(ids, [4, 3, data.UNK_ID, data.EOS_ID, 0, 0])
    assert vocab.decode(ids) == "a b <unk>"
    np.testing.assert_array_equal(vocab.encode("a b a b a b", 4), [4, 3, 4, data.EOS_ID])
    path = str(tmp_path / "vocab.txt")
    vocab.write(path)
    assert data.Vocabulary.from_file(path).tokens == vocab.tokens
    (tmp_path / "dup.txt").write_text("a\nb\na\n")
    with pytest.raises(ValueError, match=r"Duplicate vocabulary token 'a'.*dup\.txt"):
        data.Vocabulary.from_file(str(tmp_path / "dup.txt"))
    with pytest.raises(ValueError, match="int >= 2"):
        vocab.encode("a", 1)


def test_python_and_tensorflow_encodings_agree():
    vocab = data.task_vocabulary()
    texts = ["a b c", "  p o  ", "q r s", "a " * 20, ""]
    expected = np.stack([vocab.encode(text, 8) for text in texts])
    # Two datasets sharing the vocabulary: its lookup table must outlive the first one's
    # map function (it is created there, on first use).
    for _ in range(2):
        dataset = tf.data.Dataset.from_tensor_slices(texts).map(lambda t: vocab.encode_tf(t, 8))
        np.testing.assert_array_equal(np.stack(list(dataset.as_numpy_iterator())), expected)


@pytest.mark.parametrize("data_format", ["tsv", "tfrecord"])
def test_readers_read_the_files_the_test_writes(tmp_path, data_format):
    vocab = data.Vocabulary(["hello", "world", "bonjour", "monde", "le"])
    pairs = [("hello world", "bonjour le monde"), ("world", "monde"), ("hello unknown", "le")]
    files = []
    for i, chunk in enumerate([pairs[:2], pairs[2:]]):
        path = str(tmp_path / f"part{i}.{data_format}")
        (data.write_tsv if data_format == "tsv" else data.write_tfrecord)(path, chunk)
        files.append(path)
    if data_format == "tsv":
        with open(files[0], "a") as f:
            f.write("\n")  # blank lines are skipped
    assert data.infer_format(files) == data_format
    examples = list(data.read_files(files, data_format, vocab, 5, 4).as_numpy_iterator())
    assert len(examples) == 3
    for (features, labels), (source, target) in zip(examples, pairs):
        np.testing.assert_array_equal(features["encoder_tokens"], vocab.encode(source, 5))
        np.testing.assert_array_equal(labels, vocab.encode(target, 4))
        np.testing.assert_array_equal(features["decoder_tokens"], data.shift_right(labels))
    assert vocab.decode(examples[2][0]["encoder_tokens"]) == "hello <unk>"
    assert examples[0][0]["decoder_tokens"][0] == data.PAD_ID  # the start token


def test_malformed_tsv_lines_and_unknown_formats_are_reported(tmp_path):
    path = tmp_path / "bad.tsv"
    path.write_text("no tab here\n")
    dataset = data.read_files([str(path)], "tsv", data.task_vocabulary(), 4, 4)
    with pytest.raises(tf.errors.InvalidArgumentError, match="source<TAB>target"):
        next(iter(dataset))
    with pytest.raises(ValueError, match="--data_format"):
        data.infer_format(["a.tsv", "b.json"])
    with pytest.raises(ValueError, match="data_format must be one of"):
        data.parse_fn_for("csv", data.task_vocabulary(), 4, 4)


def test_generated_task_reverses_and_maps():
    pairs = data.task_pairs(50, seed=3)
    for source, target in pairs:
        words = source.split()
        assert data.TASK_MIN_LENGTH <= len(words) <= data.TASK_MAX_LENGTH
        assert target.split() == [w.upper() for w in reversed(words)]
    assert pairs == data.task_pairs(50, seed=3) != data.task_pairs(50, seed=4)


# ---- loss, metric, decoding ----------------------------------------------------------------


def test_loss_averages_each_sequence_over_its_non_pad_tokens():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 4, 5)).astype("float32")
    labels = np.array([[3, 1, 0, 0], [2, 4, 3, 1], [0, 0, 0, 0]], np.int32)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    picked = -np.take_along_axis(log_probs, labels[..., None], -1)[..., 0]
    mask = labels != data.PAD_ID
    per_row = [(picked[i] * mask[i]).sum() / max(mask[i].sum(), 1) for i in range(3)]
    loss = moe_t5.SequenceCrossEntropy()
    assert float(loss(labels, logits)) == pytest.approx(np.mean(per_row), abs=1e-6)
    assert per_row[2] == 0.0  # an all-pad row (evaluation padding) adds nothing

    accuracy = moe_t5.TokenAccuracy()
    predictions = np.eye(5, dtype="float32")[[[3, 2, 0, 0], [2, 4, 3, 1], [1, 1, 1, 1]]]
    accuracy.update_state(labels, predictions)
    assert float(accuracy.result()) == pytest.approx(5 / 6)  # pads are not counted
    accuracy.reset_state()
    accuracy.update_state(labels, predictions, sample_weight=np.array([1.0, 0.0, 1.0]))
    assert float(accuracy.result()) == pytest.approx(1 / 2)


def test_greedy_decoding_feeds_back_its_own_predictions():
    """A fake model whose next token is the previous decoder token + 1 (from a start
    given by the encoder), ending with </s> at the encoder's length."""
    vocab_size = 12

    def predict(x):
        enc, dec = x["encoder_tokens"], x["decoder_tokens"]
        nxt = np.where(dec == data.PAD_ID, enc[:, :1], dec + 1)
        nxt[np.arange(dec.shape[1])[None] >= enc[:, 1:2]] = data.EOS_ID
        return np.eye(vocab_size)[nxt]

    encoder = np.array([[3, 2], [5, 4]], np.int32)
    out = moe_t5.greedy_decode(predict, encoder, 6)
    np.testing.assert_array_equal(out, [[3, 4, 1, 0, 0, 0], [5, 6, 7, 8, 1, 0]])


def test_model_config_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="num_heads=3"):
        tiny_config(num_heads=3)
    with pytest.raises(ValueError, match=r"dropout=1\.5"):
        tiny_config(dropout=1.5)
    recipe = moe_t5.T5Config(vocab_size=10)  # the moe_t5_small recipe's MoE settings
    assert (recipe.num_experts, recipe.top_k) == (8, 2)
    assert (recipe.capacity_factor, recipe.eval_capacity_factor) == (1.25, 2.0)


# ---- the model -----------------------------------------------------------------------------


def test_the_auxiliary_loss_is_in_the_models_losses():
    epl.init()
    model = moe_t5.build_model(tiny_config(aux_loss_coef=0.1), seed=1)
    layers = moe_t5.moe_layers(model)
    assert len(layers) == 2  # one encoder and one decoder feed-forward block
    assert all(layer.num_experts == 8 and layer.top_k == 2 for layer in layers)
    x, _ = task_data()
    model(x, training=False)
    assert len(model.losses) == 2
    stats = moe_t5.router_statistics(model, x)
    assert stats["aux_loss"] == pytest.approx(float(sum(model.losses)), rel=1e-5)
    assert stats["router_balance"] >= 1.0 - 1e-6  # 1 is perfectly balanced
    assert 0.0 <= stats["dropped_eval"] <= stats["dropped_train"] <= 1.0


def test_recipe_config_runs_two_steps_from_files(tmp_path):
    """The recipe on 2 logical devices, fed by fit(files, parse_fn=...) with the TSV
    reader (the --train_files path): experts sharded, 4 of 8 per device."""
    vocab = data.task_vocabulary()
    path = str(tmp_path / "train.tsv")
    data.write_tsv(path, data.task_pairs(32, seed=5))
    epl.init(str(RECIPE))
    model = moe_t5.build_model(tiny_config(), seed=2)
    trainer = epl.EPLTrainer(
        model,
        moe_t5.SequenceCrossEntropy(),
        keras.optimizers.Adam(1e-2),
        metrics=[moe_t5.TokenAccuracy()],
    )
    assert trainer.config.cluster.colocate_split_and_replicate
    assert trainer.plan.taskgraphs[0].device_count == 2
    assert [tg.kind for tg in trainer.plan.taskgraphs] == ["replicate", "split", "split"]
    parse_fn = data.parse_fn_for("tsv", vocab, LENGTH, LENGTH)
    evaluation = data.records([path], "tsv").map(parse_fn).batch(8)
    before = trainer.evaluate(evaluation, return_dict=True)
    history = trainer.fit(
        [path],
        batch_size=8,
        epochs=1,
        steps_per_epoch=2,
        parse_fn=parse_fn,
        file_format=lambda files: data.records(files, "tsv"),
        verbose=0,
    )
    assert int(trainer.optimizer.iterations.numpy()) == 2
    assert np.isfinite(history.history["loss"][0])
    assert (
        trainer.evaluate(evaluation, return_dict=True)["loss"] < before["loss"]
    )  # the two steps trained
    state = trainer.engine.state
    for layer in moe_t5.moe_layers(model):
        index = next(i for i, v in enumerate(state.model_trainable) if v is layer.w_in)
        shapes = {tuple(state.trainable[lane][index].shape) for lane in range(2)}
        assert shapes == {(4, 16, 16)}


@pytest.mark.slow
def test_split_experts_train_like_keras():
    """2 lanes routing one group each equal plain Keras routing 2 groups: weights after
    2 SGD steps, the evaluation loss (cross-entropy + every MoE layer's auxiliary loss)
    and predictions. SGD: Adam would magnify round-off in gradients that are zero in
    exact arithmetic (attention key biases)."""
    x, y = task_data(n=16)
    epl.init()
    reference = moe_t5.build_model(tiny_config(num_groups=2), seed=1)
    reference.compile(optimizer=keras.optimizers.SGD(0.5), loss=moe_t5.SequenceCrossEntropy())
    reference.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=2, shuffle=False, verbose=0)

    epl.init(str(RECIPE))
    model = moe_t5.build_model(tiny_config(), seed=1)
    trainer = epl.EPLTrainer(model, moe_t5.SequenceCrossEntropy(), keras.optimizers.SGD(0.5))
    trainer.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=2, verbose=0, shuffle=False)
    for ours, theirs in zip(model.weights, reference.weights):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=ATOL, err_msg=ours.path)

    reference_loss = moe_t5.SequenceCrossEntropy()(y, reference(x, training=False))
    expected = float(reference_loss) + float(sum(reference.losses))
    assert trainer.evaluate(x, y, batch_size=16, return_dict=True)["loss"] == pytest.approx(
        expected, abs=ATOL
    )
    np.testing.assert_allclose(
        trainer.predict(x, batch_size=16), reference.predict(x, verbose=0), atol=ATOL
    )


# ---- the command line ----------------------------------------------------------------------


@pytest.mark.slow
def test_command_line_trains_on_files_with_a_sentencepiece_model_and_writes_metrics(tmp_path):
    """The CLI on files it writes: SentencePiece tokenisation (T5's), evaluation files,
    metrics.json and TensorBoard logs. (vocab.txt loading is tested above.)"""
    model = _train_sentencepiece(tmp_path)
    data.write_tsv(str(tmp_path / "train.tsv"), data.task_pairs(64, seed=1))
    data.write_tsv(str(tmp_path / "dev.tsv"), data.task_pairs(8, seed=2))
    args = [
        sys.executable,
        "-m",
        "model_zoo.moe_t5",
        f"--train_files={tmp_path / 'train.tsv'}",
        f"--eval_files={tmp_path / 'dev.tsv'}",
        f"--spm_model={model}",
        f"--output_dir={tmp_path / 'out'}",
        "--epochs=1",
        "--steps_per_epoch=2",
        "--batch_size=8",
        "--num_eval_examples=8",
        "--d_model=16",
        "--num_layers=1",
        "--expert_hidden=16",
        "--max_source_length=12",
        "--max_target_length=12",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["config"]["cluster.colocate_split_and_replicate"] is True
    assert metrics["data"].startswith("tsv files")
    assert set(metrics["final"]) >= {"loss", "token_accuracy", "aux_loss", "router_balance"}
    assert len(metrics["history"]["val_token_accuracy"]) == 1
    assert 0.0 <= metrics["greedy_exact_match"] <= 1.0
    # Two Adam steps on the task lower the evaluation loss: the recipe really trains.
    assert metrics["final"]["loss"] < metrics["initial"]["loss"]
    assert any((tmp_path / "out" / "logs").rglob("*.tfevents*"))


# ---- SentencePiece (T5's tokenisation) ------------------------------------------------------


def _train_sentencepiece(tmp_path, **ids) -> str:
    """A small SentencePiece model trained here on generated text (well under a second)."""
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    lines = [f"{s} {t}" for s, t in data.task_pairs(400, seed=7)]
    corpus.write_text("\n".join(lines) + "\n")
    prefix = str(tmp_path / "spm")
    settings = dict(pad_id=0, eos_id=1, unk_id=2, bos_id=-1)
    settings.update(ids)
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=prefix, vocab_size=48, model_type="unigram",
        character_coverage=1.0, **settings,
    )  # fmt: skip
    return prefix + ".model"


def test_sentencepiece_vocabulary_round_trips_with_t5_ids(tmp_path):
    from model_zoo.moe_t5.spm import SentencePieceVocabulary

    vocab = SentencePieceVocabulary(_train_sentencepiece(tmp_path))
    assert len(vocab) == 48
    ids = vocab.encode("a b c D E", 12)
    assert ids.dtype == np.int32 and ids.shape == (12,)
    end = list(ids).index(data.EOS_ID)
    assert all(i >= 3 for i in ids[:end]) and set(ids[end + 1 :]) <= {data.PAD_ID}
    assert vocab.decode(ids) == "a b c D E"
    np.testing.assert_array_equal(vocab.encode_tf(tf.constant("a b c D E"), 12).numpy(), ids)
    assert list(vocab.encode("a b c d e f g h i j", 4))[-1] == data.EOS_ID  # truncated


def test_sentencepiece_model_with_other_special_ids_is_refused(tmp_path):
    from model_zoo.moe_t5.spm import SentencePieceVocabulary

    path = _train_sentencepiece(tmp_path, pad_id=3, eos_id=2, unk_id=0, bos_id=1)
    with pytest.raises(ValueError, match=r"must use T5's special ids .* Received: \{'pad': 3"):
        SentencePieceVocabulary(path)
