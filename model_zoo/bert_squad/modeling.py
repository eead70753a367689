"""BERT (Devlin et al., 2019) as a functional Keras model with a SQuAD span head.

The math is Google BERT's `modeling.py`: word + position + token-type embeddings, then
post-LayerNorm transformer layers (tanh-approximated GELU, LayerNorm epsilon 1e-12, an
additive -10000 attention bias on padding), then one Dense(2) giving start and end
logits per token. Every sub-layer is named after its Google checkpoint scope
(`attention/self/query`, `intermediate/dense`, ...) so `checkpoint.py` can map
`bert_model.ckpt` onto it one to one.

The model is functional with one node per BERT block (`embeddings`, `layer_0`, ...,
`qa_outputs`) so EPL can cut it into pipeline stages: by `epl.replicate` scopes
(`build_squad_model(config, num_stages=2)`), by a `stages=` regex map, or automatically
(`auto.auto_parallel`, which sees the repeated `layer_i` blocks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from pathlib import Path

import keras
from keras import ops

import epl_trainer as epl


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """BERT's sizes; field names and meanings are those of Google's `bert_config.json`."""

    vocab_size: int
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                "hidden_size must be a multiple of num_attention_heads. Received: "
                f"hidden_size={self.hidden_size}, num_attention_heads={self.num_attention_heads}"
            )
        if self.hidden_act != "gelu":
            raise ValueError(f"Only hidden_act='gelu' is supported. Received: {self.hidden_act!r}")

    @classmethod
    def from_json_file(cls, path: str | Path) -> BertConfig:
        """Reads Google's `bert_config.json`; unknown keys (e.g. `directionality`) are ignored."""
        values = json.loads(Path(path).read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    @classmethod
    def preset(cls, name: str, vocab_size: int) -> BertConfig:
        """`tiny` (CPU default), `base` or `large` (the published BERT sizes)."""
        if name not in PRESETS:
            raise ValueError(f"Unknown BERT size {name!r}; expected one of {sorted(PRESETS)}.")
        return cls(vocab_size=vocab_size, **PRESETS[name])


# base and large are the published sizes (Devlin et al. 2019, section 3; Google's
# bert_config.json files, dropout 0.1, 512 positions). tiny is ours: small enough to train
# from scratch on a CPU in minutes, where dropout only slowed learning (measured on the
# built-in data: dev EM 42.2 without vs 32.0 with dropout 0.1 after 2 epochs).
#
# tiny's initializer_range is 1/sqrt(hidden_size), not BERT's 0.02: 0.02 is sized for
# 768 hidden units, and at 64 it makes the query and key projections so small that every
# attention row starts nearly uniform (a bag of words) and stays there for thousands of
# steps, because the gradient of a score is the product of two tiny weights. Measured
# in plain Keras on the built-in data (12,000 paragraphs, AdamW, linear decay, seed 0):
# dev F1 79.5 after 2,000 steps with 0.02, 95.0 with 0.125; answers told apart only by
# position (mayor vs founder, river, region) went from 2-25% to 100% exact.
PRESETS = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        initializer_range=64**-0.5,
    ),
    "base": dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072
    ),
    "large": dict(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096
    ),
}


def _initializer(config: BertConfig):
    # Google's create_initializer: truncated normal with stddev initializer_range.
    return keras.initializers.TruncatedNormal(stddev=config.initializer_range)


def _dense(config: BertConfig, units: int, name: str, activation=None) -> keras.layers.Dense:
    return keras.layers.Dense(
        units, activation=activation, kernel_initializer=_initializer(config), name=name
    )


def _layer_norm(name: str = "LayerNorm") -> keras.layers.LayerNormalization:
    return keras.layers.LayerNormalization(epsilon=1e-12, name=name)


def gelu(x):
    """Google BERT's GELU: the tanh approximation."""
    return keras.activations.gelu(x, approximate=True)


@keras.saving.register_keras_serializable("bert_squad")
class BertEmbeddings(keras.layers.Layer):
    """word + position + token-type embeddings, LayerNorm, dropout."""

    def __init__(self, config: BertConfig, **kwargs):
        super().__init__(**kwargs)
        self.config = config
        self.layer_norm = _layer_norm()
        self.dropout = keras.layers.Dropout(config.hidden_dropout_prob)

    def build(self, input_shape):
        c = self.config
        init = _initializer(c)
        self.word_embeddings = self.add_weight(
            (c.vocab_size, c.hidden_size), init, name="word_embeddings"
        )
        self.token_type_embeddings = self.add_weight(
            (c.type_vocab_size, c.hidden_size), init, name="token_type_embeddings"
        )
        self.position_embeddings = self.add_weight(
            (c.max_position_embeddings, c.hidden_size), init, name="position_embeddings"
        )
        self.layer_norm.build((None, None, c.hidden_size))

    def call(self, inputs, training=False):
        input_ids, segment_ids = inputs
        seq_length = ops.shape(input_ids)[1]
        x = ops.take(self.word_embeddings, input_ids, axis=0)
        x = x + ops.take(self.token_type_embeddings, segment_ids, axis=0)
        x = x + self.position_embeddings[None, :seq_length]
        return self.dropout(self.layer_norm(x), training=training)

    def compute_output_shape(self, input_shape):
        return (*input_shape[0], self.config.hidden_size)

    def get_config(self):
        return {**super().get_config(), "config": dataclasses.asdict(self.config)}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        return cls(BertConfig(**config.pop("config")), **config)


