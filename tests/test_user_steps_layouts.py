"""A model's own train_step under a Keras layout map (issue 47): each device holds its
blocks of the sharded variables, the user's step reads them gathered on use, and the
result equals plain Keras `fit` on one device, with the user's optimizer holding the
trained state afterwards (core/engine/user_steps.py, "Variables held in blocks").

Before, EPLTrainer refused the combination ("the model overrides train_step; with
split TaskGraphs ... variables gathered on use").
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import epl_trainer as epl

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.1), "adam": lambda: keras.optimizers.Adam(0.01)}
# SGD: another summation order only (3e-8 measured); Adam turns those last bits into
# whole steps of lr.
ATOL = {"sgd": 1e-6, "adam": 2e-5}
BATCH, STEPS = 16, 4


@pytest.fixture(autouse=True)
def _no_global_distribution():
    yield
    keras.distribution.set_distribution(None)


class HalvedGradients(keras.Model):
    """Keras's guide's train_step with its gradients halved (the default step differs),
    reading the model twice (a metric pass after the update)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip([g * 0.5 for g in grads], self.trainable_variables))
        return self.compute_metrics(x, y, self(x), sample_weight=None)


def _model(seed=0):
    """x -> up (Dense 16, relu) -> down (Dense 8, tanh) -> logits (Dense 3)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,), name="x")
    h = keras.layers.Dense(16, activation="relu", name="up")(inputs)
    h = keras.layers.Dense(8, activation="tanh", name="down")(h)
    return HalvedGradients(inputs, keras.layers.Dense(3, name="logits")(h))


def _data(n=BATCH * STEPS):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n).astype("int32")


def _layouts(shape, over_batch=False):
    """up and down as a Megatron pair would lay them out; with `over_batch` down's
    kernel also over the batch axis (KerasHub's maps shard over both)."""
    devices = keras.distribution.list_devices()[: int(np.prod(shape))]
    mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")
    layout_map["up/bias"] = ("model",)
    layout_map["down/kernel"] = ("model", "batch") if over_batch else ("model", None)
    layout_map["logits/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(layout_map=layout_map)


def _reference(optimizer, x, y):
    model = _model()
    model.compile(optimizer=OPTIMIZERS[optimizer](), loss=LOSS)
    model.fit(x, y, batch_size=BATCH, steps_per_epoch=STEPS, shuffle=False, verbose=0)
    return model


def _max_difference(a, b):
    return max(float(np.abs(u - v).max()) for u, v in zip(a, b))


def _slots(optimizer):
    """The optimizer's variables but its learning rate, by name."""
    return {v.name: np.array(v) for v in optimizer.variables if v.name != "learning_rate"}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("shape, over_batch", [((1, 2), False), ((2, 2), True)])
def test_own_train_step_under_a_layout_map_equals_keras(shape, over_batch, optimizer):
    x, y = _data()
    reference = _reference(optimizer, x, y)
    model = _model()
    model.compile(optimizer=OPTIMIZERS[optimizer](), loss=LOSS)
    trainer = epl.EPLTrainer(model, strategy=_layouts(shape, over_batch))
    assert "own steps read every sharded variable gathered on use" in str(trainer.plan)
    trainer.fit(x, y, batch_size=BATCH, steps_per_epoch=STEPS, shuffle=False, verbose=0)
    placement = trainer.placement()
    whole = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    assert len(placement) == int(np.prod(shape)) and max(placement.values()) < 0.75 * whole
    assert _max_difference(reference.get_weights(), model.get_weights()) < ATOL[optimizer]
    # The user's optimizer holds the trained state (model.save writes it): its step count
    # and, blocks joined, its slots.
    assert int(model.optimizer.iterations) == STEPS
    expected, got = _slots(reference.optimizer), _slots(model.optimizer)
    assert expected.keys() == got.keys()
    assert (
        _max_difference([expected[k] for k in expected], [got[k] for k in expected])
        < (ATOL[optimizer])
    )


def test_training_continues_from_the_users_optimizer_state():
    """A second fit starts from the state the first left in the user's optimizer (the
    lanes' blocks of Adam's slots are cut from it again), as one longer Keras fit."""
    x, y = _data(BATCH * STEPS * 2)
    reference = _model()
    reference.compile(optimizer=OPTIMIZERS["adam"](), loss=LOSS)
    reference.fit(x, y, batch_size=BATCH, epochs=2, steps_per_epoch=STEPS, shuffle=False, verbose=0)
    model = _model()
    model.compile(optimizer=OPTIMIZERS["adam"](), loss=LOSS)
    for epoch in range(2):
        trainer = epl.EPLTrainer(model, strategy=_layouts((1, 2)))
        trainer.fit(
            x[epoch * BATCH * STEPS :],
            y[epoch * BATCH * STEPS :],
            batch_size=BATCH,
            steps_per_epoch=STEPS,
            shuffle=False,
            verbose=0,
        )
    assert int(model.optimizer.iterations) == 2 * STEPS
    assert _max_difference(reference.get_weights(), model.get_weights()) < ATOL["adam"]


def test_a_factored_optimizer_is_refused_for_variables_held_in_blocks():
    x, y = _data()
    model = _model()
    model.compile(optimizer=keras.optimizers.Adafactor(0.01), loss=LOSS)
    trainer = epl.EPLTrainer(model, strategy=_layouts((1, 2)))
    with pytest.raises(ValueError, match=r"factored moments \(velocity_(row|col)\) of up/kernel"):
        trainer.fit(x, y, batch_size=BATCH, steps_per_epoch=1, shuffle=False, verbose=0)


def test_a_kerashub_causal_lm_with_its_own_compute_loss_and_layout_map_equals_keras():
    """GemmaCausalLM with a z-loss of its own (`compute_loss`, run by Keras's default
    train_step) under `GemmaBackbone.get_layout_map` on (2, 2): blocks over both axes,
    the tied token table read by lookups (its gradient rows, gathered), 4 SGD steps
    where Keras's `fit` on one device ends."""
    keras_hub = pytest.importorskip("keras_hub")

    class ZLossGemma(keras_hub.models.GemmaCausalLM):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            loss = super().compute_loss(x, y, y_pred, sample_weight, training)
            return loss + 1e-2 * tf.reduce_mean(tf.math.reduce_logsumexp(y_pred, axis=-1) ** 2)

    def make():
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=64,
            num_layers=2,
            num_query_heads=2,
            num_key_value_heads=2,
            hidden_dim=16,
            intermediate_dim=64,
            head_dim=4,
        )
        model = ZLossGemma(backbone, preprocessor=None)
        model.compile(optimizer=OPTIMIZERS["sgd"](), loss=LOSS)
        return model

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 64, (32, 9)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((32, 8), bool)}
    y = tokens[:, 1:]
    reference = make()
    reference.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    model = make()
    devices = keras.distribution.list_devices()[:4]
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices)
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    strategy = keras.distribution.ModelParallel(layout_map=layout_map)
    trainer = epl.EPLTrainer(model, strategy=strategy)
    assert "token_embedding/embeddings" in str(trainer.plan)
    trainer.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert _max_difference(reference.get_weights(), model.get_weights()) < 1e-5
    total = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    assert max(trainer.placement().values()) < 0.5 * total


