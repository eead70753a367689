"""A T5-style encoder-decoder whose feed-forward blocks are mixtures of experts.

Architecture (pre-norm, as T5): token embedding plus a learned absolute position
embedding (T5's relative position bias is not implemented: Keras's MultiHeadAttention
takes no additive bias), then per encoder layer

    x = x + SelfAttention(RMSNorm(x), padding mask)
    x = x + MoE(RMSNorm(x))

and per decoder layer

    y = y + SelfAttention(RMSNorm(y), causal mask)
    y = y + CrossAttention(RMSNorm(y), encoder output, source padding mask)
    y = y + MoE(RMSNorm(y))

with a final RMSNorm on each side and a linear head to the vocabulary. Every MoE is an
`epl_trainer.layers.MoE` built inside `epl.split()`, everything else under the default
`epl.replicate()`: with `cluster.colocate_split_and_replicate=True` the experts are
sharded over the devices of a replica and tokens travel to them by all-to-all (EPL's
MoE recipe). The decoder self-attention needs no padding mask: with the causal mask a
real position only sees earlier positions, which are never padding. Padding tokens do
pass through the MoE layers (routing sees every token of the batch), so they take
expert capacity and count in the balancing loss, as in a fixed-shape TPU-style T5 MoE.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
from keras import ops

import epl_trainer as epl
from epl_trainer.layers import MoE
from model_zoo.moe_t5.data import EOS_ID, PAD_ID


@dataclasses.dataclass(frozen=True)
class T5Config:
    """Sizes of the model and of its mixtures of experts.

    The MoE settings are the `moe_t5_small` recipe: 8 experts, top-2 (GShard) routing,
    capacity factor 1.25 when training and 2.0 when evaluating.
    """

    vocab_size: int
    d_model: int = 512
    num_heads: int = 8
    num_layers: int = 6  # encoder layers; the decoder has as many
    expert_hidden: int = 2048
    dropout: float = 0.1
    max_source_length: int = 512
    max_target_length: int = 128
    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    eval_capacity_factor: float = 2.0
    aux_loss_coef: float = 1e-2
    num_groups: int = 1  # routing groups of each MoE call (per device when split)

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_heads", "num_layers", "expert_hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int. Received: {name}={value!r}")
        if self.d_model % self.num_heads:
            raise ValueError(
                "d_model must divide by num_heads. "
                f"Received: d_model={self.d_model}, num_heads={self.num_heads}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1). Received: dropout={self.dropout!r}")


# T5-small's published sizes (d_model 512, 8 heads, 6+6 layers, d_ff 2048) with every
# FFN an MoE; and a size that trains in minutes on a 2-core CPU.
T5_SMALL = dict(d_model=512, num_heads=8, num_layers=6, expert_hidden=2048, dropout=0.1)
CPU_SMALL = dict(d_model=64, num_heads=4, num_layers=2, expert_hidden=128, dropout=0.0)


@keras.saving.register_keras_serializable(package="model_zoo.moe_t5")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each position to `[batch, length, d]` inputs."""

    def __init__(self, max_length: int, **kwargs):
        super().__init__(**kwargs)
        self.max_length = max_length

    def build(self, input_shape):
        self.embeddings = self.add_weight(
            shape=(self.max_length, input_shape[-1]),
            initializer=keras.initializers.RandomNormal(stddev=0.02),
            name="embeddings",
        )

    def call(self, inputs):
        length = ops.shape(inputs)[1]
        return inputs + ops.cast(self.embeddings[:length], inputs.dtype)[None]

    def get_config(self):
        return {**super().get_config(), "max_length": self.max_length}


@keras.saving.register_keras_serializable(package="model_zoo.moe_t5")
class KeyPaddingMask(keras.layers.Layer):
    """`[batch, query_length, key_length]` bool: True where the key token is not padding.

    A layer (not a bare `ops` call) so the mask is an ordinary node of the functional
    graph, annotated with the default strategy like the rest of the model.
    """

    def call(self, query_tokens, key_tokens):
        keys = ops.not_equal(key_tokens, PAD_ID)[:, None, :]
        return ops.broadcast_to(
            keys, (ops.shape(key_tokens)[0], ops.shape(query_tokens)[1], ops.shape(keys)[2])
        )


