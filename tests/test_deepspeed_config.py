"""DeepSpeed JSON configs: translation, batch arithmetic, "auto", errors, and training parity."""

import json
from pathlib import Path

import keras
import numpy as np
import pytest
from _models import LOSS, mlp, mlp_data

import epl_trainer as epl
from epl_trainer import deepspeed
from epl_trainer.deepspeed import DeepSpeedConfig, DeepSpeedConfigError, resolve_batch_sizes
from epl_trainer.deepspeed.setup import ScheduleSpec
from epl_trainer.training import deepspeed_run, schedules
from epl_trainer.training.update_rules import FusedLamb

DATA = Path(__file__).parent / "data"
# The two example configs of DeepSpeed's quick-start documentation, verbatim.
STAGE2 = DATA / "ds_quickstart_stage2.json"
STAGE3 = DATA / "ds_quickstart_stage3.json"
TWO_DEVICES = epl.Config({"cluster.virtual_devices": 2})


def _translate(values, optimizer=None, base=TWO_DEVICES, **kwargs):
    """The config translated and its optimizer built, as EPLTrainer does (a DeepSpeedRun)."""
    optimizer = optimizer or keras.optimizers.AdamW(1e-3)
    return deepspeed_run.translate(DeepSpeedConfig(values, base=base, **kwargs), optimizer)


@pytest.fixture
def env_with_two_devices():
    """epl.init with 2 devices for this test only (EPLTrainer(config=<DeepSpeed>) builds on
    it); conftest restores the config after the test."""
    epl.init(TWO_DEVICES)


# ---- the reference configs -----------------------------------------------------------------


def test_reference_stage2_config_translates_with_auto_values_resolved():
    trainer_optimizer = keras.optimizers.AdamW(
        3e-4, beta_1=0.8, beta_2=0.98, epsilon=1e-7, weight_decay=0.05, global_clipnorm=0.5
    )
    run = _translate(str(STAGE2), trainer_optimizer, warmup_num_steps=20)
    config = run.config
    # fp16.enabled "auto" follows the base config's amp, which is off.
    assert config.amp.level == ""
    # Stage 2 + CPU optimizer offload -> ZeRO v1 with the shards' state on the host.
    assert (config.zero.level, config.offload.level) == ("v1", "v0")
    assert config.communication.clip_after_allreduce
    optimizer = run.optimizer
    assert type(optimizer) is keras.optimizers.AdamW
    assert (optimizer.beta_1, optimizer.beta_2, optimizer.epsilon) == (0.8, 0.98, 1e-7)
    assert optimizer.weight_decay == pytest.approx(0.05)
    assert optimizer.global_clipnorm == 0.5
    schedule = optimizer._learning_rate
    assert isinstance(schedule, schedules.WarmupLR)
    assert schedule.get_config() == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": pytest.approx(3e-4),
        "warmup_num_steps": 20,
        "warmup_type": "log",
    }
    assert run.setup.requested == (None, None, None)  # batch sizes come from fit
    assert run.setup.steps_per_print == 100
    assert [(m.kind, m.output_path, m.job_name) for m in run.setup.monitors] == [
        ("csv_monitor", "", "stage2_test")
    ]


def test_reference_stage2_config_fp16_auto_follows_base_amp():
    base = epl.Config({"amp.level": "O1"})
    run = _translate(str(STAGE2), keras.optimizers.AdamW(1e-3), base=base)
    amp = run.config.amp
    assert (amp.level, amp.dtype, amp.loss_scale) == ("O1", "float16", "dynamic")
    assert (amp.initial_scale_power, amp.loss_scale_window, amp.hysteresis) == (16, 1000, 2)
    assert amp.min_loss_scale == 1
    assert run.setup.fp16


def test_reference_stage3_config_trains_with_parameters_and_optimizer_on_the_host(
    tmp_path, monkeypatch, env_with_two_devices
):
    """Stage 3 with offload_optimizer and offload_param: zero.level "v2" (the parameters
    only as shards) with offload (the shards, their optimizer state and update on the
    host); nothing of the section is dropped."""
    monkeypatch.chdir(tmp_path)
    x, y = mlp_data()
    trainer = epl.EPLTrainer(mlp(), LOSS, keras.optimizers.AdamW(1e-2), config=str(STAGE3))
    assert (trainer.config.zero.level, trainer.config.offload.level) == ("v2", "v0")
    trainer.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=3, verbose=0, shuffle=False)
    host = trainer.cluster.host_device
    pieces = trainer.engine.program.update.parameter_pieces()
    assert pieces and {v.value.device for v in pieces} == {host}
    rows = (tmp_path / "stage3_test" / "Train_Samples_train_loss.csv").read_text().splitlines()
    assert len(rows) == 4


def test_reference_stage2_config_trains_and_writes_csv(tmp_path, monkeypatch, env_with_two_devices):
    monkeypatch.chdir(tmp_path)  # output_path "" -> <cwd>/<job_name>, as DeepSpeed
    x, y = mlp_data()
    trainer = epl.EPLTrainer(mlp(), LOSS, keras.optimizers.AdamW(1e-2), config=str(STAGE2))
    trainer.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=3, verbose=0, shuffle=False)
    assert trainer.deepspeed.batch == deepspeed.BatchSizes(16, 8, 1, 2)
    assert (trainer.config.zero.level, trainer.config.offload.level) == ("v1", "v0")
    rows = (tmp_path / "stage2_test" / "Train_Samples_train_loss.csv").read_text().splitlines()
    assert rows[0] == "step,train_loss"
    assert [row.split(",")[0] for row in rows[1:]] == ["0", "16", "32"]


# ---- batch arithmetic ------------------------------------------------------------------------


