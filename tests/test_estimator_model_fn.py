"""EPL's Estimator-style `model_fn(features, labels, mode, params)` ports with few changes."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _models import max_weight_difference

import epl_trainer as epl

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
ATOL = 1e-5


def data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    features = {
        "dense": rng.normal(size=(n, 5)).astype("float32"),
        "extra": rng.normal(size=(n, 3)).astype("float32"),
    }
    labels = (features["dense"][:, 0] > 0).astype("int32") + (features["extra"][:, 0] > 0)
    return features, labels.astype("int32")


def layers(params):
    """Constructed in one order, so seeds match between the Keras and EPL models."""
    return (
        keras.layers.Dense(params["hidden"], activation="relu", name="encoder"),
        keras.layers.Dense(3, name="head"),
    )


def keras_model(params, seed=0):
    keras.utils.set_random_seed(seed)
    encoder, head = layers(params)
    dense = keras.Input((5,), name="dense")
    extra = keras.Input((3,), name="extra")
    joined = keras.layers.Concatenate(name="join")([dense, extra])
    return keras.Model({"dense": dense, "extra": extra}, head(encoder(joined)))


def estimator_model_fn(features, labels, mode, params):
    """What an EPL program's model_fn looks like: scopes around its stages."""
    seen.append((mode, None if labels is None else tuple(labels.shape)))
    encoder, head = layers(params)
    with epl.replicate(1, name="stage_0"):
        joined = keras.layers.Concatenate(name="join")([features["dense"], features["extra"]])
        hidden = encoder(joined)
    with epl.replicate(1, name="stage_1"):
        logits = head(hidden)
    return epl.ModelSpec(logits, loss=LOSS, optimizer=keras.optimizers.Adam(0.01))


seen = []


def test_estimator_model_fn_trains_like_the_same_keras_model():
    params = {"hidden": 16}
    x, y = data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    reference = keras_model(params)
    reference.compile(keras.optimizers.Adam(0.01), LOSS)
    reference.fit(dataset, epochs=2, verbose=0, shuffle=False)

    seen.clear()
    keras.utils.set_random_seed(0)
    trainer = epl.EPLTrainer(
        estimator_model_fn, params=params, config={"cluster.virtual_devices": 2}
    )
    trainer.fit(dataset, epochs=2, verbose=0)
    assert seen == [("train", (None,))]  # called once, at the first fit, with symbolic labels
    assert trainer.plan.num_taskgraphs == 2  # the scopes inside the model_fn were recorded
    assert isinstance(trainer.optimizer, keras.optimizers.Adam)  # from the ModelSpec
    assert max_weight_difference(reference, trainer.model) < ATOL
    np.testing.assert_allclose(
        trainer.predict(x, batch_size=16), reference.predict(x, verbose=0), atol=ATOL
    )


def test_estimator_model_fn_returning_outputs_is_built_at_predict_in_infer_mode():
    seen.clear()

    def model_fn(features, labels, mode, params):
        seen.append(mode)
        return keras.layers.Dense(2, name="out")(features)

    trainer = epl.EPLTrainer(model_fn, loss="mse", config={"cluster.virtual_devices": 1})
    out = trainer.predict(np.ones((4, 3), "float32"), batch_size=2)
    assert seen == ["infer"] and out.shape == (4, 2)


def test_estimator_model_fn_output_not_from_features_is_a_clear_error():
    def model_fn(features, labels, mode, params):
        return keras.layers.Dense(1)(labels)

    trainer = epl.EPLTrainer(model_fn, loss="mse", config={"cluster.virtual_devices": 1})
    x, y = np.ones((4, 3), "float32"), np.ones((4, 1), "float32")
    with pytest.raises(TypeError, match="output tensors computed from `features`"):
        trainer.fit(x, y, batch_size=2, verbose=0, shuffle=False)


def test_restore_before_the_first_fit_builds_the_model_from_features(tmp_path):
    params = {"hidden": 8}
    x, y = data(32)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    config = {"cluster.virtual_devices": 2}  # the model_fn's two stages
    trained = epl.EPLTrainer(estimator_model_fn, params=params, config=config)
    trained.fit(dataset, verbose=0)
    trained.save_checkpoint(str(tmp_path))
    restored = epl.EPLTrainer(estimator_model_fn, params=params, config=config)
    with pytest.raises(ValueError, match="needs `features`"):
        restored.restore_checkpoint(str(tmp_path))
    restored.restore_checkpoint(str(tmp_path), features={k: v[:16] for k, v in x.items()})
    assert max_weight_difference(trained.model, restored.model) == 0.0