def build_model(config: T5Config, seed: int = 0, split_devices: int | None = None) -> keras.Model:
    """The functional MoE-T5 model: {"encoder_tokens", "decoder_tokens"} -> logits.

    Call after `epl.init(...)`: the MoE layers are recorded under
    `epl.split(split_devices)` and the rest under the default `epl.replicate()`, which
    (colocated) takes the split's width. `split_devices=None` lets the split span every
    device of the job; with several workers pass the devices per worker, since a model
    replica must fit in one worker (data parallelism then runs across the workers).
    Each MoE layer object is called once (the split engine shards one call site per
    layer).
    """
    keras.utils.set_random_seed(seed)
    epl.set_default_strategy(epl.replicate())
    c = config
    encoder_tokens = keras.Input((c.max_source_length,), dtype="int32", name="encoder_tokens")
    decoder_tokens = keras.Input((c.max_target_length,), dtype="int32", name="decoder_tokens")
    embed = keras.layers.Embedding(c.vocab_size, c.d_model, name="shared_embedding")

    x = PositionEmbedding(c.max_source_length, name="encoder_positions")(embed(encoder_tokens))
    x = _maybe_dropout(c, "encoder_input_dropout", x)
    source_mask = KeyPaddingMask(name="encoder_mask")(encoder_tokens, encoder_tokens)
    for i in range(c.num_layers):
        name = f"encoder_{i}"
        h = _norm(f"{name}_attention_norm")(x)
        h = _attention(c, f"{name}_self_attention")(h, h, attention_mask=source_mask)
        x = _residual(c, f"{name}_attention", x, h)
        x = _residual(c, f"{name}_moe", x, _moe_block(c, name, x, split_devices))
    encoded = _norm("encoder_final_norm")(x)

    y = PositionEmbedding(c.max_target_length, name="decoder_positions")(embed(decoder_tokens))
    y = _maybe_dropout(c, "decoder_input_dropout", y)
    cross_mask = KeyPaddingMask(name="cross_mask")(decoder_tokens, encoder_tokens)
    for i in range(c.num_layers):
        name = f"decoder_{i}"
        h = _norm(f"{name}_self_attention_norm")(y)
        h = _attention(c, f"{name}_self_attention")(h, h, use_causal_mask=True)
        y = _residual(c, f"{name}_self_attention", y, h)
        h = _norm(f"{name}_cross_attention_norm")(y)
        h = _attention(c, f"{name}_cross_attention")(h, encoded, attention_mask=cross_mask)
        y = _residual(c, f"{name}_cross_attention", y, h)
        y = _residual(c, f"{name}_moe", y, _moe_block(c, name, y, split_devices))
    y = _norm("decoder_final_norm")(y)
    logits = keras.layers.Dense(c.vocab_size, name="logits")(y)
    return keras.Model(
        {"encoder_tokens": encoder_tokens, "decoder_tokens": decoder_tokens},
        logits,
        name="moe_t5",
    )


def _moe_block(c: T5Config, name: str, x, split_devices: int | None):
    h = _norm(f"{name}_moe_norm")(x)
    with epl.split(split_devices):  # experts sharded across the replica's devices
        return MoE(
            c.num_experts,
            c.expert_hidden,
            top_k=c.top_k,
            capacity_factor=c.capacity_factor,
            eval_capacity_factor=c.eval_capacity_factor,
            aux_loss_coef=c.aux_loss_coef,
            num_groups=c.num_groups,
            name=f"{name}_moe",
        )(h)


def _norm(name: str):
    return keras.layers.RMSNormalization(epsilon=1e-6, name=name)


def _attention(c: T5Config, name: str):
    return keras.layers.MultiHeadAttention(
        c.num_heads, c.d_model // c.num_heads, dropout=c.dropout, name=name
    )


def _maybe_dropout(c: T5Config, name: str, x):
    return keras.layers.Dropout(c.dropout, name=name)(x) if c.dropout else x


def _residual(c: T5Config, name: str, x, h):
    h = _maybe_dropout(c, f"{name}_dropout", h)
    return keras.layers.Add(name=f"{name}_residual")([x, h])


def moe_layers(model: keras.Model) -> list[MoE]:
    return [layer for layer in model.layers if isinstance(layer, MoE)]


# ---- loss and metric -----------------------------------------------------------------------


@keras.saving.register_keras_serializable(package="model_zoo.moe_t5")
class SequenceCrossEntropy(keras.losses.Loss):
    """Sparse cross-entropy from logits, averaged over each sequence's non-pad tokens.

    One value per sequence (`[batch, length]` labels and `[batch, length, vocab]` logits
    give `[batch]`), then the batch mean. Per-sequence values (rather than Keras's
    `ignore_class`, which averages over a whole batch's tokens) keep two properties the
    trainer relies on: the mean over equal data-parallel shards equals the mean over
    the global batch, and an all-pad row (evaluation pads the last batch) weighs 0.
    """

    def __init__(self, name="sequence_cross_entropy", **kwargs):
        super().__init__(name=name, **kwargs)

    def call(self, y_true, y_pred):
        y_true = ops.cast(y_true, "int32")
        per_token = keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
        mask = ops.cast(ops.not_equal(y_true, PAD_ID), per_token.dtype)
        return ops.sum(per_token * mask, axis=-1) / ops.maximum(ops.sum(mask, axis=-1), 1.0)