@pytest.mark.parametrize("train, micro, gas", [(32, 16, 1), (32, 8, 2)])
def test_consistent_batch_sizes_pass(train, micro, gas):
    sizes = resolve_batch_sizes(train, micro, gas, data_parallel_size=2)
    assert sizes == deepspeed.BatchSizes(train, micro, gas, 2)


@pytest.mark.parametrize("train, micro, gas", [(33, 17, 2), (32, 18, 1)])
def test_inconsistent_batch_sizes_fail_showing_every_term(train, micro, gas):
    message = (
        rf"train_batch_size={train}, train_micro_batch_size_per_gpu={micro}, "
        rf"gradient_accumulation_steps={gas}, data_parallel_size=2 \(derived: {train} vs "
        rf"{micro} x {gas} x 2 = {micro * gas * 2}\)"
    )
    with pytest.raises(DeepSpeedConfigError, match=message):
        resolve_batch_sizes(train, micro, gas, data_parallel_size=2)


@pytest.mark.parametrize(
    "given, expected",
    [
        ({"train_batch_size": 32}, (32, 16, 1)),  # micro = train / dp, accumulation 1
        ({"micro_batch_size": 8}, (16, 8, 1)),  # train = micro x 1 x dp
        ({"train_batch_size": 32, "micro_batch_size": 8}, (32, 8, 2)),  # accumulation
        ({"train_batch_size": 32, "gradient_accumulation_steps": 4}, (32, 4, 4)),  # micro
        ({"micro_batch_size": 4, "gradient_accumulation_steps": 3}, (24, 4, 3)),  # train
    ],
)
def test_missing_batch_values_are_derived_as_deepspeed_does(given, expected):
    sizes = resolve_batch_sizes(**given, data_parallel_size=2)
    assert (sizes.train_batch_size, sizes.micro_batch_size, sizes.gradient_accumulation_steps) == (
        expected
    )


def test_derivation_that_does_not_divide_fails():
    # 30 // 8 // 2 = 1 accumulation step, and 8 x 1 x 2 != 30.
    with pytest.raises(DeepSpeedConfigError, match="train_batch_size=30"):
        resolve_batch_sizes(30, 8, None, data_parallel_size=2)


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "8"])
def test_non_positive_or_non_integer_batch_values_fail(bad):
    with pytest.raises(DeepSpeedConfigError, match="must be a positive integer"):
        resolve_batch_sizes(bad, 8, 2, data_parallel_size=2)


def test_batch_needs_train_or_micro():
    with pytest.raises(DeepSpeedConfigError, match="needs train_batch_size or"):
        resolve_batch_sizes(None, None, 2, data_parallel_size=2)


def test_trainer_applies_accumulation_and_checks_fit_batch(env_with_two_devices):
    x, y = mlp_data()
    ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8}
    trainer = epl.EPLTrainer(mlp(), LOSS, keras.optimizers.SGD(0.1), config=ds)
    assert trainer.plan.num_micro_batch == 2  # 32 / (8 x 2 replicas)
    assert trainer.config.pipeline.num_micro_batch == 2
    with pytest.raises(DeepSpeedConfigError, match="Received: batch_size=16"):
        trainer.fit(x, y, batch_size=16, verbose=0, shuffle=False)
    trainer.fit(
        x, y, steps_per_epoch=2, verbose=0, shuffle=False
    )  # batch_size defaults to 32 per worker
    assert int(trainer.optimizer.iterations.numpy()) == 2


@pytest.mark.parametrize(
    "base_amp, precision",
    [
        ({"amp.level": "O1", "amp.dtype": "bfloat16"}, {}),  # DeepSpeed's default: float32
        ({"amp.level": "O1", "amp.loss_scale": 128}, {"fp16": {"enabled": False}}),
    ],
)
def test_a_config_that_turns_amp_off_drops_the_base_configs_amp_tuning(base_amp, precision, caplog):
    """The DeepSpeed config decides the precision. With AMP off it left the base config's
    dtype or loss scale set, which the config rules refuse as keys that do nothing:
    "ValueError: amp.dtype only apply with AMP on; set amp.level='O1' too", naming keys
    the DeepSpeed config never gave."""
    epl.init(epl.Config({"cluster.virtual_devices": 2, **base_amp}))
    x, y = mlp_data()
    ds = {"train_batch_size": 32, **precision}
    with caplog.at_level("WARNING", logger="epl_trainer.deepspeed.translate"):
        trainer = epl.EPLTrainer(mlp(), LOSS, keras.optimizers.SGD(0.1), config=ds)
    assert "the base config's amp.level='O1'" in caplog.text  # the replacement is named
    assert (trainer.config.amp.level, trainer.config.amp.dtype) == ("", "float16")
    assert trainer.config.amp.loss_scale == "dynamic"
    trainer.fit(x, y, steps_per_epoch=1, verbose=0, shuffle=False)
    assert int(trainer.optimizer.iterations.numpy()) == 1


def test_trainer_checks_a_datasets_batch_against_the_config(env_with_two_devices):
    import tensorflow as tf

    x, y = mlp_data()
    ds = {"train_batch_size": 32, "gradient_accumulation_steps": 2}
    trainer = epl.EPLTrainer(mlp(), LOSS, keras.optimizers.SGD(0.1), config=ds)
    with pytest.raises(DeepSpeedConfigError, match="batch_size=16"):
        trainer.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), verbose=0)
    trainer.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(32), verbose=0)