def test_a_gan_with_two_optimizers_under_a_layout_map_equals_keras():
    """Keras's GAN pattern (test_user_steps.py's GAN): the generator's kernel laid out by
    column, the critic's by row, on (1, 2). Each optimizer's lane copies update their
    blocks, and both user optimizers end with Keras's step counts and Adam slots."""
    from test_user_steps import _gan

    rng = np.random.default_rng(2)
    noise = rng.normal(size=(32, 4)).astype("float32")
    real = rng.normal(size=(32, 6)).astype("float32")
    reference = _gan("adam")
    reference.fit(noise, real, batch_size=8, epochs=2, shuffle=False, verbose=0)
    gan = _gan("adam")
    devices = keras.distribution.list_devices()[:2]
    layout_map = keras.distribution.LayoutMap(
        keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices)
    )
    layout_map[gan.generator.layers[0].kernel.path] = (None, "model")
    layout_map[gan.critic.layers[0].kernel.path] = ("model", None)
    trainer = epl.EPLTrainer(gan, strategy=keras.distribution.ModelParallel(layout_map=layout_map))
    trainer.fit(noise, real, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert "gathered on use (held sharded)" in str(trainer.plan)
    assert _max_difference(reference.get_weights(), gan.get_weights()) < ATOL["adam"]
    for name in ("c_optimizer", "g_optimizer"):
        # In build order (the two models' layers are named apart).
        expected, got = _slots(getattr(reference, name)), _slots(getattr(gan, name))
        assert int(getattr(gan, name).iterations) == 8 and len(got) == len(expected) > 2
        assert _max_difference(list(expected.values()), list(got.values())) < ATOL["adam"]
