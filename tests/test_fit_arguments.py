"""`EPLTrainer.fit / evaluate / predict` take `keras.Model`'s arguments with their meaning.

Every expected value comes from plain Keras (`model.fit / evaluate / predict`) on the same
model, data and seed; the trainer runs data parallel on 2 devices, with SGD (a constant
factor would hide in Adam's normalisation). Batch sizes split evenly over the 2 lanes.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _models import LOSS, max_weight_difference, mlp, mlp_data

import epl_trainer as epl
from epl_trainer.training import data as data_lib
from epl_trainer.training import fit_inputs

ATOL = 1e-5
CLASS_WEIGHT = {0: 1.0, 1: 2.5, 2: 0.5}


def _trainer(model=None, metrics=None):
    return epl.EPLTrainer(
        model or mlp(),
        LOSS,
        keras.optimizers.SGD(0.1),
        metrics=metrics,
        config={"cluster.virtual_devices": 2},
    )


def _keras(model=None, metrics=None):
    model = model or mlp()
    model.compile(keras.optimizers.SGD(0.1), LOSS, metrics=metrics)
    return model


def _weights(n=64, seed=1):
    return np.random.default_rng(seed).uniform(0.2, 2.0, n).astype("float32")


class Recorder(keras.callbacks.Callback):
    """Records every hook call: (hook, index or None, logs)."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.params_seen = []

    def _add(self, hook, index=None, logs=None):
        self.calls.append((hook, index, dict(logs or {})))
        self.params_seen.append(dict(self.params or {}))

    def on_train_begin(self, logs=None):
        self._add("train_begin", logs=logs)

    def on_train_end(self, logs=None):
        self._add("train_end", logs=logs)

    def on_epoch_begin(self, epoch, logs=None):
        self._add("epoch_begin", epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self._add("epoch_end", epoch, logs)

    def on_train_batch_begin(self, batch, logs=None):
        self._add("train_batch_begin", batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self._add("train_batch_end", batch, logs)

    def on_test_begin(self, logs=None):
        self._add("test_begin", logs=logs)

    def on_test_end(self, logs=None):
        self._add("test_end", logs=logs)

    def on_test_batch_begin(self, batch, logs=None):
        self._add("test_batch_begin", batch, logs)

    def on_test_batch_end(self, batch, logs=None):
        self._add("test_batch_end", batch, logs)

    def on_predict_begin(self, logs=None):
        self._add("predict_begin", logs=logs)

    def on_predict_end(self, logs=None):
        self._add("predict_end", logs=logs)

    def on_predict_batch_begin(self, batch, logs=None):
        self._add("predict_batch_begin", batch, logs)

    def on_predict_batch_end(self, batch, logs=None):
        self._add("predict_batch_end", batch, logs)

    def sequence(self):
        return [(hook, index) for hook, index, _ in self.calls]


def _assert_same_logs(got: dict, expected: dict, keys=None):
    """The logs Keras gives."""
    for key in keys or expected:
        assert key in got, (key, sorted(got))
        np.testing.assert_allclose(got[key], expected[key], rtol=ATOL, atol=ATOL, err_msg=key)


def _assert_same_calls(got: Recorder, expected: Recorder, keys=("loss",)):
    assert got.sequence() == expected.sequence()
    for (_, _, logs), (_, _, want) in zip(got.calls, expected.calls):
        common = [key for key in keys if key in want]
        _assert_same_logs(logs, want, common)


# ---- validation_split, validation_freq, validation_steps, validation_batch_size -----------


def test_validation_split_holds_out_the_last_samples_as_keras():
    x, y = mlp_data()
    expected = _keras(metrics=["accuracy"]).fit(
        x, y, batch_size=16, epochs=2, validation_split=0.25, shuffle=False, verbose=0
    )
    model = mlp()
    got = _trainer(model, metrics=["accuracy"]).fit(
        x, y, batch_size=16, epochs=2, validation_split=0.25, shuffle=False, verbose=0
    )
    for key in ("loss", "val_loss", "val_accuracy"):
        np.testing.assert_allclose(got.history[key], expected.history[key], atol=ATOL)
    assert max_weight_difference(model, expected.model) < ATOL


def test_validation_split_of_a_dataset_is_refused_as_keras():
    x, y = mlp_data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    with pytest.raises(ValueError, match="validation_split is only supported for NumPy"):
        _trainer().fit(dataset, validation_split=0.5, verbose=0)
    with pytest.raises(ValueError, match=r"Training data contains 1 samples"):
        _trainer().fit(x[:1], y[:1], validation_split=0.5, verbose=0)


@pytest.mark.parametrize("freq", [2, [1, 3]])
def test_validation_freq_steps_and_batch_size_as_keras(freq):
    x, y = mlp_data()
    arguments = dict(
        batch_size=16,
        epochs=3,
        validation_data=(x[:32], y[:32]),
        validation_freq=freq,
        validation_steps=3,
        validation_batch_size=8,  # 3 batches of 8: the first 24 samples
        shuffle=False,
        verbose=0,
    )
    expected = _keras().fit(x, y, **arguments).history
    got = _trainer().fit(x, y, **arguments).history
    assert len(got["val_loss"]) == len(expected["val_loss"]) == (1 if freq == 2 else 2)
    np.testing.assert_allclose(got["val_loss"], expected["val_loss"], atol=ATOL)
    with pytest.raises(ValueError, match="Expected `validation_freq` to be a list or int"):
        _trainer().fit(x, y, validation_data=(x, y), validation_freq="2", verbose=0)


def test_validation_data_with_sample_weights_as_keras():
    x, y = mlp_data()
    validation = (x[:32], y[:32], _weights(32))
    expected = _keras().fit(
        x, y, batch_size=16, validation_data=validation, shuffle=False, verbose=0
    )
    got = _trainer().fit(x, y, batch_size=16, validation_data=validation, shuffle=False, verbose=0)
    np.testing.assert_allclose(got.history["val_loss"], expected.history["val_loss"], atol=ATOL)


# ---- callbacks in fit: hooks, logs, params, initial_epoch --------------------------------


def test_fit_callbacks_get_keras_calls_params_and_logs_with_validation():
    x, y = mlp_data()
    arguments = dict(
        batch_size=16, epochs=2, validation_data=(x[:32], y[:32]), shuffle=False, verbose=0
    )
    expected, got = Recorder(), Recorder()
    keras_model = _keras(metrics=["accuracy"])
    keras_model.fit(x, y, callbacks=[expected], **arguments)
    model = mlp()
    _trainer(model, metrics=["accuracy"]).fit(x, y, callbacks=[got], **arguments)
    _assert_same_calls(got, expected, keys=("loss", "accuracy", "val_loss", "val_accuracy"))
    assert got.params_seen[0] == expected.params_seen[0] == {"verbose": 0, "epochs": 2, "steps": 4}
    assert got.model is model


def test_initial_epoch_runs_the_epochs_from_it_as_keras():
    x, y = mlp_data()
    expected, got = Recorder(), Recorder()
    keras_model = _keras()
    history = keras_model.fit(
        x, y, batch_size=16, epochs=4, initial_epoch=2, shuffle=False, verbose=0,
        callbacks=[expected],
    )  # fmt: skip
    model = mlp()
    trainer = _trainer(model)
    got_history = trainer.fit(
        x, y, batch_size=16, epochs=4, initial_epoch=2, shuffle=False, verbose=0, callbacks=[got]
    )
    epochs = [index for hook, index in got.sequence() if hook == "epoch_end"]
    assert epochs == [index for hook, index in expected.sequence() if hook == "epoch_end"]
    assert epochs == [2, 3] and got_history.epoch == history.epoch == [2, 3]
    assert got.params_seen[0]["epochs"] == expected.params_seen[0]["epochs"] == 4
    assert trainer.epochs_done == 2  # epochs this trainer ran (checkpoints, shuffle passes)
    assert int(trainer.optimizer.iterations.numpy()) == 8
    assert max_weight_difference(model, keras_model) < ATOL
    with pytest.raises(ValueError, match=r"initial_epoch must be an int >= 0\. Received"):
        trainer.fit(x, y, batch_size=16, initial_epoch=-1, verbose=0)


def test_a_second_fit_numbers_its_epochs_from_zero_as_keras():
    x, y = mlp_data()
    keras_model, model = _keras(), mlp()
    trainer = _trainer(model)
    for _ in range(2):
        history = keras_model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        got = trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        assert got.epoch == history.epoch == [0, 1]
    assert trainer.epochs_done == 4
    assert max_weight_difference(model, keras_model) < ATOL


def test_backup_and_restore_resumes_an_interrupted_fit_as_keras(tmp_path):
    """Keras's BackupAndRestore: the interrupted run's backup is loaded into the model at
    on_train_begin (the trainer takes it) and the epochs continue from its epoch."""

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted")

    x, y = mlp_data()
    runs = []
    for make, fit in ((_keras, None), (mlp, "epl")):
        model = make()
        fit_fn = model.fit if fit is None else _trainer(model).fit
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / str(fit)))
        with pytest.raises(RuntimeError, match="interrupted"):
            fit_fn(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0,
                   callbacks=[backup, Interrupt()])  # fmt: skip
        fit_fn = model.fit if fit is None else _trainer(model).fit  # a restarted script
        history = fit_fn(
            x, y, batch_size=16, epochs=4, shuffle=False, verbose=0, callbacks=[backup]
        )
        runs.append((model, history.epoch))
    (keras_model, keras_epochs), (model, epochs) = runs
    assert epochs == keras_epochs == [2, 3]
    assert max_weight_difference(model, keras_model) < ATOL