@keras.saving.register_keras_serializable(package="model_zoo.moe_t5")
class TokenAccuracy(keras.metrics.Mean):
    """Share of non-pad target tokens whose argmax prediction is right.

    A `sample_weight` of shape `[batch]` (evaluation's padding-row mask) weights whole
    rows on top of the pad mask.
    """

    def __init__(self, name="token_accuracy", **kwargs):
        super().__init__(name=name, **kwargs)

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_true = ops.cast(y_true, "int32")
        weights = ops.cast(ops.not_equal(y_true, PAD_ID), "float32")
        if sample_weight is not None:
            weights = weights * ops.reshape(ops.cast(sample_weight, "float32"), (-1, 1))
        predicted = ops.cast(ops.argmax(y_pred, axis=-1), "int32")
        matches = ops.cast(ops.equal(predicted, y_true), "float32")
        return super().update_state(matches, sample_weight=weights)


# ---- reporting -----------------------------------------------------------------------------


def router_statistics(model: keras.Model, features) -> dict[str, float]:
    """How the MoE layers route one batch, from the Keras model's current weights.

    Returns:
      aux_loss: sum over MoE layers of `aux_loss_coef * balance`, the auxiliary term the
        trainer adds to the objective (equal to `sum(model.losses)` after a forward pass).
      router_balance: mean over layers of the raw balance `num_experts * sum_e f_e * P_e`
        (1.0 = perfectly uniform routing, num_experts = everything to one expert).
      dropped_train / dropped_eval: mean share of token-to-expert assignments over
        capacity (dropped) at the training and the evaluation capacity factor.
    """
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"Model {model.name!r} has no MoE layer.")
    # Each MoE layer is called once, so `layer.input` is its one input tensor.
    moe_inputs = keras.Model(model.input, [layer.input for layer in layers])(features)
    stats = {"aux_loss": 0.0, "router_balance": 0.0, "dropped_train": 0.0, "dropped_eval": 0.0}
    for layer, x in zip(layers, moe_inputs):
        tokens = ops.reshape(x, (layer.num_groups, -1, x.shape[-1]))
        train, evaluation = (layer.route(tokens, training=t) for t in (True, False))
        stats["aux_loss"] += layer.aux_loss_coef * float(train.aux_loss)
        stats["router_balance"] += float(train.aux_loss) / len(layers)
        stats["dropped_train"] += float(train.dropped_fraction) / len(layers)
        stats["dropped_eval"] += float(evaluation.dropped_fraction) / len(layers)
    return stats


class RouterStatisticsLogger(keras.callbacks.Callback):
    """Adds `router_statistics` of a fixed batch (aux_loss, router_balance, dropped
    shares) to each epoch's logs, so History and a later TensorBoard callback record them.

    The trainer writes the trained weights back to the Keras model before
    `on_epoch_end`; this callback reads them from there.
    """

    def __init__(self, features):
        super().__init__()
        self.features = features

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs.update(router_statistics(self.model, self.features))


def greedy_decode(predict_fn, encoder_tokens, max_target_length: int):
    """Greedy decoding: `[n, max_target_length]` ids, one position per model call.

    `predict_fn({"encoder_tokens", "decoder_tokens"}) -> [n, length, vocab]` logits,
    e.g. `lambda x: trainer.predict(x, batch_size=n)` (the distributed program, experts
    sharded as in training). The decoder input starts as all `<pad>` (the start token)
    and position t+1 receives the argmax at position t; causal attention makes position
    t's logits independent of later positions. A row is `<pad>` after its `</s>`;
    decoding stops once every row has one.
    """
    encoder_tokens = np.asarray(encoder_tokens)
    n = encoder_tokens.shape[0]
    decoder = np.full((n, max_target_length), PAD_ID, np.int32)
    output = np.full((n, max_target_length), PAD_ID, np.int32)
    finished = np.zeros(n, bool)
    for t in range(max_target_length):
        logits = predict_fn({"encoder_tokens": encoder_tokens, "decoder_tokens": decoder})
        output[:, t] = np.where(finished, PAD_ID, np.asarray(logits)[:, t].argmax(axis=-1))
        finished |= output[:, t] == EOS_ID
        if finished.all():
            break
        if t + 1 < max_target_length:
            decoder[:, t + 1] = output[:, t]
    return output