# ---- optimizers ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "section, cls, attributes",
    [
        (
            {"type": "Adam", "params": {"lr": 0.1, "betas": [0.8, 0.9], "eps": 1e-6}},
            keras.optimizers.AdamW,
            {"beta_1": 0.8, "beta_2": 0.9, "epsilon": 1e-6, "weight_decay": 0.0},
        ),
        (
            {"type": "adam", "params": {"lr": 0.1, "adam_w_mode": False}},
            keras.optimizers.Adam,
            {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-8},
        ),
        (
            {"type": "ADAMW", "params": {"lr": 0.1, "weight_decay": 0.01, "amsgrad": True}},
            keras.optimizers.AdamW,
            {"weight_decay": 0.01, "amsgrad": True},
        ),
        (
            {"type": "Adagrad", "params": {"lr": 0.1, "eps": 1e-9}},
            keras.optimizers.Adagrad,
            {"epsilon": 1e-9, "initial_accumulator_value": 0.0},
        ),
        (
            {"type": "Lamb", "params": {"lr": 0.1, "betas": [0.85, 0.99]}},
            FusedLamb,
            {"beta_1": 0.85, "beta_2": 0.99, "epsilon": 1e-8, "min_coeff": 0.01, "max_coeff": 10},
        ),
        (
            {"type": "Lion", "params": {"lr": 0.1, "weight_decay": 0.1}},
            keras.optimizers.Lion,
            {"beta_1": 0.9, "beta_2": 0.999, "weight_decay": 0.1},
        ),
        (
            {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}},
            keras.optimizers.SGD,
            {"momentum": 0.9, "nesterov": True},
        ),
    ],
)
def test_optimizer_types_map_to_keras(section, cls, attributes):
    optimizer = _translate({"optimizer": section}).optimizer
    assert type(optimizer) is cls
    assert float(optimizer.learning_rate.numpy()) == pytest.approx(0.1)
    for name, value in attributes.items():
        assert getattr(optimizer, name) == pytest.approx(value), name


@pytest.mark.parametrize(
    "section, match",
    [
        ({"type": "OneBitAdam", "params": {"lr": 0.1}}, "OneBitAdam.*not supported"),
        ({"type": "RAdam", "params": {"lr": 0.1}}, "must be one of Adam, AdamW"),
        ({"type": "AdamW", "params": {"lr": 0.1, "beta": [0.9, 0.99]}}, "did you mean 'betas'"),
        ({"type": "Lamb", "params": {"max_coeff": 0.001}}, "max_coeff.*>= min_coeff"),
        ({"type": "SGD", "params": {}}, "lr is required"),
    ],
)
def test_optimizer_errors_name_the_key(section, match):
    with pytest.raises(DeepSpeedConfigError, match=match):
        _translate({"optimizer": section})


def test_auto_optimizer_params_come_from_the_trainer_optimizer():
    trainer_optimizer = keras.optimizers.Adam(0.02, beta_1=0.7, beta_2=0.95, epsilon=1e-5)
    section = {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    }
    optimizer = _translate({"optimizer": section}, trainer_optimizer).optimizer
    assert float(optimizer.learning_rate.numpy()) == pytest.approx(0.02)
    assert (optimizer.beta_1, optimizer.beta_2, optimizer.epsilon) == (0.7, 0.95, 1e-5)
    assert optimizer.weight_decay == 0.0


def test_auto_lr_from_a_scheduled_trainer_optimizer_is_an_error():
    trainer_optimizer = keras.optimizers.SGD(schedules.WarmupLR())
    with pytest.raises(DeepSpeedConfigError, match=r"optimizer\.params\.lr='auto'"):
        _translate({"optimizer": {"type": "SGD", "params": {"lr": "auto"}}}, trainer_optimizer)


def test_without_optimizer_section_the_trainer_optimizer_gets_schedule_and_clipping():
    values = {
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "gradient_clipping": 2.0,
    }
    optimizer = _translate(values, keras.optimizers.RMSprop(0.3, rho=0.8)).optimizer
    assert type(optimizer) is keras.optimizers.RMSprop
    assert optimizer.rho == 0.8
    assert isinstance(optimizer._learning_rate, schedules.WarmupLR)
    assert optimizer.global_clipnorm == 2.0


def test_the_translation_is_data_and_the_trainer_builds_the_optimizer_from_it():
    """deepspeed/ reads the trainer's optimizer as plain values and describes the optimizer
    it asks for; training/deepspeed_run.py builds the Keras optimizer from the description."""
    trainer = deepspeed.TrainerOptimizer("SGD", learning_rate=0.2, global_clipnorm=1.5)
    values = {
        "optimizer": {
            "type": "Adam",
            "params": {"lr": "auto", "adam_w_mode": False, "weight_decay": 0.01},
        },
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "gradient_clipping": "auto",
    }
    spec = DeepSpeedConfig(values, base=TWO_DEVICES).translate(trainer).optimizer
    assert (spec.rule, spec.l2_weight_decay, spec.global_clipnorm) == ("Adam", 0.01, 1.5)
    assert spec.arguments["learning_rate"] == 0.2 and spec.arguments["beta_1"] == 0.9
    assert spec.schedule == ScheduleSpec("WarmupLR", {"warmup_num_steps": 5}, 0.2)
    built = deepspeed_run.build_optimizer(spec, keras.optimizers.SGD())
    assert isinstance(built, keras.optimizers.Adam) and built.l2_weight_decay == 0.01
    assert isinstance(built._learning_rate, schedules.WarmupLR) and built.global_clipnorm == 1.5
    with pytest.raises(DeepSpeedConfigError, match="scheduler WarmupDecayLR needs params"):
        _translate({"scheduler": {"type": "WarmupDecayLR", "params": {}}})


# ---- schedulers ------------------------------------------------------------------------------


