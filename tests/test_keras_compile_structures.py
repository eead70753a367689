"""compile()'s loss / metrics / loss_weights structures are matched to the model's outputs
as Keras matches them (its own `CompileLoss` / `CompileMetrics`): the same log keys and
values as plain Keras `fit`, and Keras's errors for structures that do not match."""

import keras
import numpy as np
import pytest

import epl_trainer

DP = {"cluster.virtual_devices": 2}


def _two_outputs(dict_outputs=False):
    keras.utils.set_random_seed(0)
    x = keras.Input(shape=(3,), name="input_a")
    a = keras.layers.Dense(1, name="output_a")(x)
    b = keras.layers.Dense(1, name="output_b", activation="sigmoid")(x)
    outputs = {"output_a": a, "output_b": b} if dict_outputs else [a, b]
    return keras.Model(x, outputs)


def _data():
    rng = np.random.default_rng(1)
    x = rng.random((8, 3)).astype("float32")
    y1 = rng.random((8, 1)).astype("float32")
    y2 = rng.integers(0, 2, (8, 1)).astype("float32")
    return x, y1, y2


def _fit_both(make_model, compile_kwargs, y, config=DP, epochs=2, batch_size=4):
    """(plain Keras history, trainer history, plain weights, trainer weights)."""
    x = _data()[0]
    fit = dict(batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    reference = make_model()
    reference.compile(optimizer=keras.optimizers.SGD(0.1), **compile_kwargs)
    expected = reference.fit(x, y, **fit)
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.1), **compile_kwargs)
    trainer = epl_trainer.EPLTrainer(model, config=dict(config))
    got = trainer.fit(x, y, **fit)
    return expected.history, got.history, reference.get_weights(), model.get_weights()


def _assert_same(expected, got, ref_weights, weights):
    assert sorted(got) == sorted(expected)
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for a, b in zip(ref_weights, weights):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_metric_per_output_is_named_by_its_output():
    _, y1, y2 = _data()
    results = _fit_both(
        _two_outputs,
        dict(loss="mean_squared_error", metrics=["mean_squared_error", "mean_squared_error"]),
        (y1, y2),
    )
    assert "output_a_mean_squared_error" in results[1]
    assert "output_b_mean_squared_error" in results[1]
    _assert_same(*results)


def test_dict_losses_weights_and_per_output_loss_logs():
    _, y1, y2 = _data()
    results = _fit_both(
        _two_outputs,
        dict(
            loss={"output_a": "mean_squared_error", "output_b": "binary_crossentropy"},
            loss_weights={"output_a": 0.5, "output_b": 2.0},
            metrics={"output_b": ["mean_squared_error", "accuracy"]},
        ),
        (y1, y2),
    )
    assert {"loss", "output_a_loss", "output_b_loss", "output_b_accuracy"} <= set(results[1])
    _assert_same(*results)


def test_per_output_losses_over_micro_batches_and_an_odd_batch():
    """Each output's own loss is reduced as the total loss: micro-batches, replicas and
    rows added to fill a batch of 5 change neither."""
    _, y1, y2 = _data()
    config = {**DP, "pipeline.num_micro_batch": 2}
    results = _fit_both(
        _two_outputs,
        dict(loss=["mse", "bce"], loss_weights=[2.0, 0.5]),
        (y1, y2),
        config=config,
        batch_size=5,
    )
    assert sorted(results[1]) == ["loss", "output_a_loss", "output_b_loss"]
    _assert_same(*results)


def test_nested_list_metrics_and_abbreviations():
    _, y1, y2 = _data()
    results = _fit_both(
        _two_outputs,
        dict(
            loss=["mse", "bce"],
            metrics=[["mean_squared_error", "accuracy"], ["bce", "mse", "mae"]],
        ),
        (y1, y2),
    )
    assert {"output_a_accuracy", "output_b_bce", "output_b_mae"} <= set(results[1])
    _assert_same(*results)


def test_dict_outputs_with_dict_labels():
    _, y1, y2 = _data()
    results = _fit_both(
        lambda: _two_outputs(dict_outputs=True),
        dict(loss={"output_a": "mse", "output_b": "bce"}, metrics={"output_a": ["mae"]}),
        {"output_a": y1, "output_b": y2},
    )
    _assert_same(*results)


def test_evaluate_returns_keras_logs_with_an_odd_batch():
    x, y1, y2 = _data()
    kwargs = dict(loss=["mse", "bce"], metrics=["mae", "mae"])
    reference = _two_outputs()
    reference.compile(optimizer="sgd", **kwargs)
    expected = reference.evaluate(x, (y1, y2), batch_size=5, verbose=0, return_dict=True)
    model = _two_outputs()
    model.compile(optimizer="sgd", **kwargs)
    trainer = epl_trainer.EPLTrainer(model, config=dict(DP))
    got = trainer.evaluate(x, (y1, y2), batch_size=5, verbose=0, return_dict=True)
    assert sorted(got) == sorted(expected)
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, err_msg=key)


def test_loss_dict_with_unknown_keys_raises_keras_error():
    _, y1, y2 = _data()
    model = _two_outputs()
    model.compile(optimizer="sgd", loss={"output_a": "mse", "output_c": "mse"})
    trainer = epl_trainer.EPLTrainer(model, config=dict(DP))
    with pytest.raises(ValueError, match="Expected keys"):
        trainer.fit(_data()[0], (y1, y2), batch_size=4, verbose=0)


def test_compiled_without_loss_predicts_and_fit_raises_keras_error():
    x, y1, y2 = _data()
    model = _two_outputs()
    model.compile()
    trainer = epl_trainer.EPLTrainer(model, config=dict(DP))
    predicted = trainer.predict(x, batch_size=4, verbose=0)
    np.testing.assert_allclose(predicted[0], model.predict(x, verbose=0)[0], rtol=1e-6)
    with pytest.raises(ValueError, match="No loss to compute"):
        trainer.fit(x, (y1, y2), batch_size=4, verbose=0)


def _tuple_outputs():
    keras.utils.set_random_seed(0)
    x = keras.Input(shape=(3,), name="input_a")
    y1 = keras.layers.Dense(1, name="y1")(x)
    y2 = keras.layers.Dense(1, name="y2")(x)
    return keras.Model(x, (y1, y2))


def _struct_mae(y_true, y_pred):
    """A loss over a whole output structure, as Keras allows (the outputs' sum of MAE)."""
    assert isinstance(y_true, tuple) and isinstance(y_pred, tuple)
    total = 0
    for t, p in zip(keras.tree.flatten(y_true), keras.tree.flatten(y_pred)):
        total += keras.losses.mean_absolute_error(t, p)
    return total


def test_a_loss_over_a_structure_of_outputs_next_to_per_output_losses():
    _, y1, y2 = _data()
    loss = [_struct_mae, ("mse", "mae")]  # a list around a tuple output: each applies to it
    results = _fit_both(
        _tuple_outputs,
        dict(loss=loss, loss_weights=[0.3, (0.5, 2.0)]),
        (y1, y2),
    )
    assert sorted(results[1]) == ["loss", "y1_loss", "y1_y2_loss", "y2_loss"]
    _assert_same(*results)
