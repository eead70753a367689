"""The user's XLA intent (training/compiled.py `user_jit_intent`): Keras's `compile`
records its default `jit_compile="auto"` resolved, True on a GPU, so a model compiled
with the default must not read as `jit_compile=True` there, which would refuse split
layers, synchronized BatchNorm and gradient checkpointing to a user who never asked for
XLA. Only `EPLTrainer(jit_compile=True)` or a value Keras's "auto" would not give is the
user's choice.

A GPU is faked where Keras looks for one: `Trainer._resolve_auto_jit_compile` asks
`tf.config.list_physical_devices()` (no device type) for any device but a CPU. The fake
holds during `compile` and the trainer's construction (where both decide); training runs
on the CPU devices of conftest.py and matches plain Keras there.
"""

import contextlib
import re

import keras
import pytest
import tensorflow as tf
from _models import LOSS, keras_reference, max_weight_difference, mlp, mlp_data
from test_split import data, head_model, split_trainer

import epl_trainer as epl
from epl_trainer.training.compiled import user_jit_intent

ATOL = 1e-5
CHECKPOINTING = {"cluster.virtual_devices": 2, "gradient_checkpoint.type": "auto"}
REFUSED = re.escape("Received: jit_compile=True, gradient_checkpoint.type='auto'")
OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.1), "adam": lambda: keras.optimizers.Adam(0.01)}


@contextlib.contextmanager
def keras_sees_a_gpu(monkeypatch):
    real = tf.config.list_physical_devices
    gpu = tf.config.PhysicalDevice(name="/physical_device:GPU:0", device_type="GPU")

    def list_physical_devices(device_type=None):
        devices = real(device_type)
        return [*devices, gpu] if device_type is None else devices

    with monkeypatch.context() as patch:
        patch.setattr(tf.config, "list_physical_devices", list_physical_devices)
        yield


def _compiled(gpu, monkeypatch, **compile_kwargs):
    model = mlp()
    with keras_sees_a_gpu(monkeypatch) if gpu else contextlib.nullcontext():
        model.compile(keras.optimizers.SGD(0.1), LOSS, **compile_kwargs)
        return model, user_jit_intent(model)


def test_keras_records_its_auto_resolved_to_true_on_a_gpu(monkeypatch):
    """What the fake makes Keras do, and what each of its two values holds: the default
    compile records True in `_compile_config` and runs with `model.jit_compile` True."""
    model, intent = _compiled(True, monkeypatch)
    assert model._compile_config.config["jit_compile"] is True
    assert model.jit_compile is True
    assert intent == "auto"
    on_cpu, intent = _compiled(False, monkeypatch)
    assert on_cpu._compile_config.config["jit_compile"] is False
    assert intent == "auto"


@pytest.mark.parametrize(
    "gpu, compile_kwargs, intent",
    [
        (False, {}, "auto"),
        (False, {"jit_compile": False}, "auto"),  # what "auto" gives on a CPU
        (False, {"jit_compile": True}, True),  # "auto" would not give it on a CPU
        (True, {}, "auto"),
        (True, {"jit_compile": True}, "auto"),  # Keras keeps nothing that tells it apart
        (True, {"jit_compile": False}, False),  # "auto" would not give it on a GPU
        (True, {"run_eagerly": True}, "auto"),  # "auto" is False when run eagerly
    ],
)
def test_only_a_value_keras_auto_would_not_give_is_the_users(
    monkeypatch, gpu, compile_kwargs, intent
):
    _, found = _compiled(gpu, monkeypatch, **compile_kwargs)
    assert found == intent


def test_an_uncompiled_model_is_auto():
    assert user_jit_intent(mlp()) == "auto"


def test_gradient_checkpointing_is_not_refused_for_a_gpu_default_compile(monkeypatch):
    """Before: `EPLTrainer` read the recorded True as the user's and refused
    gradient checkpointing ("jit_compile=True compiles each stage whole ...")."""
    # SGD only: the refusal read the compiled model's jit_compile, whichever optimizer it
    # was compiled with. Its Adam cell re-ran the same check (trimmed for the suite's time).
    optimizer = "sgd"
    x, y = mlp_data()
    reference = mlp()
    keras_reference(reference, x, y, OPTIMIZERS[optimizer](), batch_size=16, steps=4)
    model = mlp()
    with keras_sees_a_gpu(monkeypatch):
        model.compile(OPTIMIZERS[optimizer](), LOSS)
        trainer = epl.EPLTrainer(model, config=CHECKPOINTING)
    assert trainer.jit_compile == "auto"
    assert trainer.engine_plan.jit.reason.startswith("auto: ")
    trainer.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=4, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < ATOL


def test_a_split_layer_is_not_refused_for_a_gpu_default_compile(monkeypatch):
    """Before: SplitError "... Use jit_compile=False." for a model compiled with
    Keras's default on a GPU."""
    x, y = data()
    reference = head_model()
    keras_reference(reference, x, y, keras.optimizers.SGD(0.1), batch_size=16, steps=3)
    model = head_model()
    with keras_sees_a_gpu(monkeypatch):
        model.compile(keras.optimizers.SGD(0.1), LOSS)
        trainer = split_trainer(model, 2)
    assert trainer.engine_plan.jit.reason.startswith("auto: ")
    trainer.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=3, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < ATOL


def test_the_trainers_own_true_stays_explicit_on_a_gpu(monkeypatch):
    model = mlp()
    with keras_sees_a_gpu(monkeypatch):
        model.compile(keras.optimizers.SGD(0.1), LOSS)
        with pytest.raises(ValueError, match=REFUSED):
            epl.EPLTrainer(model, jit_compile=True, config=CHECKPOINTING)


def test_compile_true_on_a_cpu_stays_explicit(monkeypatch):
    """Keras's "auto" gives False on a CPU, so a recorded True was asked for."""
    model, _ = _compiled(False, monkeypatch, jit_compile=True)
    with pytest.raises(ValueError, match=REFUSED):
        epl.EPLTrainer(model, config=CHECKPOINTING)