# ---- shuffle -----------------------------------------------------------------------------


def test_shuffle_false_is_keras_shuffle_false_over_epochs():
    x, y = mlp_data()
    keras_model = _keras()
    keras_model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    model = mlp()
    _trainer(model).fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    assert max_weight_difference(model, keras_model) < ATOL


def test_shuffle_true_trains_each_epoch_on_a_new_order_of_every_sample():
    """The trainer's epoch orders replayed in plain Keras (shuffle=False) give its weights:
    every epoch saw each sample once, in an order of its own."""
    x, y = mlp_data()
    keras.utils.set_random_seed(7)
    model = mlp()
    trainer = _trainer(model)
    trainer.fit(x, y, batch_size=16, epochs=3, shuffle=True, verbose=0)
    passes = data_lib.ReshuffledArrays(x, y, 16, seed=trainer.feeder.shuffle_seed)
    orders = [passes.order(epoch) for epoch in range(3)]
    for order in orders:
        assert sorted(order) == list(range(len(x)))
    assert len({tuple(order) for order in orders}) == 3
    assert all((order != np.arange(len(x))).any() for order in orders)
    keras_model = _keras()
    for order in orders:
        keras_model.fit(x[order], y[order], batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert max_weight_difference(model, keras_model) < ATOL


def test_reshuffled_passes_deal_every_sample_once_to_the_workers():
    x = np.arange(40)
    dealt = [
        data_lib.ReshuffledArrays(x, None, 4, seed=3, worker_index=w, worker_num=2)
        for w in range(2)
    ]
    for k in range(2):
        mine, other = ([b.numpy() for b in d.dataset(k)] for d in dealt)
        # Global batch t is worker 0's batch t, then worker 1's.
        dealt_order = np.concatenate([np.concatenate(pair) for pair in zip(mine, other)])
        np.testing.assert_array_equal(np.sort(dealt_order), np.arange(40))
        np.testing.assert_array_equal(dealt_order, dealt[0].order(k))
    same = data_lib.ReshuffledArrays(x, None, 4, seed=3)
    np.testing.assert_array_equal(same.order(1), dealt[0].order(1))  # the seed decides
    chunks = data_lib.ReshuffledArrays(x, None, 8, seed=3, mode="batch").order(0)
    assert [sorted(chunks[i : i + 8]) for i in range(0, 40, 8)] == [
        list(range(i, i + 8)) for i in range(0, 40, 8)
    ]
    with pytest.raises(ValueError, match=r'shuffle must be True, False or "batch"'):
        _trainer().fit(x.reshape(-1, 1), x, shuffle="epoch", verbose=0)


# ---- sample and class weights ------------------------------------------------------------


def test_sample_weight_trains_as_keras():
    x, y = mlp_data()
    weights = _weights()
    keras_model = _keras()
    expected = keras_model.fit(
        x, y, batch_size=16, epochs=2, sample_weight=weights, shuffle=False, verbose=0
    )
    model = mlp()
    got = _trainer(model).fit(
        x, y, batch_size=16, epochs=2, sample_weight=weights, shuffle=False, verbose=0
    )
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], atol=ATOL)
    assert max_weight_difference(model, keras_model) < ATOL


