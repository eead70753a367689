"""BERT-SQuAD model: Google checkpoint loading, the recipes in configs/, the pipeline cut."""

import collections
import json
import math
import os
import re
import string
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import epl_trainer as epl
from model_zoo.bert_squad import builtin_data, checkpoint, squad
from model_zoo.bert_squad.modeling import BertConfig, build_squad_model
from model_zoo.bert_squad.recipe import (
    DEFAULT_CONFIG,
    bert_optimizer,
    default_num_stages,
    environ_with_defaults,
)
from model_zoo.bert_squad.tokenization import FullTokenizer

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(ROOT.glob("configs/bert_squad_*.json"))
SMALL = BertConfig(
    vocab_size=30,
    hidden_size=8,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=16,
    max_position_embeddings=16,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


# ---------------------------------------------------------------- Google checkpoints
def google_weights(config: BertConfig, seed=0) -> dict[str, np.ndarray]:
    """Random values under every name of a Google BERT SQuAD checkpoint."""
    rng = np.random.default_rng(seed)
    h, i = config.hidden_size, config.intermediate_size
    shapes = {
        "bert/embeddings/word_embeddings": (config.vocab_size, h),
        "bert/embeddings/token_type_embeddings": (config.type_vocab_size, h),
        "bert/embeddings/position_embeddings": (config.max_position_embeddings, h),
        "bert/embeddings/LayerNorm/gamma": (h,),
        "bert/embeddings/LayerNorm/beta": (h,),
        "bert/pooler/dense/kernel": (h, h),  # unused for SQuAD: must be ignored
        "cls/squad/output_weights": (2, h),
        "cls/squad/output_bias": (2,),
    }
    for layer in range(config.num_hidden_layers):
        p = f"bert/encoder/layer_{layer}/"
        for scope, (n_in, n_out) in {
            "attention/self/query": (h, h),
            "attention/self/key": (h, h),
            "attention/self/value": (h, h),
            "attention/output/dense": (h, h),
            "intermediate/dense": (h, i),
            "output/dense": (i, h),
        }.items():
            shapes[f"{p}{scope}/kernel"] = (n_in, n_out)
            shapes[f"{p}{scope}/bias"] = (n_out,)
        for scope in ("attention/output/LayerNorm", "output/LayerNorm"):
            shapes[f"{p}{scope}/gamma"] = (h,)
            shapes[f"{p}{scope}/beta"] = (h,)
    return {name: rng.normal(size=shape).astype("float32") for name, shape in shapes.items()}


def write_tf1_checkpoint(weights: dict, prefix: str) -> str:
    """A name-based TF1 checkpoint, as Google's `bert_model.ckpt` files are."""
    with tf.Graph().as_default():
        variables = [tf.compat.v1.Variable(value, name=name) for name, value in weights.items()]
        saver = tf.compat.v1.train.Saver(variables)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            return saver.save(session, prefix)


def reference_bert_squad(w, input_ids, input_mask, segment_ids, config):
    """Google BERT's forward pass written out in numpy from the checkpoint's arrays."""

    def layer_norm(x, prefix):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + 1e-12) * w[prefix + "/gamma"] + w[prefix + "/beta"]

    def dense(x, prefix):
        return x @ w[prefix + "/kernel"] + w[prefix + "/bias"]

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    batch, seq = input_ids.shape
    heads, size = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    x = (
        w["bert/embeddings/word_embeddings"][input_ids]
        + w["bert/embeddings/token_type_embeddings"][segment_ids]
        + w["bert/embeddings/position_embeddings"][:seq]
    )
    x = layer_norm(x, "bert/embeddings/LayerNorm")
    bias = (1.0 - input_mask[:, None, None, :]) * -10000.0
    for layer in range(config.num_hidden_layers):
        p = f"bert/encoder/layer_{layer}/"

        def heads_of(t):
            return t.reshape(batch, seq, heads, size).transpose(0, 2, 1, 3)

        q, k, v = (heads_of(dense(x, p + f"attention/self/{n}")) for n in ("query", "key", "value"))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(size) + bias
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        context = (probs @ v).transpose(0, 2, 1, 3).reshape(batch, seq, -1)
        attended = layer_norm(
            dense(context, p + "attention/output/dense") + x, p + "attention/output/LayerNorm"
        )
        ffn = dense(gelu(dense(attended, p + "intermediate/dense")), p + "output/dense")
        x = layer_norm(ffn + attended, p + "output/LayerNorm")
    logits = x @ w["cls/squad/output_weights"].T + w["cls/squad/output_bias"]
    return logits[..., 0], logits[..., 1]


