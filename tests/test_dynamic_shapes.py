"""Models whose gradients have no static shape: attention stacks, dynamic sequence lengths.

The fused all-reduce sized its buckets with `int(shape.num_elements())`, which is None
for such gradients (TypeError); both cases below crashed.
"""

import keras
import numpy as np
import tensorflow as tf
from _models import max_weight_difference

import epl_trainer as epl

ATOL = 1e-5
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def attention_stack(seed=0, vocab=64, dim=32, blocks=4, classes=5):
    """Embedding -> blocks of MultiHeadAttention + Add + LayerNorm + FFN -> pool -> Dense."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    embedded = keras.layers.Embedding(vocab, dim, name="embedding")(tokens)
    h = embedded
    for b in range(blocks):
        attended = keras.layers.MultiHeadAttention(4, 8, name=f"block_{b}_attention")(h, h)
        h = keras.layers.LayerNormalization(name=f"block_{b}_norm")(
            keras.layers.Add(name=f"block_{b}_add")([h, attended])
        )
        h = keras.layers.Dense(dim, activation="relu", name=f"block_{b}_ffn")(h)
    h = keras.layers.Add(name="skip")([h, embedded])
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(tokens, keras.layers.Dense(classes, name="head")(h))


def token_data(n=32, length=7, vocab=64, classes=5, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, vocab, size=(n, length)).astype("int32")
    return x, (x[:, 0] % classes).astype("int32")


def _reference(model, x, y, optimizer, batch_size, steps):
    model.compile(optimizer=optimizer, loss=LOSS)
    model.fit(x, y, batch_size=batch_size, steps_per_epoch=steps, shuffle=False, verbose=0)


def test_attention_pipeline_on_four_devices_with_micro_batches():
    x, y = token_data()
    reference = attention_stack()
    _reference(reference, x, y, keras.optimizers.SGD(0.1), batch_size=16, steps=2)
    model = attention_stack()
    trainer = epl.EPLTrainer(
        model,
        LOSS,
        keras.optimizers.SGD(0.1),
        stages={"embedding|block_[01]_.*": 0, "block_[23]_.*|skip|pool|head": 1},
        config={"cluster.virtual_devices": 4, "pipeline.num_micro_batch": 2},
    )
    trainer.fit(x, y, batch_size=16, steps_per_epoch=2, verbose=0, shuffle=False)
    assert trainer.plan.num_taskgraphs == 2 and trainer.plan.num_replicas == 2
    assert max_weight_difference(reference, model) < ATOL


def dict_transformer(seed=0, vocab=50, dim=16, classes=3):
    """A small BERT-like encoder: dict inputs (ids, mask), any sequence length."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((None,), dtype="int32", name="input_ids")
    mask = keras.Input((None,), dtype="int32", name="attention_mask")
    h = keras.layers.Embedding(vocab, dim, name="tokens")(ids)
    attention_mask = keras.layers.Lambda(
        lambda m: tf.cast(m[:, None, :], "bool"), name="to_attention_mask"
    )(mask)
    attended = keras.layers.MultiHeadAttention(2, 8, name="attention")(
        h, h, attention_mask=attention_mask
    )
    h = keras.layers.LayerNormalization(name="norm")(h + attended)
    h = keras.layers.Dense(dim, activation="gelu", name="ffn")(h)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h, mask=mask)
    return keras.Model({"input_ids": ids, "attention_mask": mask}, keras.layers.Dense(classes)(h))


def dict_batches(lengths=(5, 9, 7), batch=8, vocab=50, classes=3, seed=0):
    """Batches of different sequence lengths, padded with mask 0."""
    rng = np.random.default_rng(seed)
    out = []
    for length in lengths:
        ids = rng.integers(1, vocab, size=(batch, length)).astype("int32")
        mask = np.ones_like(ids)
        mask[:, length - 2 :] = 0
        out.append(({"input_ids": ids, "attention_mask": mask}, ids[:, 0] % classes))
    return out


def _dataset(batches):
    def generate():
        yield from batches

    spec = (
        {
            "input_ids": tf.TensorSpec((None, None), tf.int32),
            "attention_mask": tf.TensorSpec((None, None), tf.int32),
        },
        tf.TensorSpec((None,), tf.int64),
    )
    return tf.data.Dataset.from_generator(generate, output_signature=spec)


def test_dict_input_transformer_with_dynamic_length_under_data_parallelism():
    batches = dict_batches()
    reference = dict_transformer()
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss=LOSS)
    reference.fit(_dataset(batches), verbose=0, shuffle=False)
    model = dict_transformer()
    trainer = epl.EPLTrainer(
        model, LOSS, keras.optimizers.Adam(0.01), config={"cluster.virtual_devices": 2}
    )
    trainer.fit(_dataset(batches), verbose=0)
    assert trainer.plan.num_replicas == 2
    assert max_weight_difference(reference, model) < ATOL