@pytest.mark.parametrize("as_dataset", [False, True])
def test_class_weight_trains_as_keras(as_dataset):
    x, y = mlp_data()
    keras_model = _keras()
    expected = keras_model.fit(
        x, y, batch_size=16, epochs=2, class_weight=CLASS_WEIGHT, shuffle=False, verbose=0
    )
    model = mlp()
    data = (tf.data.Dataset.from_tensor_slices((x, y)).batch(16),) if as_dataset else (x, y)
    got = _trainer(model).fit(
        *data,
        batch_size=None if as_dataset else 16,
        epochs=2,
        class_weight=CLASS_WEIGHT,
        shuffle=False,
        verbose=0,
    )
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], atol=ATOL)
    assert max_weight_difference(model, keras_model) < ATOL


def test_dataset_of_x_y_sample_weight_trains_and_evaluates_as_keras():
    x, y = mlp_data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y, _weights().astype("float64"))).batch(16)
    keras_model = _keras()
    expected = keras_model.fit(dataset, epochs=2, shuffle=False, verbose=0)
    model = mlp()
    trainer = _trainer(model)
    got = trainer.fit(dataset, epochs=2, verbose=0)
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], atol=ATOL)
    assert max_weight_difference(model, keras_model) < ATOL
    want = keras_model.evaluate(dataset, verbose=0)
    assert trainer.evaluate(dataset, verbose=0, return_dict=False) == pytest.approx(want, abs=ATOL)