def test_scheduler_types_and_auto_values():
    optimizer = {"type": "AdamW", "params": {"lr": 0.5}}
    scheduler = {
        "type": "WarmupDecayLR",
        "params": {"warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"},
    }
    values = {"optimizer": optimizer, "scheduler": scheduler}
    with pytest.raises(DeepSpeedConfigError, match="total_num_steps='auto' needs"):
        _translate(values)
    setup = _translate(values, warmup_num_steps=7, total_num_steps=70)
    assert setup.optimizer._learning_rate.get_config() == {
        "total_num_steps": 70,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 0.5,
        "warmup_num_steps": 7,
        "warmup_type": "log",
    }
    cosine = {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}}
    schedule = _translate({"optimizer": optimizer, "scheduler": cosine}).optimizer._learning_rate
    assert isinstance(schedule, schedules.WarmupCosineLR) and schedule.learning_rate == 0.5
    rrt = {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 0.01}}
    assert isinstance(
        _translate({"scheduler": rrt}).optimizer._learning_rate, schedules.LRRangeTest
    )


def test_one_cycle_cycles_adam_momentum_and_not_sgd(caplog):
    cycle = {
        "type": "OneCycle",
        "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4},
    }
    adam = _translate({"optimizer": {"type": "Adam", "params": {}}, "scheduler": cycle}).optimizer
    assert isinstance(adam, schedules.ScheduledBeta1AdamW)
    assert adam.beta_1_schedule.get_config()["cycle_first_step_size"] == 4
    sgd = _translate({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "scheduler": cycle})
    assert type(sgd.optimizer) is keras.optimizers.SGD  # as DeepSpeed: no betas, no cycling
    assert "cycle_momentum is off" in caplog.text
    off = {**cycle, "params": {**cycle["params"], "cycle_momentum": False}}
    adam = _translate({"optimizer": {"type": "Adam", "params": {}}, "scheduler": off}).optimizer
    assert type(adam) is keras.optimizers.AdamW


