"""Standard Keras callbacks, progress output and TensorBoard summaries work with EPLTrainer."""

import csv
import glob
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from _models import LOSS, keras_reference, max_weight_difference, mlp, mlp_data

import epl_trainer as epl


def _trainer(model=None, devices=2, optimizer=None, metrics=None):
    return epl.EPLTrainer(
        model or mlp(),
        LOSS,
        optimizer or keras.optimizers.SGD(0.1),
        metrics=metrics,
        config={"cluster.virtual_devices": devices},
    )


def _scalar_tags(logdir):
    tags = set()
    for path in glob.glob(os.path.join(logdir, "**", "events.out.tfevents.*"), recursive=True):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                tags.add(value.tag)
    return tags


def test_history_and_tensorboard_get_keras_logs_and_the_trainer_keeps_throughput(tmp_path):
    x, y = mlp_data()
    trainer = _trainer(metrics=["accuracy"])
    history = trainer.fit(
        x,
        y,
        batch_size=16,
        epochs=2,
        verbose=0,
        callbacks=[keras.callbacks.TensorBoard(str(tmp_path), update_freq=1)],
        shuffle=False,
    )
    assert isinstance(history, keras.callbacks.History)
    assert len(history.history["loss"]) == 2
    assert set(history.history) == {"loss", "accuracy"}  # Keras's logs, nothing else
    tags = _scalar_tags(tmp_path)
    assert {"epoch_loss", "epoch_learning_rate", "epoch_accuracy"} <= tags
    assert not any("samples_per_sec" in tag for tag in tags)
    # The trainer's own values: the last step's, and one per epoch.
    assert trainer.step_stats["samples_per_sec"] > 0
    assert len(trainer.stats_history["samples_per_sec"]) == 2


def test_progress_bar_shows_keras_logs(capsys):
    x, y = mlp_data()
    _trainer().fit(x, y, batch_size=16, epochs=1, verbose=1, shuffle=False)
    out = capsys.readouterr().out
    assert "loss:" in out and "4/4" in out and "samples_per_sec" not in out


def test_csv_logger_and_model_checkpoint(tmp_path):
    x, y = mlp_data()
    model = mlp()
    trainer = _trainer(model)
    weights_path = str(tmp_path / "epoch{epoch}.weights.h5")
    trainer.fit(
        x,
        y,
        batch_size=16,
        epochs=2,
        verbose=0,
        callbacks=[
            keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
            keras.callbacks.ModelCheckpoint(weights_path, save_weights_only=True),
        ],
        shuffle=False,
    )
    with open(tmp_path / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [0, 1] and "loss" in rows[0]
    restored = mlp(seed=5)
    restored.load_weights(str(tmp_path / "epoch2.weights.h5"))
    assert max_weight_difference(restored, model) == 0.0


def test_early_stopping_stops_training():
    x, y = mlp_data()
    stopper = keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=1e9)
    history = _trainer().fit(
        x, y, batch_size=16, epochs=10, verbose=0, callbacks=[stopper], shuffle=False
    )
    assert len(history.history["loss"]) == 2


def test_early_stopping_restores_best_weights_into_the_engine():
    x, y = mlp_data()
    model = mlp()
    trainer = _trainer(model, optimizer=keras.optimizers.SGD(5.0))  # diverges: epoch 0 is best
    stopper = keras.callbacks.EarlyStopping(monitor="loss", patience=1, restore_best_weights=True)
    trainer.fit(x, y, batch_size=16, epochs=6, verbose=0, callbacks=[stopper], shuffle=False)
    np.testing.assert_allclose(trainer.predict(x), model.predict(x, verbose=0), atol=1e-5)


def test_learning_rate_scheduler_reaches_every_replica():
    x, y = mlp_data()

    def schedule(epoch, lr):
        return 0.1 / (1 + epoch)

    reference = mlp()
    keras_reference(
        reference,
        x,
        y,
        keras.optimizers.SGD(0.1),
        batch_size=16,
        steps=2,
        epochs=3,
        callbacks=[keras.callbacks.LearningRateScheduler(schedule)],
    )
    model = mlp()
    _trainer(model, devices=4).fit(
        x,
        y,
        batch_size=16,
        epochs=3,
        steps_per_epoch=2,
        shuffle=False,
        verbose=0,
        callbacks=[keras.callbacks.LearningRateScheduler(schedule)],
    )
    assert max_weight_difference(reference, model) < 1e-5


def test_validation_data_adds_val_logs():
    x, y = mlp_data()
    history = _trainer(metrics=["accuracy"]).fit(
        x, y, batch_size=16, epochs=1, verbose=0, validation_data=(x[:20], y[:20]), shuffle=False
    )
    assert {"val_loss", "val_accuracy"} <= set(history.history)


@pytest.mark.parametrize(("steps", "expected"), [(None, 12), (2, 6), (3, 7)])
def test_steps_per_epoch_follows_keras(steps, expected):
    """4 batches of data, 3 epochs: with 3 steps per epoch Keras runs 3, 1 (data ran out), 3."""
    x, y = mlp_data()
    reference = mlp()
    keras_reference(
        reference, x, y, keras.optimizers.SGD(0.1), batch_size=16, steps=steps, epochs=3
    )
    model = mlp()
    trainer = _trainer(model)
    trainer.fit(x, y, batch_size=16, epochs=3, steps_per_epoch=steps, shuffle=False, verbose=0)
    assert int(trainer.optimizer.iterations.numpy()) == expected
    assert int(reference.optimizer.iterations.numpy()) == expected
    assert max_weight_difference(reference, model) < 1e-5


