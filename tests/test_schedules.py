"""DeepSpeed learning-rate schedules: values at steps 0, 1, warmup-1, warmup and late.

Expected values are worked out by hand from DeepSpeed's formulas
(deepspeed/runtime/lr_schedules.py), `step` being DeepSpeed's last_batch_iteration.
"""

import math

import keras
import numpy as np
import pytest
from _models import LOSS, mlp, mlp_data

from epl_trainer.training import schedules


def _values(schedule, steps):
    return [float(keras.ops.convert_to_numpy(schedule(step))) for step in steps]


def _check(schedule, expected: dict):
    steps = list(expected)
    assert _values(schedule, steps) == pytest.approx(list(expected.values()), rel=1e-6, abs=1e-9)


def test_warmup_lr_log():
    # min 0.01, max 0.11, W=10: gamma = log(step + 1) / log(10).
    schedule = schedules.WarmupLR(0.01, 0.11, 10, "log")
    _check(schedule, {0: 0.01, 1: 0.01 + 0.1 * 0.30102999566, 9: 0.11, 10: 0.11, 1000: 0.11})


def test_warmup_lr_linear():
    schedule = schedules.WarmupLR(0.01, 0.11, 10, "linear")
    _check(schedule, {0: 0.01, 1: 0.02, 9: 0.10, 10: 0.11, 1000: 0.11})


def test_warmup_lr_clamps_warmup_to_two_steps():
    # DeepSpeed uses max(2, warmup_num_steps): with 0 steps, step 0 is still min_lr.
    _check(schedules.WarmupLR(0.0, 0.5, 0, "log"), {0: 0.0, 1: 0.5, 2: 0.5})


def test_warmup_decay_lr():
    # Linear warmup over W=10, then gamma = (30 - step) / (30 - 10), floored at 0.
    schedule = schedules.WarmupDecayLR(30, 0.01, 0.11, 10, "linear")
    _check(schedule, {0: 0.01, 1: 0.02, 9: 0.10, 10: 0.11, 20: 0.06, 30: 0.01, 40: 0.01})


def test_warmup_decay_lr_log_warmup():
    schedule = schedules.WarmupDecayLR(20, 0.0, 1.0, 4, "log")
    # log(2)/log(4) = 0.5; after warmup (20 - step) / 16.
    _check(schedule, {0: 0.0, 1: 0.5, 3: 1.0, 4: 1.0, 12: 0.5, 25: 0.0})


def test_warmup_cosine_lr():
    # lr 0.1, T=30, W=10, warmup_min_ratio 0.2, cos_min_ratio 0.1, linear warmup.
    schedule = schedules.WarmupCosineLR(0.1, 30, 0.2, 10, 0.1, "linear")
    after_warmup = 0.1 + 0.9 * (1 + math.cos(math.pi * 1 / 20)) / 2  # step 10: (10-10+1)/20
    _check(
        schedule,
        {
            0: 0.1 * 0.2,
            1: 0.1 * (0.2 + 0.8 * 0.1),
            9: 0.1 * (0.2 + 0.8 * 0.9),
            10: 0.1 * after_warmup,
            19: 0.1 * (0.1 + 0.9 * 0.5),  # (19 - 10 + 1) / 20 = 0.5 -> cos = 0
            29: 0.1 * 0.1,  # cos(pi) = -1: the floor cos_min_ratio
        },
    )


def test_warmup_cosine_lr_needs_steps_after_warmup():
    with pytest.raises(ValueError, match="total_num_steps=10, warmup_num_steps=10"):
        schedules.WarmupCosineLR(0.1, 10, warmup_num_steps=10)


def test_one_cycle_lr_and_momentum():
    # min 0.01 / max 0.1, first half 4 steps, second 6: total 10, step_ratio 0.4.
    # scale_factor at step s: x = (s + 1) / 10 (first cycle); x / 0.4 rising,
    # (x - 1) / (0.4 - 1) falling. Decay: lr = min / (1 + 0.5 * (s - 10 + 1) / 2).
    shape = {"cycle_first_step_size": 4, "cycle_second_step_size": 6, "decay_step_size": 2}
    lr = schedules.OneCycle(0.01, 0.1, decay_lr_rate=0.5, **shape)
    _check(
        lr,
        {0: 0.0325, 1: 0.055, 3: 0.1, 4: 0.01 + 0.09 * 0.5 / 0.6, 9: 0.01, 10: 0.008, 13: 0.005},
    )
    momentum = schedules.OneCycleMomentum(0.8, 0.9, decay_mom_rate=0.1, **shape)
    _check(
        momentum,
        {0: 0.875, 1: 0.85, 3: 0.8, 4: 0.9 - 0.1 * 0.5 / 0.6, 9: 0.9, 10: 0.945, 13: 1.08},
    )


def test_one_cycle_without_decay_stays_at_the_bounds():
    lr = schedules.OneCycle(0.01, 0.1, cycle_first_step_size=2)
    _check(lr, {0: 0.055, 1: 0.1, 2: 0.055, 3: 0.01, 4: 0.01, 100: 0.01})
    _check(schedules.OneCycleMomentum(cycle_first_step_size=2), {1: 0.8, 3: 0.9, 100: 0.9})


