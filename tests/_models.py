"""Small models and data shared by the engine tests, plus the plain-Keras reference."""

import keras
import numpy as np

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class TiedLogits(keras.layers.Layer):
    """Logits from another layer's embedding matrix (a weight tied across two layers)."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.transpose(self.embedding.embeddings))


def adam_trainer(model, devices, optimizer=None, stages=None, **config):
    """An EPLTrainer on `devices` logical devices (Adam 0.01 unless `optimizer`), with the
    config keys given as keyword arguments (`**{"zero.level": "v1"}`)."""
    import epl_trainer as epl

    return epl.EPLTrainer(
        model,
        LOSS,
        optimizer or keras.optimizers.Adam(0.01),
        stages=stages,
        config={"cluster.virtual_devices": devices, **config},
    )


def parity_model(seed: int = 1) -> keras.Model:
    """Dense, Conv, LayerNormalization and Embedding in one functional model."""
    keras.utils.set_random_seed(seed)
    image = keras.Input((8, 8, 2), name="image")
    tokens = keras.Input((5,), dtype="int32", name="tokens")
    a = keras.layers.Conv2D(4, 3, activation="relu", name="conv")(image)
    a = keras.layers.GlobalAveragePooling2D(name="pool_image")(a)
    b = keras.layers.Embedding(20, 4, name="embed")(tokens)
    b = keras.layers.GlobalAveragePooling1D(name="pool_tokens")(b)
    h = keras.layers.Concatenate(name="concat")([a, b])
    h = keras.layers.Dense(16, activation="tanh", name="hidden")(h)
    h = keras.layers.LayerNormalization(name="norm")(h)
    out = keras.layers.Dense(3, name="logits")(h)
    return keras.Model({"image": image, "tokens": tokens}, out)


def parity_data(n: int = 96, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = {
        "image": rng.normal(size=(n, 8, 8, 2)).astype("float32"),
        "tokens": rng.integers(0, 20, size=(n, 5)).astype("int32"),
    }
    y = rng.integers(0, 3, size=(n,)).astype("int32")
    return x, y


def mlp(seed: int = 0, width: int = 16, dropout: float = 0.0, batchnorm: bool = False):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,), name="x")
    h = keras.layers.Dense(width, activation="relu", name="dense_in")(inputs)
    if batchnorm:
        h = keras.layers.BatchNormalization(name="bn")(h)
    if dropout:
        h = keras.layers.Dropout(dropout, name="drop")(h)
    out = keras.layers.Dense(3, name="logits")(h)
    return keras.Model(inputs, out)


def mlp_data(n: int = 64, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n).astype("int32")


def keras_reference(model, x, y, optimizer, batch_size, steps, epochs=1, callbacks=None):
    """Plain single-device Keras `fit` on the same batches, in order."""
    model.compile(optimizer=optimizer, loss=LOSS)
    return model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=epochs,
        steps_per_epoch=steps,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )


def max_weight_difference(a: keras.Model, b: keras.Model) -> float:
    return max(float(np.abs(u - v).max()) for u, v in zip(a.get_weights(), b.get_weights()))