class CountingModel(keras.Model):
    """Counts its calls in a non-trainable variable (Keras's own callback test)."""

    def __init__(self):
        super().__init__()
        self.calls = self.add_variable(shape=(), initializer="zeros", trainable=False)
        self.dense = keras.layers.Dense(1)

    def call(self, inputs):
        self.calls.assign(self.calls + 1)
        return self.dense(inputs)


def test_a_batch_callback_reads_the_model_state_of_that_step():
    """A callback's batch hooks see the model as Keras's: built without running a call
    (symbolically), and written back after every step."""
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(int(model.calls.numpy()))
    )
    model = CountingModel()
    x, y = np.random.random((8, 3)).astype("float32"), np.random.random((8, 1)).astype("float32")
    _trainer(model).fit(x, y, batch_size=2, verbose=0, shuffle=False, callbacks=[record])
    assert seen == [1, 2, 3, 4]  # each replica's copy counts one call per step


class _ShrinkBeforeStep(keras.callbacks.Callback):
    """Scales the weights before the third step of each epoch (a set_weights at batch begin)."""

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 2:
            self.model.set_weights([w * 0.9 for w in self.model.get_weights()])


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({}, id="data_parallel"),
        pytest.param({"pipeline.num_micro_batch": 2}, id="stages"),
    ],
)
def test_weights_set_before_a_step_are_the_ones_the_step_trains(config):
    """Keras runs the step on what `on_train_batch_begin` set. Before, the engine took
    the model's variables back only after `on_train_batch_end`: the step trained on the
    old weights and the next write-back overwrote the set ones (2 epochs of Adam: 1.1e-1
    from Keras)."""
    x, y = mlp_data()
    reference = mlp()
    keras_reference(
        reference, x, y, keras.optimizers.Adam(0.01), 16, 4, epochs=2,
        callbacks=[_ShrinkBeforeStep()],
    )  # fmt: skip
    model = mlp()
    stages = {"dense_in": 0, "logits": 1} if config else None
    trainer = epl.EPLTrainer(
        model,
        LOSS,
        keras.optimizers.Adam(0.01),
        stages=stages,
        config={"cluster.virtual_devices": 2, **config},
    )
    trainer.fit(
        x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[_ShrinkBeforeStep()]
    )
    assert max_weight_difference(reference, model) < 1e-5


@pytest.mark.parametrize("reads_logs_only", [False, True])
def test_a_callback_that_reads_only_logs_spares_the_per_step_write_back(reads_logs_only, caplog):
    """A callback with batch hooks makes the trainer write the weights back after every
    step (it may read them), and the trainer says which callback and how to opt out; one
    whose class sets `reads_logs_only = True` leaves the model's weights alone until the
    epoch ends."""
    model = mlp()
    first_kernel = model.layers[1].kernel

    class Recorder(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.kernels = []

        def on_train_batch_end(self, batch, logs=None):
            self.kernels.append(np.array(first_kernel.numpy()))

    Recorder.reads_logs_only = reads_logs_only
    recorder = Recorder()
    x, y = mlp_data()
    with caplog.at_level("INFO", logger="epl_trainer.training.fit_inputs"):
        _trainer(model).fit(x, y, batch_size=8, verbose=0, shuffle=False, callbacks=[recorder])
    moved = [not np.array_equal(a, b) for a, b in zip(recorder.kernels, recorder.kernels[1:])]
    said = [r.getMessage() for r in caplog.records if "reads_logs_only" in r.getMessage()]
    assert len(moved) >= 2
    if reads_logs_only:
        assert not any(moved) and not said
    else:
        assert all(moved) and len(said) == 1 and "Recorder" in said[0]


def test_metric_results_that_are_arrays_stay_arrays_in_the_logs():
    x, y = mlp_data()
    y = keras.utils.to_categorical(y % 3, 3)
    model = keras.Sequential([keras.Input((x.shape[1],)), keras.layers.Dense(3, "softmax")])
    trainer = epl.EPLTrainer(
        model,
        "categorical_crossentropy",
        keras.optimizers.SGD(0.1),
        metrics=[keras.metrics.F1Score(name="f1")],
        config={"cluster.virtual_devices": 2},
    )
    history = trainer.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    assert history.history["f1"][0].shape == (3,)
    assert trainer.evaluate(x, y, verbose=0, return_dict=True)["f1"].shape == (3,)


def _ema_sgd():
    return keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.9)


@pytest.mark.combines("ema+data_parallel")
def test_use_ema_and_swap_ema_weights_match_keras():
    """Keras's fit ends with the weights replaced by the optimizer's moving averages, and
    SwapEMAWeights validates on the averages: the same here, from the lanes' averages."""
    x, y = mlp_data()
    callbacks = [keras.callbacks.SwapEMAWeights()]
    reference = mlp()
    reference.compile(_ema_sgd(), LOSS)
    expected = reference.fit(
        x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=callbacks,
        validation_data=(x[:32], y[:32]),
    )  # fmt: skip
    model = mlp()
    got = _trainer(model, optimizer=_ema_sgd()).fit(
        x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.SwapEMAWeights()], validation_data=(x[:32], y[:32]),
    )  # fmt: skip
    np.testing.assert_allclose(got.history["val_loss"], expected.history["val_loss"], atol=1e-5)
    assert max_weight_difference(reference, model) < 1e-5


def test_use_ema_with_zero_is_refused_by_name():
    match = r"use_ema=True is not supported with ZeRO.*zero\.stage=2 \(zero\.level='v1'\)"
    with pytest.raises(ValueError, match=match):
        epl.EPLTrainer(
            mlp(), LOSS, _ema_sgd(), config={"cluster.virtual_devices": 2, "zero.level": "v1"}
        )
