"""Numerical faults: a non-finite loss stops fp32 training (or is skipped); AMP's scaler owns it."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _models import LOSS, max_weight_difference, mlp, mlp_data

import epl_trainer as epl
from epl_trainer.training.trainer import NonFiniteLossError

BATCH = 8
BAD_BATCH = 2  # 0-based index of the batch holding a NaN


def _trainer(model, **config):
    return epl.EPLTrainer(
        model,
        LOSS,
        keras.optimizers.Adam(0.01),
        config={"cluster.virtual_devices": 2, **config},
    )


def _data(poisoned: bool, drop_bad: bool = False, nan_loss: bool = False):
    """48 samples in batches of 8; `poisoned`: batch BAD_BATCH holds a NaN input.

    A NaN input gives NaN gradients on every CPU, but not always a NaN loss: where
    oneDNN is on, the compiled step fuses MatMul + BiasAdd + Relu and that kernel's ReLU
    maps NaN to 0. `nan_loss` poisons the batch through a sample weight instead, which
    makes the loss itself NaN everywhere (what Keras's TerminateOnNaN looks at)."""
    x, y = mlp_data(48)
    weights = np.ones(len(x), "float32")
    if poisoned and nan_loss:
        weights[BAD_BATCH * BATCH + 3] = np.nan
    elif poisoned:
        x = x.copy()
        x[BAD_BATCH * BATCH + 3, 1] = np.nan
    if drop_bad:
        keep = np.r_[0 : BAD_BATCH * BATCH, (BAD_BATCH + 1) * BATCH : len(x)]
        x, y = x[keep], y[keep]
    if nan_loss:
        return tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(BATCH)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)


def test_nonfinite_loss_stops_with_the_step_and_leaves_the_weights_before_it():
    model = mlp()
    trainer = _trainer(model)
    with pytest.raises(
        NonFiniteLossError,
        match=r"not finite \(NaN or Inf\) at training step 3 \(epoch 1, batch 2\)",
    ):
        trainer.fit(_data(poisoned=True), verbose=0)
    trainer.engine.state.write_back()
    reference = mlp()
    _trainer(reference).fit(_data(poisoned=False).take(BAD_BATCH), verbose=0)
    assert max_weight_difference(model, reference) == 0.0
    assert all(np.isfinite(w).all() for w in model.get_weights())


def test_terminate_on_nan_stops_training_as_in_keras_and_the_step_is_not_applied():
    """Keras's TerminateOnNaN sees the NaN loss in the batch logs and stops: no
    NonFiniteLossError, the epoch's loss is NaN (as Keras's), the weights are those
    before the bad step (Keras would have applied it)."""
    model = mlp()
    history = _trainer(model).fit(
        _data(poisoned=True, nan_loss=True),
        epochs=3,
        verbose=0,
        callbacks=[keras.callbacks.TerminateOnNaN()],
    )
    assert len(history.history["loss"]) == 1 and np.isnan(history.history["loss"][0])
    reference = mlp()
    _trainer(reference).fit(_data(poisoned=False).take(BAD_BATCH), verbose=0)
    assert max_weight_difference(model, reference) == 0.0


def test_callbacks_see_the_nan_batch_before_the_error_and_terminate_on_nan_may_raise():
    seen = []
    record = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: seen.append(logs))
    with pytest.raises(NonFiniteLossError):
        _trainer(mlp()).fit(_data(poisoned=True, nan_loss=True), verbose=0, callbacks=[record])
    assert len(seen) == BAD_BATCH + 1 and np.isnan(seen[-1]["loss"])
    with pytest.raises(RuntimeError, match="NaN or Inf loss encountered"):
        _trainer(mlp()).fit(
            _data(poisoned=True, nan_loss=True),
            verbose=0,
            callbacks=[keras.callbacks.TerminateOnNaN(raise_error=True)],
        )