def small_inputs(batch=3, seq=12, seed=1):
    rng = np.random.default_rng(seed)
    lengths = np.array([seq, 7, 4])[:batch]
    mask = (np.arange(seq)[None] < lengths[:, None]).astype("int32")
    return {
        "input_ids": rng.integers(0, SMALL.vocab_size, (batch, seq)).astype("int32"),
        "input_mask": mask,
        "segment_ids": (np.arange(seq)[None] >= 5).astype("int32").repeat(batch, 0),
    }


def test_google_checkpoint_loads_and_gives_the_reference_outputs(tmp_path):
    weights = google_weights(SMALL)
    path = write_tf1_checkpoint(weights, str(tmp_path / "bert_model.ckpt"))
    model = build_squad_model(SMALL, max_seq_length=12)
    loaded = checkpoint.load_google_checkpoint(model, path)
    assert len(loaded) == 5 + 16 * SMALL.num_hidden_layers + 2
    assert "bert/pooler/dense/kernel" not in loaded
    x = small_inputs()
    outputs = model(x)
    start, end = reference_bert_squad(
        weights, x["input_ids"], x["input_mask"], x["segment_ids"], SMALL
    )
    np.testing.assert_allclose(outputs["start_logits"], start, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(outputs["end_logits"], end, rtol=1e-4, atol=1e-4)


def test_pretraining_checkpoint_without_squad_head_keeps_the_fresh_head(tmp_path):
    weights = google_weights(SMALL)
    del weights["cls/squad/output_weights"], weights["cls/squad/output_bias"]
    path = write_tf1_checkpoint(weights, str(tmp_path / "bert_model.ckpt"))
    model = build_squad_model(SMALL, max_seq_length=12)
    head = model.get_layer("qa_outputs").kernel.numpy()
    loaded = checkpoint.load_google_checkpoint(model, path)
    assert not any(name.startswith("cls/") for name in loaded)
    np.testing.assert_array_equal(model.get_layer("qa_outputs").kernel.numpy(), head)


def test_checkpoint_of_another_size_is_an_error_naming_the_variable(tmp_path):
    path = write_tf1_checkpoint(google_weights(SMALL), str(tmp_path / "bert_model.ckpt"))
    deeper = BertConfig(**{**SMALL.__dict__, "num_hidden_layers": 3})
    with pytest.raises(
        ValueError, match=r"no variable 'bert/encoder/layer_2/.*layer_0', 'layer_1'"
    ):
        checkpoint.load_google_checkpoint(build_squad_model(deeper, 12), path)
    wider = BertConfig(**{**SMALL.__dict__, "intermediate_size": 32})
    with pytest.raises(ValueError, match=r"intermediate/dense/kernel' has shape \(8, 16\)"):
        checkpoint.load_google_checkpoint(build_squad_model(wider, 12), path)


def test_bert_config_json_and_published_sizes(tmp_path):
    path = tmp_path / "bert_config.json"
    path.write_text(json.dumps({**SMALL.__dict__, "directionality": "bidi"}))
    assert BertConfig.from_json_file(path) == SMALL
    base = BertConfig.preset("base", 30522)
    large = BertConfig.preset("large", 30522)
    assert (base.hidden_size, base.num_hidden_layers, base.num_attention_heads) == (768, 12, 12)
    assert (large.hidden_size, large.num_hidden_layers, large.num_attention_heads) == (1024, 24, 16)
    assert (base.intermediate_size, large.intermediate_size) == (3072, 4096)
    with pytest.raises(ValueError, match="hidden_size=10, num_attention_heads=4"):
        BertConfig(vocab_size=5, hidden_size=10, num_attention_heads=4)


# ---------------------------------------------------------------- recipes
@pytest.fixture(scope="module")
def builtin_features(tmp_path_factory):
    paths = builtin_data.write_builtin_data(tmp_path_factory.mktemp("squad"), 8, 2, seed=0)
    tokenizer = FullTokenizer(paths["vocab"])
    examples = squad.read_squad_examples(paths["train"], is_training=True)
    features = squad.convert_examples_to_features(examples, tokenizer, 32, 8, 12, True)
    return features, len(tokenizer.vocab)


def _initial_attention_score_std(initializer_range):
    """The spread of layer 0's attention scores at initialisation, on embedded tokens."""
    config = BertConfig.preset("tiny", vocab_size=50)
    config = BertConfig(**{**config.__dict__, "initializer_range": initializer_range})
    keras.utils.set_random_seed(0)
    model = build_squad_model(config, 32)
    ids = np.random.default_rng(0).integers(0, 50, size=(8, 32)).astype("int32")
    hidden = model.get_layer("embeddings")([ids, np.zeros_like(ids)])
    layer = model.get_layer("layer_0")
    q, k = layer._heads(layer.query(hidden)), layer._heads(layer.key(hidden))
    scores = np.matmul(q, np.swapaxes(k, -1, -2)) / np.sqrt(layer.head_size)
    return float(np.std(scores, axis=-1).mean())


def test_tiny_preset_attention_is_not_uniform_at_initialisation():
    """BERT's initializer_range (0.02) is sized for 768 hidden units; at 64 every attention
    row started almost uniform (a bag of words) and dev F1 stalled near 58."""
    assert BertConfig.preset("tiny", 10).initializer_range == pytest.approx(64**-0.5)
    assert _initial_attention_score_std(0.02) < 0.05  # measured 0.015: nearly uniform rows
    assert _initial_attention_score_std(BertConfig.preset("tiny", 10).initializer_range) > 0.3


def test_bert_optimizer_excludes_exactly_layer_norm_and_biases_from_decay():
    model = build_squad_model(BertConfig(**{**SMALL.__dict__, "vocab_size": 30}), 16)
    optimizer = bert_optimizer(model, total_steps=100, learning_rate=1e-3, weight_decay=0.01)
    decayed = {v.path for v in model.trainable_variables if optimizer._use_weight_decay(v)}
    kept = {v.path for v in model.trainable_variables} - decayed
    assert kept and all(p.endswith("/bias") or "LayerNorm/" in p for p in kept)
    assert "embeddings/LayerNorm/gamma" in kept and "layer_0/attention_LayerNorm/beta" in kept
    assert all(p.endswith(("/kernel", "_embeddings")) for p in decayed)
    assert "embeddings/word_embeddings" in decayed and "layer_1/intermediate/kernel" in decayed
    assert optimizer.epsilon == 1e-6 and optimizer.global_clipnorm == 1.0


def test_bert_learning_rate_warms_up_then_decays_linearly_to_zero():
    model = build_squad_model(BertConfig(**{**SMALL.__dict__, "vocab_size": 30}), 16)
    optimizer = bert_optimizer(model, total_steps=100, learning_rate=1e-3, warmup_proportion=0.1)
    schedule = optimizer._learning_rate
    lr = [float(schedule(step)) for step in (0, 5, 10, 55, 100)]
    np.testing.assert_allclose(lr, [0.0, 5e-4, 1e-3, 5e-4, 0.0], atol=1e-9)


def test_there_are_pipeline_and_auto_recipes():
    assert {p.name for p in RECIPES} == {"bert_squad_pipeline.json", "bert_squad_auto.json"}


# Slow: tracing the 2-stage x 4-micro-batch step takes ~10-30 s on a shared 2-core CPU,
# whatever the model size.
@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_builds_a_two_stage_pipeline_and_trains_two_steps(recipe, builtin_features):
    features, vocab_size = builtin_features
    config = epl.Config.from_file(recipe)
    epl.init(config)
    # SMALL's sizes keep the compile short; the tiny preset is what __main__ trains.
    bert = BertConfig(**{**SMALL.__dict__, "vocab_size": vocab_size, "max_position_embeddings": 32})
    stages = 1 if config.auto.auto_parallel else 2
    model = build_squad_model(bert, 32, num_stages=stages)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    trainer = epl.EPLTrainer(
        model,
        loss={"start_logits": loss, "end_logits": loss},
        optimizer=keras.optimizers.Adam(1e-3),
    )
    assert len(trainer.plan.taskgraphs) == 2
    assert trainer.plan.num_micro_batch == 4
    stage_layers = [set(stage.layer_names) for stage in trainer.staged.stages]
    assert "embeddings" in stage_layers[0] and "qa_outputs" in stage_layers[1]
    x, y = squad.features_to_arrays(features[:16], with_labels=True)
    before = [w.numpy().copy() for w in model.trainable_weights]
    history = trainer.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    assert np.isfinite(history.history["loss"][-1])
    changed = [not np.array_equal(b, w.numpy()) for b, w in zip(before, model.trainable_weights)]
    assert all(changed)  # both stages (embeddings ... QA head) were updated
    model.to_json()  # TensorBoard writes the graph: the cut must leave the model intact


def test_default_run_uses_the_pipeline_recipe_and_a_given_recipe_replaces_it():
    recipe = json.loads((ROOT / "configs/bert_squad_pipeline.json").read_text())
    assert {k: recipe[k] for k in DEFAULT_CONFIG} == DEFAULT_CONFIG
    default = epl.Config({}, environ=environ_with_defaults(None, environ={}))
    assert default.pipeline.num_micro_batch == 4 and default.cluster.virtual_devices == 2
    dp = epl.Config.from_file(
        ROOT / "configs/dp.json", environ=environ_with_defaults("configs/dp.json", environ={})
    )
    assert dp.pipeline.num_micro_batch == 1  # dp.json's meaning, not the pipeline's
    launched = environ_with_defaults(None, environ={"EPL_CLUSTER_VIRTUAL_DEVICES": "4"})
    assert epl.Config({}, environ=launched).cluster.virtual_devices == 4
    data_parallel = epl.Config({}, environ=environ_with_defaults(None, {}, num_stages=1))
    assert data_parallel.pipeline.num_micro_batch == 1  # no stages: no micro-batches
    assert data_parallel.cluster.virtual_devices == 2


@pytest.mark.parametrize(
    "onednn, one_process, stages",
    [(True, True, 2), (True, False, 2), (False, True, 1), (False, False, 2)],
)
def test_the_default_layout_follows_the_measured_rule(onednn, one_process, stages):
    """Without --num_stages: a pipeline where oneDNN's kernels run, data parallelism with
    each lane in XLA where they do not, unless several workers keep lanes from compiling."""
    chosen, why = default_num_stages(onednn, one_process)
    assert chosen == stages
    assert ("oneDNN's kernels are on" if onednn else "oneDNN is off") in why
    # A recipe given with --epl_config was written for the scopes' stages.
    chosen, why = default_num_stages(onednn, one_process, recipe_given=True)
    assert chosen == 2 and "--epl_config given" in why


def test_model_input_used_by_a_later_stage_keeps_the_model_serialisable():
    """Engine fix: cutting stages must not rewire the user's model Inputs."""
    epl.init({"cluster.virtual_devices": 2})
    x = keras.Input((4,), name="x")
    mask = keras.Input((4,), name="mask")
    h = keras.layers.Dense(4, name="embed")(x)
    h = keras.layers.Add(name="block_0")([h, mask])
    h = keras.layers.Add(name="block_1")([h, mask])  # stage 1 reads the model input again
    model = keras.Model({"x": x, "mask": mask}, keras.layers.Dense(2, name="head")(h))
    epl.EPLTrainer(model, loss="mse", stages={"embed|block_0": 0, "block_1|head": 1})
    clone = keras.Model.from_config(model.get_config())
    assert [layer.name for layer in clone.layers] == [layer.name for layer in model.layers]


@pytest.mark.slow
@pytest.mark.parametrize("trainer", [pytest.param("epl", marks=pytest.mark.onednn), "keras"])
def test_main_runs_end_to_end_on_builtin_data(tmp_path, trainer):
    """The default run (EPL: a pipeline with oneDNN, else data parallelism; CI runs it
    both ways) and its plain-Keras comparison (--trainer=keras)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("EPL_CLUSTER_VIRTUAL_DEVICES", None)
    command = [
        sys.executable,
        "-m",
        "model_zoo.bert_squad",
        f"--output_dir={tmp_path}",
        "--builtin_train_paragraphs=16",
        "--builtin_dev_paragraphs=4",
        "--num_train_epochs=2",
        "--max_seq_length=64",
        "--train_batch_size=16",
        f"--trainer={trainer}",
    ]
    result = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SQuAD v1.1 dev: exact match" in result.stdout
    published = "EPL's published BERT recipe: EM 79.8, F1 88.0. It differs from this run in"
    assert f"{published} model (BERT-tiny, trained from scratch" in result.stdout
    predictions = json.loads((tmp_path / "predictions.json").read_text())
    assert len(predictions) == 4 * builtin_data.QUESTIONS_PER_PARAGRAPH
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert set(metrics["dev"]) == {"exact_match", "f1"}
    # The final scores are the last epoch's (the dev set is not predicted again for them),
    # and they are the official scores of the predictions written, recomputed here from
    # predictions.json and the dev file by a scorer that shares no code with the run's.
    assert metrics["dev"]["f1"] == metrics["history"]["dev_f1"][-1]
    dev = json.loads((tmp_path / "data" / "dev.json").read_text())
    official = _official_squad_v1_scores(dev, predictions)
    assert metrics["dev"] == pytest.approx(official, abs=1e-9)
    assert 0 < official["f1"] < 100  # neither nothing nor everything found: scoring matters
    losses = metrics["history"]["loss"]
    assert len(losses) == 2 and losses[1] < losses[0]  # the pipeline really trains
    assert metrics["trainer"] == trainer
    assert (metrics["plan"] is not None) == (trainer == "epl")
    assert list((tmp_path / "logs").rglob("events.out.tfevents.*"))
    # The wall time's breakdown: the parts are positive and add up to at most the whole.
    seconds = metrics["seconds"]
    assert set(seconds) == {"data", "training", "evaluation"} and min(seconds.values()) > 0
    assert sum(seconds.values()) <= metrics["wall_time_sec"]
    assert "ms/step with tracing), dev predictions" in result.stdout
    if trainer == "epl":
        onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "1") != "0"  # unset: epl sets 1
        stages = len(metrics["plan"]["taskgraphs"])
        assert stages == (2 if onednn else 1)
        assert f"Stages: {stages} (oneDNN" in result.stdout
        assert metrics["plan"]["num_micro_batch"] == (4 if onednn else 1)
        # metrics.json records the count the run chose, not only the flag (not given).
        assert metrics["flags"]["num_stages"] is None
        assert metrics["stages"]["count"] == stages and "oneDNN" in metrics["stages"]["why"]
    else:
        assert metrics["stages"] is None


def _official_squad_v1_scores(dataset: dict, predictions: dict) -> dict:
    """SQuAD v1.1's `evaluate-v1.1.py`, written out again (not model_zoo's evaluation.py):
    the maximum over gold answers of exact match and token F1 of normalised answers,
    averaged over every question, in percent."""

    def normalize(text):
        text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
        return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())

    def f1(prediction, truth):
        p, t = normalize(prediction).split(), normalize(truth).split()
        same = sum((collections.Counter(p) & collections.Counter(t)).values())
        return 0.0 if same == 0 else 2 * same / (len(p) + len(t))

    em = total_f1 = 0.0
    questions = [qa for a in dataset["data"] for p in a["paragraphs"] for qa in p["qas"]]
    for qa in questions:
        if qa["id"] in predictions:
            truths = [answer["text"] for answer in qa["answers"]]
            em += max(float(normalize(predictions[qa["id"]]) == normalize(t)) for t in truths)
            total_f1 += max(f1(predictions[qa["id"]], t) for t in truths)
    return {"exact_match": 100 * em / len(questions), "f1": 100 * total_f1 / len(questions)}