def test_evaluate_sample_weight_as_keras():
    x, y = mlp_data()
    weights = _weights()
    keras_model = _keras(metrics=["accuracy"])
    want = keras_model.evaluate(x, y, batch_size=16, sample_weight=weights, verbose=0)
    got = _trainer(mlp(), ["accuracy"]).evaluate(
        x, y, batch_size=16, sample_weight=weights, verbose=0, return_dict=False
    )
    np.testing.assert_allclose(got, want, atol=ATOL)


def test_class_weights_are_keras_per_sample_weights():
    """The per-sample weights themselves, before the engine: sparse, one-hot and (n, 1)
    labels, as Keras's data adapters compute them."""
    from keras.src.trainers.data_adapters import data_adapter_utils, tf_dataset_adapter

    labels = np.array([0, 2, 1, 1, 0, 2, 3])
    for y in (labels, np.eye(4)[labels], labels[:, None].astype("float32")):
        want = data_adapter_utils.class_weight_to_sample_weights(y, CLASS_WEIGHT)
        np.testing.assert_array_equal(
            fit_inputs.class_weight_to_sample_weights(y, CLASS_WEIGHT), want
        )
    y = labels[labels < 3]
    mapped = fit_inputs.class_weight_map_fn(CLASS_WEIGHT)(np.zeros(len(y)), tf.constant(y))
    keras_mapped = tf_dataset_adapter.make_class_weight_map_fn(CLASS_WEIGHT)(
        np.zeros(len(y)), tf.constant(y)
    )
    np.testing.assert_array_equal(mapped[2].numpy(), keras_mapped[2].numpy())
    with pytest.raises(ValueError, match="cannot `class_weight` and `sample_weight`"):
        _trainer().fit(*mlp_data(), class_weight=CLASS_WEIGHT, sample_weight=_weights(), verbose=0)


# ---- evaluate: return values, steps, callbacks -------------------------------------------


@pytest.mark.parametrize(
    "metrics", [None, ["accuracy"], ["accuracy", "sparse_categorical_crossentropy"]]
)
def test_evaluate_returns_what_keras_returns(metrics):
    x, y = mlp_data()
    keras_model = _keras(metrics=metrics)
    trainer = _trainer(mlp(), metrics)
    want = keras_model.evaluate(x, y, batch_size=16, verbose=0)
    got = trainer.evaluate(x, y, batch_size=16, verbose=0, return_dict=False)
    assert type(got) is type(want)  # a float for the loss alone, else a list
    np.testing.assert_allclose(got, want, atol=ATOL)
    want_dict = keras_model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    got_dict = trainer.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    assert list(got_dict) == list(want_dict) or set(got_dict) == set(want_dict)
    _assert_same_logs(got_dict, want_dict)


def test_evaluate_steps_as_keras():
    x, y = mlp_data()
    want = _keras().evaluate(x, y, batch_size=16, steps=2, verbose=0)
    got = _trainer().evaluate(x, y, batch_size=16, steps=2, verbose=0, return_dict=False)
    assert got == pytest.approx(want, abs=ATOL)


def test_evaluate_callbacks_get_keras_calls_params_and_logs():
    x, y = mlp_data()
    expected, got = Recorder(), Recorder()
    _keras(metrics=["accuracy"]).evaluate(x, y, batch_size=16, verbose=0, callbacks=[expected])
    model = mlp()
    _trainer(model, ["accuracy"]).evaluate(x, y, batch_size=16, verbose=0, callbacks=[got])
    assert got.sequence()[:3] == [
        ("test_begin", None),
        ("test_batch_begin", 0),
        ("test_batch_end", 0),
    ]
    _assert_same_calls(got, expected, keys=("loss", "accuracy"))
    assert got.params_seen[0] == expected.params_seen[0] == {"verbose": 0, "epochs": 1, "steps": 4}
    assert got.model is model