def test_skip_mode_skips_the_step_as_if_the_batch_were_not_there(caplog):
    model = mlp()
    trainer = _trainer(model, **{"optimizer.nonfinite_loss": "skip"})
    trainer.fit(_data(poisoned=True), verbose=0)
    assert trainer.stats_history["nonfinite_steps"] == [1]
    assert "Non-finite loss at training step 3 (epoch 1, batch 2)" in caplog.text
    reference = mlp()
    _trainer(reference).fit(_data(poisoned=False, drop_bad=True), verbose=0)
    # Adam's own step count did not advance either: identical to never seeing the batch.
    assert max_weight_difference(model, reference) == 0.0


def test_a_dynamic_fp16_loss_scaler_skips_the_step_without_an_error():
    """The dynamic scaler owns overflow: it lowers the scale and goes on."""
    model = mlp()
    trainer = _trainer(model, **{"amp.level": "O1", "amp.dtype": "float16"})
    history = trainer.fit(_data(poisoned=True), verbose=0)
    assert trainer.stats_history["skipped_steps"] == [1]
    assert "nonfinite_steps" not in trainer.stats_history
    assert set(history.history) == {"loss"}  # Keras's logs only
    assert all(np.isfinite(w).all() for w in model.get_weights())


FIXED_SCALE_AMP = [
    {"amp.level": "O1", "amp.dtype": "bfloat16"},
    {"amp.level": "O1", "amp.dtype": "float16", "amp.loss_scale": 128},
]


@pytest.mark.parametrize("amp", FIXED_SCALE_AMP, ids=["bf16", "fp16-fixed"])
def test_a_fixed_loss_scale_stops_on_a_nonfinite_step(amp):
    """No scaler can recover here: every later step would be skipped in silence."""
    with pytest.raises(NonFiniteLossError, match=r"at training step 3 \(epoch 1, batch 2\)"):
        _trainer(mlp(), **amp).fit(_data(poisoned=True), verbose=0)


@pytest.mark.parametrize("amp", FIXED_SCALE_AMP, ids=["bf16", "fp16-fixed"])
def test_a_fixed_loss_scale_skips_with_a_warning_when_told_to(amp, caplog):
    model = mlp()
    config = {**amp, "optimizer.nonfinite_loss": "skip"}
    trainer = _trainer(model, **config)
    trainer.fit(_data(poisoned=True), verbose=0)
    assert trainer.stats_history["nonfinite_steps"] == [1]
    assert "Non-finite loss at training step 3 (epoch 1, batch 2)" in caplog.text
    assert all(np.isfinite(w).all() for w in model.get_weights())


@pytest.mark.parametrize("amp", [{}, FIXED_SCALE_AMP[0]], ids=["fp32", "bf16"])
def test_steps_per_execution_stops_at_the_first_nonfinite_step_and_keeps_the_weights(amp):
    """Several steps per call: the in-graph loop is left at the bad step, so the error
    names it and the weights are those before it (not after the call's later steps)."""
    model = mlp()
    trainer = epl.EPLTrainer(
        model,
        LOSS,
        keras.optimizers.Adam(0.01),
        config={"cluster.virtual_devices": 2, **amp},
        steps_per_execution=4,
    )
    with pytest.raises(NonFiniteLossError, match=r"at training step 3 \(epoch 1, batch 2\)"):
        trainer.fit(_data(poisoned=True), verbose=0)
    assert int(trainer.optimizer.iterations.numpy()) == BAD_BATCH + 1
    trainer.engine.state.write_back()
    reference = mlp()
    _trainer(reference, **amp).fit(_data(poisoned=False).take(BAD_BATCH), verbose=0)
    assert max_weight_difference(model, reference) == 0.0


def test_an_overflow_on_the_float16_wire_is_named():
    """A finite loss whose gradients times communication.fp16_scale pass float16's 65504
    overflows on the wire; the error pointed only at the learning rate and the data."""
    x, _ = mlp_data(16)
    y = np.full((16, 3), 3000.0, "float32")  # MSE gradients of ~1e3, x 128 > 65504
    trainer = epl.EPLTrainer(
        mlp(),
        keras.losses.MeanSquaredError(),
        keras.optimizers.SGD(1e-9),
        config={"cluster.virtual_devices": 2, "communication.fp16": True},
    )
    with pytest.raises(NonFiniteLossError, match=r"fp16_scale=128: a gradient above 511\.75"):
        trainer.fit(x, y, batch_size=16, verbose=0)
