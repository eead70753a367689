"""Memory-efficient AMP in the engine: training parity within a stated tolerance, loss
scaling with skipped steps, gradient accumulation with dynamic scaling.

Tolerance: after 20 SGD steps, weights trained with AMP O1 stay within 2e-2 (bfloat16:
8 mantissa bits) / 5e-3 (float16) of the float32 run, and the loss falls.
"""

import keras
import numpy as np
import pytest
from _models import LOSS, mlp, mlp_data

import epl_trainer as epl
from epl_trainer.core.engine.precision.amp import MinLossScaleError

TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3}


def _data():
    x, _ = mlp_data(n=320)
    return x, np.argmax(x[:, :3], axis=1).astype("int32")  # a learnable target


def _fit(amp_dtype=None, steps=20, devices=2, **config):
    x, y = _data()
    model = mlp(width=16)
    amp_config = {"amp.level": "O1", "amp.dtype": amp_dtype} if amp_dtype else {}
    trainer = epl.EPLTrainer(
        model,
        LOSS,
        keras.optimizers.SGD(0.1),
        config={"cluster.virtual_devices": devices, **amp_config, **config},
    )
    history = trainer.fit(
        x, y, batch_size=16, epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False
    )
    return trainer, model, history


@pytest.mark.onednn
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.combines("amp+data_parallel")
def test_amp_trains_close_to_float32(dtype):
    reference_trainer, reference, _ = _fit(None)
    trainer, model, _ = _fit(dtype)
    for a, b, v in zip(reference.get_weights(), model.get_weights(), model.weights):
        assert v.dtype == "float32"  # master weights stay float32
        np.testing.assert_allclose(a, b, atol=TOLERANCE[dtype])
    # The loss falls: evaluated on the training data, far below the untrained model's.
    x, y = _data()
    untrained = epl.EPLTrainer(mlp(width=16), LOSS, "sgd", config={"cluster.virtual_devices": 1})
    trained = trainer.evaluate(x, y, return_dict=True)["loss"]
    assert trained < 0.8 * untrained.evaluate(x, y, return_dict=True)["loss"]
    assert abs(trained - reference_trainer.evaluate(x, y, return_dict=True)["loss"]) < 0.05
    assert model.get_layer("dense_in").compute_dtype == dtype


@pytest.mark.parametrize(
    "zero",
    [
        "",
        pytest.param("v1", marks=pytest.mark.combines("amp+zero_v1+data_parallel")),
        pytest.param("v2", marks=pytest.mark.combines("amp+zero_v2+data_parallel")),
    ],
    ids=["replicated", "zero_v1", "zero_v2"],
)
@pytest.mark.combines("amp+data_parallel")
def test_amp_with_gradient_accumulation_and_dynamic_scaling(zero):
    """ZeRO v1 and v2 reduce-scatter each micro-batch's scaled gradients and unscale the
    shard (v2's float32 parameters are gathered and cast on use, as the lanes' are)."""
    _, reference, _ = _fit(None, **{"pipeline.num_micro_batch": 4})
    trainer, model, _ = _fit("float16", **{"pipeline.num_micro_batch": 4, "zero.level": zero})
    for a, b in zip(reference.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, atol=TOLERANCE["float16"])
    assert trainer.stats_history["loss_scale"][-1] == 2.0**16
    assert trainer.stats_history["skipped_steps"][-1] == 0


def test_overflowing_steps_are_skipped_and_the_scale_backs_off():
    """A scale of 2^60 overflows float16 gradients: the step is skipped, weights stay."""
    x, y = mlp_data()
    model = mlp(width=16)
    before = [w.copy() for w in model.get_weights()]
    trainer = epl.EPLTrainer(
        model,
        LOSS,
        keras.optimizers.Adam(0.01),
        config={
            "cluster.virtual_devices": 2,
            "amp.level": "O1",
            "amp.dtype": "float16",
            "amp.initial_scale_power": 60,
            "amp.hysteresis": 1,
        },
    )
    trainer.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=1, verbose=0, shuffle=False)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert trainer.stats_history["skipped_steps"] == [1]
    assert trainer.stats_history["loss_scale"] == [2.0**59]
    optimizer = trainer.engine.program.update.inner.optimizers[0][0][0]
    assert int(optimizer.iterations.numpy()) == 0  # the optimizer did not step either


def test_hitting_the_minimum_loss_scale_is_a_clear_error():
    x, y = mlp_data()
    x[:, 0] = np.inf  # every step overflows
    trainer = epl.EPLTrainer(
        mlp(width=16),
        LOSS,
        "sgd",
        config={
            "cluster.virtual_devices": 1,
            "amp.level": "O1",
            "amp.dtype": "float16",
            "amp.initial_scale_power": 2,
            "amp.hysteresis": 1,
            "amp.min_loss_scale": 2,
        },
    )
    with pytest.raises(MinLossScaleError, match=r"Loss scale hit amp\.min_loss_scale"):
        trainer.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=3, verbose=0, shuffle=False)