def test_evaluate_and_predict_progress_bars(capsys):
    x, y = mlp_data()
    trainer = _trainer()
    trainer.evaluate(x, y, batch_size=16)  # verbose="auto": a progress bar, as Keras
    trainer.predict(x, batch_size=16)
    out = capsys.readouterr().out
    assert "4/4" in out and "loss:" in out
    trainer.evaluate(x, y, batch_size=16, verbose=0)
    trainer.predict(x, batch_size=16, verbose=0)
    assert capsys.readouterr().out == ""


# ---- predict: steps, callbacks -----------------------------------------------------------


def test_predict_steps_and_callbacks_as_keras():
    x, _ = mlp_data()
    keras_model = _keras()
    expected, got = Recorder(), Recorder()
    want = keras_model.predict(x, batch_size=16, steps=3, verbose=0, callbacks=[expected])
    model = mlp()
    trainer = _trainer(model)
    outputs = trainer.predict(x, batch_size=16, steps=3, verbose=0, callbacks=[got])
    assert outputs.shape == want.shape == (48, 3)
    np.testing.assert_allclose(outputs, want, atol=ATOL)
    assert got.sequence() == expected.sequence()
    for (hook, _, logs), (_, _, want_logs) in zip(got.calls, expected.calls):
        if hook == "predict_batch_end":
            np.testing.assert_allclose(logs["outputs"], want_logs["outputs"], atol=ATOL)
    assert got.params_seen[0] == expected.params_seen[0]
    assert got.model is model


def test_predict_on_a_dataset_of_x_and_y_ignores_the_labels():
    x, y = mlp_data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    want = _keras().predict(dataset, verbose=0)
    np.testing.assert_allclose(_trainer().predict(dataset, verbose=0), want, atol=ATOL)


# ---- unbuilt models ----------------------------------------------------------------------


def _unbuilt_sequential():
    """No input shape: Keras builds it from the first batch. Seeded initializers make
    two of them equal."""
    init = keras.initializers.GlorotUniform
    return keras.Sequential(
        [
            keras.layers.Dense(16, activation="relu", kernel_initializer=init(1), name="d1"),
            keras.layers.Dense(3, kernel_initializer=init(2), name="d2"),
        ]
    )


@pytest.mark.parametrize("stages", [None, {"d1": 0, "d2": 1}])
def test_unbuilt_sequential_is_built_from_the_data_and_trains_as_keras(stages):
    x, y = mlp_data()
    keras_model = _keras(_unbuilt_sequential())
    expected = keras_model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model = _unbuilt_sequential()
    trainer = epl.EPLTrainer(
        model, LOSS, keras.optimizers.SGD(0.1), stages=stages,
        config={"cluster.virtual_devices": 2},
    )  # fmt: skip
    assert not model.built
    got = trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert model.built and len(trainer.plan.taskgraphs) == (1 if stages is None else 2)
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], atol=ATOL)
    assert max_weight_difference(model, keras_model) < ATOL
    np.testing.assert_allclose(
        trainer.predict(x, verbose=0), keras_model.predict(x, verbose=0), atol=ATOL
    )


@pytest.mark.parametrize("first_call", ["evaluate", "predict"])
def test_unbuilt_sequential_is_built_by_evaluate_or_predict(first_call):
    x, y = mlp_data()
    keras_model = _keras(_unbuilt_sequential())
    trainer = _trainer(_unbuilt_sequential())
    if first_call == "evaluate":
        want = keras_model.evaluate(x, y, batch_size=16, verbose=0)
        assert trainer.evaluate(x, y, batch_size=16, verbose=0, return_dict=False) == pytest.approx(
            want, abs=ATOL
        )
    else:
        want = keras_model.predict(x, batch_size=16, verbose=0)
        np.testing.assert_allclose(trainer.predict(x, batch_size=16, verbose=0), want, atol=ATOL)


def test_unbuilt_sequential_restores_a_checkpoint_given_one_batch(tmp_path):
    x, y = mlp_data()
    trained = _trainer(_unbuilt_sequential())
    trained.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    trained.save_checkpoint(str(tmp_path))
    restored = _trainer(_unbuilt_sequential())
    restored.restore_checkpoint(str(tmp_path), features=x[:16])
    np.testing.assert_allclose(restored.predict(x, verbose=0), trained.predict(x, verbose=0))