def test_one_cycle_refuses_stair_counts():
    with pytest.raises(ValueError, match="cycle_first_stair_count"):
        schedules.OneCycle(0.01, 0.1, cycle_first_stair_count=2)


def test_lr_range_test():
    # min 0.001, step size 10, rate 2: lr = 0.001 * (1 + 2 * interval).
    continuous = schedules.LRRangeTest(0.001, 10, 2.0, False)
    _check(continuous, {0: 0.001, 1: 0.0012, 9: 0.0028, 10: 0.003, 25: 0.006})
    staircase = schedules.LRRangeTest(0.001, 10, 2.0, True)
    _check(staircase, {0: 0.001, 1: 0.001, 9: 0.001, 10: 0.003, 25: 0.005})


@pytest.mark.parametrize(
    "schedule",
    [
        schedules.WarmupLR(0.0, 0.1, 5, "linear"),
        schedules.WarmupDecayLR(50, 0.0, 0.1, 5),
        schedules.WarmupCosineLR(0.1, 50, 0.1, 5, 0.01),
        schedules.OneCycle(0.01, 0.1, 0.2, 5, 7, decay_step_size=3),
        schedules.OneCycleMomentum(0.85, 0.95, 0.1, 5, decay_step_size=3),
        schedules.LRRangeTest(0.01, 4, 0.5, True),
    ],
    ids=lambda s: type(s).__name__,
)
def test_schedules_round_trip_through_keras_serialization(schedule):
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(schedule))
    assert type(restored) is type(schedule)
    assert restored.get_config() == schedule.get_config()
    steps = [0, 1, 4, 5, 6, 12, 60]
    assert _values(restored, steps) == _values(schedule, steps)


def test_invalid_arguments_name_the_value():
    with pytest.raises(ValueError, match="warmup_type must be one of"):
        schedules.WarmupLR(warmup_type="cosine")
    with pytest.raises(ValueError, match="total_num_steps=0"):
        schedules.WarmupDecayLR(0)
    with pytest.raises(ValueError, match="cycle_max_mom must be in"):
        schedules.OneCycleMomentum(cycle_max_mom=1.5)


def test_keras_optimizer_uses_the_schedule_at_its_iterations():
    schedule = schedules.WarmupLR(0.0, 0.1, 4, "linear")
    optimizer = keras.optimizers.SGD(schedule)
    variable = keras.Variable(np.zeros(()), dtype="float32")
    seen = []
    for _ in range(5):
        seen.append(float(keras.ops.convert_to_numpy(optimizer.learning_rate)))
        optimizer.apply([keras.ops.ones(())], [variable])
    # Update k uses schedule(k): 0, 0.025, 0.05, 0.075, 0.1; SGD moves by -lr * 1.
    assert seen == pytest.approx([0.0, 0.025, 0.05, 0.075, 0.1])
    assert float(variable.numpy()) == pytest.approx(-sum(seen))


def test_momentum_cycling_drives_adam_beta_1():
    momentum = schedules.OneCycleMomentum(0.5, 0.9, cycle_first_step_size=2)
    cycled = schedules.with_momentum_schedule(keras.optimizers.Adam(0.1), momentum)
    config = cycled.get_config()
    restored = type(cycled).from_config(config)
    assert isinstance(restored.beta_1_schedule, schedules.OneCycleMomentum)
    # One step: m = (1 - beta_1) * g, bias correction 1 - beta_1 -> the step is lr * g /
    # (|g| + eps-ish) for any beta_1, so compare the first moment instead.
    variable = keras.Variable(np.zeros((1,)), dtype="float32")
    cycled.apply([keras.ops.ones((1,))], [variable])
    first_moment = float(cycled._momentums[0].numpy()[0])
    assert first_moment == pytest.approx(1 - 0.7)  # beta_1 at step 0: 0.9 - 0.4 * 0.5
    cycled.apply([keras.ops.ones((1,))], [variable])
    # beta_1 at step 1 is the cycle's low point 0.5: m = 0.5 * 0.3 + 0.5 * 1.
    assert float(cycled._momentums[0].numpy()[0]) == pytest.approx(0.65)
    assert cycled.beta_1 == pytest.approx(0.9)  # the configured value is restored


def test_momentum_cycling_needs_a_beta_1():
    with pytest.raises(TypeError, match="SGD"):
        schedules.with_momentum_schedule(keras.optimizers.SGD(0.1), schedules.OneCycleMomentum())


def test_schedule_trains_in_a_compiled_keras_fit():
    # The schedule runs inside a tf.function (symbolic step), not only eagerly.
    x, y = mlp_data()
    model = mlp()
    model.compile(keras.optimizers.Adam(schedules.WarmupDecayLR(10, 0.0, 0.01, 3)), LOSS)
    history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert int(model.optimizer.iterations.numpy()) == 8