@keras.saving.register_keras_serializable("bert_squad")
class TransformerLayer(keras.layers.Layer):
    """One BERT encoder layer: self-attention and feed-forward, each add + LayerNorm.

    Takes `[hidden, input_mask]`: the padding mask is a model input that every layer
    reads (so a pipeline routes it to each stage), and the additive bias is recomputed
    per layer, which costs one elementwise op and keeps it out of the activations that
    cross stages.
    """

    def __init__(self, config: BertConfig, **kwargs):
        super().__init__(**kwargs)
        self.config = config
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_size = h // config.num_attention_heads
        self.query = _dense(config, h, "query")
        self.key = _dense(config, h, "key")
        self.value = _dense(config, h, "value")
        self.attention_output = _dense(config, h, "attention_output")
        self.attention_layer_norm = _layer_norm("attention_LayerNorm")
        self.intermediate = _dense(config, config.intermediate_size, "intermediate", gelu)
        self.output_dense = _dense(config, h, "output")
        self.output_layer_norm = _layer_norm("output_LayerNorm")
        self.attention_dropout = keras.layers.Dropout(config.attention_probs_dropout_prob)
        self.hidden_dropout = keras.layers.Dropout(config.hidden_dropout_prob)

    def build(self, input_shape):
        h, i = self.config.hidden_size, self.config.intermediate_size
        for dense in (self.query, self.key, self.value, self.attention_output, self.intermediate):
            dense.build((None, None, h))
        self.output_dense.build((None, None, i))
        self.attention_layer_norm.build((None, None, h))
        self.output_layer_norm.build((None, None, h))

    def _heads(self, x):
        batch, seq = ops.shape(x)[0], ops.shape(x)[1]
        x = ops.reshape(x, (batch, seq, self.num_heads, self.head_size))
        return ops.transpose(x, (0, 2, 1, 3))  # [batch, heads, seq, head_size]

    def call(self, inputs, training=False):
        hidden, input_mask = inputs
        q, k, v = (self._heads(f(hidden)) for f in (self.query, self.key, self.value))
        scores = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))) / math.sqrt(self.head_size)
        # Google's attention mask: -10000 on padding keys (not -inf: fully padded rows
        # stay finite).
        bias = (1.0 - ops.cast(input_mask, scores.dtype)[:, None, None, :]) * -10000.0
        probs = self.attention_dropout(ops.softmax(scores + bias, axis=-1), training=training)
        context = ops.transpose(ops.matmul(probs, v), (0, 2, 1, 3))
        batch, seq = ops.shape(hidden)[0], ops.shape(hidden)[1]
        context = ops.reshape(context, (batch, seq, self.config.hidden_size))
        attended = self.hidden_dropout(self.attention_output(context), training=training)
        attended = self.attention_layer_norm(attended + hidden)
        ffn = self.output_dense(self.intermediate(attended))
        ffn = self.hidden_dropout(ffn, training=training)
        return self.output_layer_norm(ffn + attended)

    def compute_output_shape(self, input_shape):
        return input_shape[0]

    def get_config(self):
        return {**super().get_config(), "config": dataclasses.asdict(self.config)}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        return cls(BertConfig(**config.pop("config")), **config)


def stage_of_layer(layer_index: int, num_layers: int, num_stages: int) -> int:
    """The stage of encoder layer `layer_index`: contiguous, as equal as possible."""
    return layer_index * num_stages // num_layers


def build_squad_model(config: BertConfig, max_seq_length: int, num_stages: int = 1) -> keras.Model:
    """BERT + SQuAD head: inputs `input_ids`, `input_mask`, `segment_ids` [batch, seq];
    outputs {"start_logits", "end_logits"} [batch, seq].

    With `num_stages > 1` the model is built under `epl.replicate` scopes, one per stage:
    the embeddings join the first stage, the QA head the last, and the encoder layers
    are divided evenly between them (EPL's BERT recipe). Build it after `epl.init()`.
    """
    if max_seq_length > config.max_position_embeddings:
        raise ValueError(
            "max_seq_length exceeds the model's position embeddings. Received: "
            f"max_seq_length={max_seq_length}, "
            f"max_position_embeddings={config.max_position_embeddings}"
        )
    if not 1 <= num_stages <= config.num_hidden_layers:
        raise ValueError(
            "num_stages must be between 1 and the number of encoder layers. Received: "
            f"num_stages={num_stages}, num_hidden_layers={config.num_hidden_layers}"
        )
    input_ids = keras.Input((max_seq_length,), dtype="int32", name="input_ids")
    input_mask = keras.Input((max_seq_length,), dtype="int32", name="input_mask")
    segment_ids = keras.Input((max_seq_length,), dtype="int32", name="segment_ids")

    def scope(stage: int):
        if num_stages == 1:
            return contextlib.nullcontext()
        return epl.replicate(device_count=1, name=f"stage_{stage}")

    stage_layers: list[list[int]] = [[] for _ in range(num_stages)]
    for i in range(config.num_hidden_layers):
        stage_layers[stage_of_layer(i, config.num_hidden_layers, num_stages)].append(i)
    hidden = None
    for stage, layer_indices in enumerate(stage_layers):
        with scope(stage):
            if stage == 0:
                hidden = BertEmbeddings(config, name="embeddings")([input_ids, segment_ids])
            for i in layer_indices:
                hidden = TransformerLayer(config, name=f"layer_{i}")([hidden, input_mask])
            if stage == num_stages - 1:
                logits = _dense(config, 2, "qa_outputs")(hidden)
                start_logits = keras.layers.Lambda(lambda t: t[..., 0], name="start_logits")(logits)
                end_logits = keras.layers.Lambda(lambda t: t[..., 1], name="end_logits")(logits)
    return keras.Model(
        {"input_ids": input_ids, "input_mask": input_mask, "segment_ids": segment_ids},
        {"start_logits": start_logits, "end_logits": end_logits},
        name="bert_squad",
    )