def test_scheduler_errors_name_the_key():
    with pytest.raises(DeepSpeedConfigError, match=r"scheduler\.type must be one of"):
        _translate({"scheduler": {"type": "Cosine", "params": {}}})
    with pytest.raises(DeepSpeedConfigError, match="did you mean 'warmup_num_steps'"):
        _translate({"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 3}}})
    with pytest.raises(DeepSpeedConfigError, match="warmup_type must be one of"):
        _translate({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cos"}}})


# ---- precision, memory, monitors, unknown keys -----------------------------------------------


def test_fp16_and_bf16_map_to_amp():
    fixed = _translate({"fp16": {"enabled": True, "loss_scale": 128, "hysteresis": 3}}).config.amp
    assert (fixed.level, fixed.dtype, fixed.loss_scale, fixed.hysteresis) == (
        "O1",
        "float16",
        128,
        3,
    )
    bf16 = _translate({"bf16": {"enabled": True}}).config.amp
    assert (bf16.level, bf16.dtype) == ("O1", "bfloat16")
    with pytest.raises(DeepSpeedConfigError, match="both fp16 and bf16"):
        _translate({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    with pytest.raises(DeepSpeedConfigError, match="consecutive_hysteresis"):
        _translate({"fp16": {"enabled": True, "consecutive_hysteresis": True}})


@pytest.mark.parametrize(
    "zero, levels",
    [
        ({"stage": 0}, ("", "")),
        ({"stage": 1}, ("v0", "")),
        ({"stage": 2}, ("v1", "")),
        ({"stage": 3}, ("v2", "")),
        ({"stage": 3, "offload_param": {"device": "cpu"}}, ("v2", "v0")),
    ],
)
def test_zero_stages_map_to_levels(zero, levels):
    config = _translate({"zero_optimization": zero}).config
    assert (config.zero.level, config.offload.level) == levels


@pytest.mark.parametrize(
    "zero, error, match",
    [
        ({"stage": 2, "offload_optimizer": {"device": "nvme"}}, DeepSpeedConfigError, "NVMe"),
        ({"stage": 2, "offload_param": {"device": "cpu"}}, DeepSpeedConfigError, "stage 3"),
        ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, DeepSpeedConfigError, "stage 1"),
        ({"stage": 2, "reduce_scatter": False}, DeepSpeedConfigError, "reduce_scatter"),
        ({"stage": 2, "overlap_com": True}, DeepSpeedConfigError, "did you mean 'overlap_comm'"),
    ],
)
def test_zero_errors(zero, error, match):
    with pytest.raises(error, match=match):
        _translate({"zero_optimization": zero})


def test_a_trainer_optimizer_with_a_keras_schedule_needs_no_number_unless_read():
    """Without an optimizer section, the trainer's optimizer may have a Keras schedule:
    its rate is read only by an "auto" warmup_max_lr or WarmupCosineLR. (Any config
    without an optimizer section was refused, naming an 'auto' the config did not hold.)"""
    decay = keras.optimizers.schedules.ExponentialDecay(0.01, 10, 0.9)
    trainer_optimizer = lambda: keras.optimizers.AdamW(decay)  # noqa: E731
    kept = _translate({"train_batch_size": 8}, trainer_optimizer()).optimizer
    assert isinstance(kept._learning_rate, keras.optimizers.schedules.ExponentialDecay)
    warmup = {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 3}}
    replaced = _translate({"scheduler": warmup}, trainer_optimizer()).optimizer
    assert isinstance(replaced._learning_rate, schedules.WarmupLR)
    cosine = {"type": "WarmupCosineLR", "params": {"total_num_steps": 10}}
    auto = {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}
    for section in (cosine, auto):
        with pytest.raises(DeepSpeedConfigError, match="which is a schedule"):
            _translate({"scheduler": section}, trainer_optimizer())


@pytest.mark.parametrize("clipping", [{"clipnorm": 1.0}, {"clipvalue": 0.5}])
def test_gradient_clipping_and_the_trainer_optimizers_own_clipping_are_refused(clipping):
    """Keras optimizers take one kind of clipping; both failed inside Keras ("Only one
    of `clipnorm`, `clipvalue` and `global_clipnorm` can be set"), naming neither side."""
    with pytest.raises(DeepSpeedConfigError, match=r"gradient_clipping=1.0, clip"):
        _translate({"gradient_clipping": 1.0}, keras.optimizers.SGD(0.1, **clipping))
    # Without gradient_clipping (DeepSpeed's default 0) the optimizer's own clipping stays.
    kept = _translate({"train_batch_size": 8}, keras.optimizers.SGD(0.1, **clipping))
    assert [getattr(kept.optimizer, k) for k in clipping] == list(clipping.values())


def test_zero_keys_by_their_pydantic_names_are_accepted():
    """DeepSpeed reads `prefetch_bucket_size` & co. by name or by their `stage3_` alias;
    both spellings are tuning keys here (the names were refused as unknown keys)."""
    names = {
        "prefetch_bucket_size": 5e7,
        "param_persistence_threshold": 1e5,
        "model_persistence_threshold": 1e9,
        "max_live_parameters": 1e9,
        "max_reuse_distance": 1e9,
        "gather_16bit_weights_on_model_save": True,
        "memory_efficient_linear": True,
    }
    config = _translate({"zero_optimization": {"stage": 3, **names}}).config
    assert config.zero.level == "v2"


@pytest.mark.parametrize("dtype", ["fp32", None])
def test_float32_gradient_accumulation_is_accepted(dtype):
    """data_types.grad_accum_dtype "fp32" is what the engine does (bf16 configs write it);
    the whole section used to be refused as an unbuilt feature. bf16.immediate_grad_update
    (when DeepSpeed moves gradients into float32) was refused as an unknown key."""
    values = {
        "bf16": {"enabled": True, "immediate_grad_update": False},
        "data_types": {"grad_accum_dtype": dtype},
    }
    assert _translate(values).config.amp.dtype == "bfloat16"
    with pytest.raises(DeepSpeedConfigError, match="grad_accum_dtype='bf16' is not supported"):
        _translate({**values, "data_types": {"grad_accum_dtype": "bf16"}})
    with pytest.raises(DeepSpeedConfigError, match="did you mean 'grad_accum_dtype'"):
        _translate({**values, "data_types": {"grad_acum_dtype": "fp32"}})


def test_activation_checkpointing_turns_on_gradient_checkpointing():
    assert _translate({}).config.gradient_checkpoint.type == ""
    on = _translate({"activation_checkpointing": {"partition_activations": False}})
    assert on.config.gradient_checkpoint.type == "auto"
    base = epl.Config({"gradient_checkpoint.type": "collection"})
    assert _translate(
        {"activation_checkpointing": {}}, base=base
    ).config.gradient_checkpoint.type == ("collection")
    with pytest.raises(DeepSpeedConfigError, match="cpu_checkpointing"):
        _translate({"activation_checkpointing": {"cpu_checkpointing": True}})


@pytest.mark.parametrize(
    "values, match",
    [
        ({"gradient_clipp1ng": 1.0}, "did you mean 'gradient_clipping'"),
        ({"wandb": {"enabled": True}}, "wandb.*not supported"),
        ({"pipeline": {"stages": 2}}, "pipeline.*not supported"),
        ({"wall_clock_breakdown": True}, r"config wall_clock_breakdown=True is not supported"),
        ({"csv_monitor": {"enabled": True, "path": "x"}}, "'path'"),
        ({"steps_per_print": 0}, "steps_per_print must be >= 1"),
        ({"gradient_clipping": "1.0"}, "gradient_clipping must be a number"),
    ],
)
def test_unknown_and_unsupported_keys_are_errors(values, match):
    with pytest.raises(DeepSpeedConfigError, match=match):
        _translate(values)


def test_native_keys_in_a_deepspeed_config_point_to_the_base_config():
    match = r"EPL config keys \['cluster\.virtual_devices'\]"
    with pytest.raises(DeepSpeedConfigError, match=match):
        _translate({"train_batch_size": 8, "cluster.virtual_devices": 2})


def test_disabled_unsupported_features_are_accepted():
    run = _translate({"wandb": {"enabled": False}, "comet": {"enabled": False}})
    assert run.setup.monitors == ()


def test_flops_profiler_maps_onto_the_profiler_section():
    section = {
        "enabled": True,
        "recompute_fwd_factor": 0.0,
        "profile_step": 3,
        "module_depth": 2,
        "top_modules": 4,
        "detailed": False,
        "output_file": "profile.txt",
    }
    profiler = _translate({"flops_profiler": section}).config.profiler
    assert (profiler.flops, profiler.profile_step, profiler.module_depth) == (True, 3, 2)
    assert (profiler.top_modules, profiler.detailed, profiler.output_file) == (
        4,
        False,
        "profile.txt",
    )
    # DeepSpeed's defaults, and output_file null = stdout.
    defaults = _translate({"flops_profiler": {"enabled": True, "output_file": None}})
    assert defaults.config.profiler == epl.Config({"profiler.flops": True}).profiler
    # Off, absent (DeepSpeed's default) or "auto" (the base config's setting).
    on = epl.Config({"cluster.virtual_devices": 2, "profiler.flops": True})
    assert not _translate({"flops_profiler": {"enabled": False}}, base=on).config.profiler.flops
    assert not _translate({}, base=on).config.profiler.flops
    assert _translate({"flops_profiler": {"enabled": "auto"}}, base=on).config.profiler.flops
    # The base config's peak (not a DeepSpeed key) stays.
    peak = epl.Config({"profiler.peak_tflops": 312})
    setup = _translate({"flops_profiler": {"enabled": True}}, base=peak)
    assert setup.config.profiler.peak_tflops == 312


@pytest.mark.parametrize(
    "section, match",
    [
        (
            {"enabled": True, "recompute_fwd_factor": 0.5},
            r"flops_profiler.recompute_fwd_factor=0.5 is not supported.*model's FLOPs",
        ),
        ({"enabled": True, "top_modules": 0}, "flops_profiler.top_modules must be >= 1"),
        ({"enabled": True, "detailed": "yes"}, "flops_profiler.detailed must be true or false"),
        ({"enabled": True, "output": "x"}, "'output'"),
    ],
)
def test_flops_profiler_refuses_what_cannot_apply_by_name(section, match):
    with pytest.raises(DeepSpeedConfigError, match=match):
        _translate({"flops_profiler": section})


def test_gradient_clipping_auto_comes_from_the_trainer_optimizer():
    clipped = _translate({"gradient_clipping": "auto"}, keras.optimizers.SGD(global_clipnorm=3.0))
    assert clipped.optimizer.global_clipnorm == 3.0
    unclipped = _translate({"gradient_clipping": "auto"}, keras.optimizers.SGD())
    assert unclipped.optimizer.global_clipnorm is None
    assert not unclipped.config.communication.clip_after_allreduce


def test_missing_gradient_clipping_drops_the_optimizer_clipnorm_with_a_warning(caplog):
    setup = _translate({}, keras.optimizers.SGD(global_clipnorm=3.0))
    assert setup.optimizer.global_clipnorm is None  # DeepSpeed's default: no clipping
    assert "global_clipnorm=3.0 is not used" in caplog.text


def test_deepspeed_configs_are_told_apart_from_native_ones(tmp_path):
    assert deepspeed.is_deepspeed_config({"train_batch_size": 8})
    assert deepspeed.is_deepspeed_config({"optimizer": {"type": "Adam", "params": {}}})
    assert not deepspeed.is_deepspeed_config({"optimizer": {"num_apply_group": 2}})
    assert not deepspeed.is_deepspeed_config({"pipeline.num_micro_batch": 2})
    assert deepspeed.is_deepspeed_config(str(STAGE2))
    native = tmp_path / "native.json"
    native.write_text(json.dumps({"zero": {"level": "v0"}}))
    assert not deepspeed.is_deepspeed_config(str(native))


def test_unreadable_file_names_the_file(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text("{not json")
    with pytest.raises(DeepSpeedConfigError, match=r"ds\.json' is not valid JSON"):
        DeepSpeedConfig(str(bad))


# ---- a DeepSpeed config trains exactly like its native equivalent ------------------------------

PARITY_CASES = {
    "adamw_warmup_decay_zero1_clip_accumulation": (
        {
            "train_batch_size": 32,
            "gradient_accumulation_steps": 2,
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-7, "weight_decay": 0.01},
            },
            "scheduler": {
                "type": "WarmupDecayLR",
                "params": {"total_num_steps": 6, "warmup_max_lr": 0.02, "warmup_num_steps": 2},
            },
            "gradient_clipping": 0.5,
            "zero_optimization": {"stage": 1},
        },
        {"pipeline.num_micro_batch": 2, "zero.level": "v0"},
        lambda: keras.optimizers.AdamW(
            schedules.WarmupDecayLR(6, 0.0, 0.02, 2),
            beta_1=0.8,
            beta_2=0.99,
            epsilon=1e-7,
            weight_decay=0.01,
            global_clipnorm=0.5,
        ),
    ),
    "adam_one_cycle_momentum_zero2_offload": (
        {
            "train_micro_batch_size_per_gpu": 16,
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
            "scheduler": {
                "type": "OneCycle",
                "params": {
                    "cycle_min_lr": 0.001,
                    "cycle_max_lr": 0.02,
                    "cycle_first_step_size": 2,
                    "cycle_min_mom": 0.8,
                    "cycle_max_mom": 0.95,
                },
            },
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        },
        {"zero.level": "v1", "offload.level": "v0"},
        lambda: schedules.with_momentum_schedule(
            keras.optimizers.AdamW(
                schedules.OneCycle(0.001, 0.02, cycle_first_step_size=2),
                epsilon=1e-8,
                weight_decay=0.0,
            ),
            schedules.OneCycleMomentum(0.8, 0.95, cycle_first_step_size=2),
        ),
    ),
}


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_deepspeed_config_and_native_config_train_to_identical_weights(case):
    ds_values, native_keys, native_optimizer = PARITY_CASES[case]
    x, y = mlp_data(n=192)
    ds_model, native_model = mlp(seed=3), mlp(seed=3)
    ds_trainer = epl.EPLTrainer(ds_model, LOSS, config=DeepSpeedConfig(ds_values, base=TWO_DEVICES))
    native = {"cluster.virtual_devices": 2, **native_keys}
    if "gradient_clipping" in ds_values:
        native["communication.clip_after_allreduce"] = True
    native_trainer = epl.EPLTrainer(native_model, LOSS, native_optimizer(), config=native)
    assert ds_trainer.config == native_trainer.config
    ds_trainer.fit(x, y, epochs=2, steps_per_epoch=3, verbose=0, shuffle=False)
    native_trainer.fit(x, y, batch_size=32, epochs=2, steps_per_epoch=3, verbose=0, shuffle=False)
    for a, b in zip(ds_model.get_weights(), native_model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert int(ds_trainer.optimizer.iterations.numpy()) == 6
    # The weights moved: the comparison is not between two untouched models.
    assert not np.array_equal(ds_model.get_weights()[0], mlp(seed=3).get_weights()[0])


def test_deepspeed_config_flag():
    from absl import flags

    from epl_trainer.runtime import flags as epl_flags

    flag_values = flags.FlagValues()
    epl_flags.define_flags(flag_values)
    flag_values(["prog"])
    assert epl_flags.deepspeed_config_from_flags(flag_values) is None
    flag_values(["prog", f"--deepspeed_config={STAGE2}"])
    ds = epl_flags.deepspeed_config_from_flags(flag_values, total_num_steps=50)
    assert isinstance(ds, DeepSpeedConfig) and ds.total_num_steps == 50
    assert ds.values["zero_optimization"]["stage"] == 2


def test_example_configs_in_configs_dir_translate():
    configs = Path(__file__).parents[1] / "configs"
    for path in sorted(configs.glob("ds_*.json")):
        setup = _translate(str(path))
        assert setup.config.zero.level or setup.config.offload.level, path.name


def test_activation_checkpointing_recomputes_and_trains_like_without():
    x, y = mlp_data()
    ds = {
        "train_batch_size": 16,
        "activation_checkpointing": {},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    recomputed_model, plain_model = mlp(seed=5), mlp(seed=5)
    trainer = epl.EPLTrainer(recomputed_model, LOSS, config=DeepSpeedConfig(ds, base=TWO_DEVICES))
    trainer.fit(x, y, steps_per_epoch=2, verbose=0, shuffle=False)
    assert trainer.engine.program.recomputed  # the stage runs as recomputed segments
    plain = epl.EPLTrainer(plain_model, LOSS, keras.optimizers.SGD(0.1), config=TWO_DEVICES)
    plain.fit(x, y, batch_size=16, steps_per_epoch=2, verbose=0, shuffle=False)
    for a, b in zip(recomputed_model.get_weights(), plain_model.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-6)


# ---- communication keys: sparse rows, the fp16 wire, where 1/N is applied ----------------------


def test_communication_keys_translate_to_the_engines():
    assert _translate({"sparse_gradients": True}).config.communication.sparse_as_dense is False
    assert _translate({"sparse_gradients": False}).config.communication.sparse_as_dense is True
    fp16 = _translate({"communication_data_type": "fp16"}).config.communication
    assert fp16.fp16 and fp16.fp16_scale == 128
    assert _translate({"communication_data_type": "fp32"}).config.communication.fp16 is False
    predivided = _translate({"communication_data_type": "fp16", "gradient_predivide_factor": 4})
    assert predivided.config.communication.fp16_scale == 32  # the wire carries g * 128 / 4
    with pytest.raises(DeepSpeedConfigError, match=r"bf16.*float16 only.*communication\.fp16"):
        _translate({"communication_data_type": "bf16"})
    with pytest.raises(DeepSpeedConfigError, match="only without prescale_gradients"):
        _translate({"prescale_gradients": True, "gradient_predivide_factor": 2.0})


@pytest.mark.parametrize("sparse", [True, False])
def test_sparse_gradients_train_like_plain_keras(sparse):
    """Embedding rows gathered (true) or reduced as a dense table (false): the same
    weights as one Keras model on the whole batch."""
    from _models import keras_reference, parity_data, parity_model

    x, y = parity_data(48)
    model, reference = parity_model(), parity_model()
    ds = DeepSpeedConfig(
        {"train_batch_size": 16, "sparse_gradients": sparse, "optimizer": _SGD}, base=TWO_DEVICES
    )
    epl.EPLTrainer(model, LOSS, config=ds).fit(x, y, epochs=1, verbose=0, shuffle=False)
    keras_reference(reference, x, y, keras.optimizers.SGD(0.1), 16, 3)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=2e-6)


_SGD = {"type": "SGD", "params": {"lr": 0.1}}


def _large_gradient_problem():
    """A linear model whose kernel gradient is -400 per element on each replica: 400 x 128
    (the wire's scale) fits float16, the sum of two members' (102,400) does not."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = keras.Model(
        inputs, keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")(inputs)
    )
    x = np.full((8, 4), 200.0, "float32")
    return model, x, np.ones((8, 1), "float32")


def test_prescale_gradients_keeps_the_fp16_wire_from_overflowing():
    """DeepSpeed divides by the data-parallel size before the sum with prescale_gradients:
    on the float16 wire that is what keeps a sum of two large gradients finite."""
    values = {"train_batch_size": 8, "communication_data_type": "fp16", "optimizer": _SGD}
    with pytest.raises(epl.NonFiniteLossError):
        model, x, y = _large_gradient_problem()
        trainer = epl.EPLTrainer(model, "mse", config=DeepSpeedConfig(values, base=TWO_DEVICES))
        trainer.fit(x, y, epochs=1, verbose=0)
    model, x, y = _large_gradient_problem()
    prescaled = DeepSpeedConfig({**values, "prescale_gradients": True}, base=TWO_DEVICES)
    trainer = epl.EPLTrainer(model, "mse", config=prescaled)
    trainer.fit(x, y, epochs=1, verbose=0)
    assert trainer.config.communication.fp16_scale == 64  # 128 / 2 replicas
    reference, _, _ = _large_gradient_problem()
    reference.compile(keras.optimizers.SGD(0.1), "mse")
    reference.fit(x, y, batch_size=8, epochs=1, verbose=0)
    np.testing.assert_allclose(model.get_weights()[0], reference.get_weights()[0], rtol=1e-3)


# ---- PyTorch's coupled (L2) weight decay and DeepSpeed's FusedLamb -------------------------------


def _with_l2(model, factor):
    """`model` rebuilt with L2(factor) on every weight (the same initial values)."""
    config = model.get_config()
    for layer in config["layers"]:
        if layer["class_name"] == "Dense":
            layer["config"]["kernel_regularizer"] = keras.regularizers.L2(factor)
            layer["config"]["bias_regularizer"] = keras.regularizers.L2(factor)
    rebuilt = keras.Model.from_config(config)
    rebuilt.set_weights(model.get_weights())
    return rebuilt


@pytest.mark.parametrize(
    "section, keras_optimizer",
    [
        (
            {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            lambda: keras.optimizers.SGD(0.1, 0.9),
        ),
        (
            {"type": "Adam", "params": {"lr": 0.01, "adam_w_mode": False}},
            lambda: keras.optimizers.Adam(0.01, epsilon=1e-8),
        ),
        (
            {"type": "Adagrad", "params": {"lr": 0.1}},
            lambda: keras.optimizers.Adagrad(0.1, 0.0, 1e-10),
        ),
    ],
    ids=["sgd", "adam_l2", "adagrad"],
)
def test_coupled_weight_decay_trains_like_keras_with_an_l2_loss(section, keras_optimizer):
    """DeepSpeed (PyTorch) adds weight_decay * w to each gradient: the gradient of an
    L2 loss of weight_decay / 2 * |w|^2, which a plain Keras model gets as regularizers."""
    from _models import keras_reference

    x, y = mlp_data(48)
    decay = 0.1
    model = mlp(seed=3)
    reference = _with_l2(mlp(seed=3), decay / 2)
    section = {**section, "params": {**section["params"], "weight_decay": decay}}
    ds = DeepSpeedConfig({"train_batch_size": 16, "optimizer": section}, base=TWO_DEVICES)
    epl.EPLTrainer(model, LOSS, config=ds).fit(x, y, epochs=1, verbose=0, shuffle=False)
    keras_reference(reference, x, y, keras_optimizer(), 16, 3)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    undecayed = mlp(seed=3)
    keras_reference(undecayed, x, y, keras_optimizer(), 16, 3)
    assert (
        max(np.abs(a - b).max() for a, b in zip(model.get_weights(), undecayed.get_weights()))
        > 1e-3
    )


def _fused_lamb_reference(model, x, y, steps, lr, betas, eps, decay, min_coeff, max_coeff):
    """DeepSpeed's FusedLamb in NumPy (csrc/lamb: update = m_hat / (sqrt(v_hat) + eps) +
    decay * w; coefficient |w| / |update| (1 when either is 0), clamped to [min_coeff,
    max_coeff]; w -= lr * coefficient * update), on gradients of the whole batch."""
    import tensorflow as tf

    weights = [w.copy() for w in model.get_weights()]
    m = [np.zeros_like(w) for w in weights]
    v = [np.zeros_like(w) for w in weights]
    batch = len(x) // steps
    for t in range(1, steps + 1):
        model.set_weights(weights)
        rows = slice((t - 1) * batch, t * batch)
        with tf.GradientTape() as tape:
            loss = LOSS(y[rows], model(x[rows]))
        grads = [g.numpy() for g in tape.gradient(loss, model.trainable_weights)]
        for i, (w, g) in enumerate(zip(weights, grads)):
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
            m_hat, v_hat = m[i] / (1 - betas[0] ** t), v[i] / (1 - betas[1] ** t)
            update = m_hat / (np.sqrt(v_hat) + eps) + decay * w
            w_norm, u_norm = np.linalg.norm(w), np.linalg.norm(update)
            coefficient = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
            coefficient = min(max(coefficient, min_coeff), max_coeff)
            weights[i] = w - lr * coefficient * update
    return weights


def test_lamb_weight_decay_and_coefficient_clamp_follow_deepspeeds_fused_lamb():
    x, y = mlp_data(48)
    params = {"lr": 0.01, "betas": [0.9, 0.99], "eps": 1e-6, "weight_decay": 0.01}
    params.update(min_coeff=0.05, max_coeff=0.5)  # clamps both ways on this model
    model = mlp(seed=3)
    ds = DeepSpeedConfig(
        {"train_batch_size": 16, "optimizer": {"type": "Lamb", "params": params}},
        base=TWO_DEVICES,
    )
    epl.EPLTrainer(model, LOSS, config=ds).fit(x, y, epochs=1, verbose=0, shuffle=False)
    expected = _fused_lamb_reference(mlp(seed=3), x, y, 3, 0.01, (0.9, 0.99), 1e-6, 0.01, 0.05, 0.5)
    for a, b in zip(model.get_weights(), expected):
        np.testing.assert_allclose(a, b, atol=2e-6)


def test_the_decoupled_checkpoint_writer_is_async_save():
    """DeepSpeed's `checkpoint.writer.decoupled` (its asynchronous checkpoint engine)."""

    def translated(section):
        return _translate({"train_micro_batch_size_per_gpu": 2, "checkpoint": section}).config

    assert translated({"writer": {"decoupled": True, "type": "fast"}}).checkpoint.async_save
    assert not translated({"writer": {"type": "python"}}).checkpoint.async_save
    assert not translated({"load_universal": True, "tag_validation": "Fail"}).checkpoint.async_save
    with pytest.raises(DeepSpeedConfigError, match="'mock' writer saves nothing"):
        translated({"writer": {"type": "mock"}})
    with pytest.raises(DeepSpeedConfigError, match=r"'decoupld'.*did you mean 'decoupled'"):
        translated({"writer": {"decoupld": True}})
    with pytest.raises(DeepSpeedConfigError, match="tag_validation='Ignore'"):
        translated({"tag_validation": "Ignore"})
