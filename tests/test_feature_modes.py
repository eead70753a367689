"""Cells of the README's features x modes table that no other test covers: each feature in
a mode, against single-device Keras (or, for AMP, the same run in another mode).

The multi-worker cells share one job of 2 workers x 2 devices
(tests/scripts/train_modes.py) that trains one trainer per run in turn: process start,
TensorFlow's import and the cluster's setup are paid once for all of them.
"""

import os
import sys

import keras
import numpy as np
import pytest
from _launch import SCRIPTS, run_launch
from _models import LOSS, keras_reference, max_weight_difference, mlp, mlp_data

import epl_trainer as epl

sys.path.insert(0, SCRIPTS)
import train_modes
import train_span
import train_sync_bn

ATOL = 1e-5
TWO_STAGES = {"dense_in": 0, "logits": 1}


def _fit(trainer, x, y, steps=3):
    trainer.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False)


@pytest.mark.parametrize(
    "level",
    [
        pytest.param("v0", marks=pytest.mark.combines("zero_v0+one_device")),
        pytest.param("v1", marks=pytest.mark.combines("zero_v1+one_device")),
        pytest.param("v2", marks=pytest.mark.combines("zero_v2+one_device")),
    ],
)
def test_zero_on_one_device_matches_keras(level):
    """A ZeRO config run on one device: one shard holds everything (v2: the only copy of
    the parameters is that shard's pieces)."""
    from epl_trainer.core.engine.zero.update import ZeroUpdate

    x, y = mlp_data()
    reference = mlp()
    keras_reference(reference, x, y, keras.optimizers.Adam(0.01), batch_size=16, steps=3)
    model = mlp()
    trainer = epl.EPLTrainer(
        model,
        LOSS,
        keras.optimizers.Adam(0.01),
        config={"cluster.virtual_devices": 1, "zero.level": level},
    )
    _fit(trainer, x, y)
    assert isinstance(trainer.engine.program.update.inner, ZeroUpdate)
    assert max_weight_difference(reference, model) < ATOL


@pytest.mark.parametrize(
    "devices",
    [
        pytest.param(1, marks=pytest.mark.combines("jit_compile+one_device")),
        pytest.param(2, marks=pytest.mark.combines("jit_compile+data_parallel")),
    ],
)
def test_jit_compile_matches_keras(devices):
    x, y = mlp_data()
    reference = mlp()
    keras_reference(reference, x, y, keras.optimizers.Adam(0.01), batch_size=16, steps=3)
    model = mlp()
    trainer = epl.EPLTrainer(
        model,
        LOSS,
        keras.optimizers.Adam(0.01),
        config={"cluster.virtual_devices": devices},
        jit_compile=True,
    )
    _fit(trainer, x, y)
    calls = trainer.engine.program.hooks.stage_calls
    # One XLA function for the whole step, or per lane (test_jit_choice.py)
    assert trainer.engine_plan.jit.whole_step if devices == 1 else trainer.engine_plan.jit.per_lane
    assert not any(c.__qualname__.startswith("compiled_stage_call") for c in calls)
    assert max_weight_difference(reference, model) < ATOL


@pytest.mark.combines("amp+one_device", "amp+pipeline")
def test_amp_on_one_device_and_over_two_stages():
    """float16 AMP on one device stays within test_amp_training.py's tolerance of float32
    Keras; cut into 2 stages (one micro-batch: the same matmuls on the same rows) it
    gives the one-device AMP weights."""
    x, y = mlp_data()
    reference = mlp()
    keras_reference(reference, x, y, keras.optimizers.SGD(0.1), batch_size=16, steps=3)
    amp = {"amp.level": "O1", "amp.dtype": "float16"}
    models = {}
    for devices, stages in ((1, None), (2, TWO_STAGES)):
        model = mlp()
        trainer = epl.EPLTrainer(
            model,
            LOSS,
            keras.optimizers.SGD(0.1),
            stages=stages,
            config={"cluster.virtual_devices": devices, **amp},
        )
        _fit(trainer, x, y)
        assert trainer.plan.num_taskgraphs == devices
        assert model.get_layer("dense_in").compute_dtype == "float16"
        assert trainer.stats_history["skipped_steps"][-1] == 0
        models[devices] = model
    assert max_weight_difference(reference, models[1]) < 5e-3
    assert max_weight_difference(models[1], models[2]) < ATOL


def _ema_sgd():
    return keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.9)


def _ema_mlp_trainer(model, layout):
    if layout == "one_device":
        return epl.EPLTrainer(model, LOSS, _ema_sgd(), config={"cluster.virtual_devices": 1})
    config = {"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2}
    return epl.EPLTrainer(model, LOSS, _ema_sgd(), stages=TWO_STAGES, config=config)


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param("one_device", marks=pytest.mark.combines("ema+one_device")),
        pytest.param("pipeline", marks=pytest.mark.combines("ema+pipeline")),
        pytest.param("split", marks=pytest.mark.combines("ema+split")),
    ],
)
def test_ema_matches_keras(layout):
    """fit ends with the weights replaced by the optimizer's moving averages, as Keras's
    does; the moving averages are far from the trained weights (a run that kept the
    trained weights fails)."""
    from test_split import data, head_model, split_trainer

    make_model, x, y = (head_model, *data()) if layout == "split" else (mlp, *mlp_data())
    reference, plain = make_model(), make_model()
    keras_reference(reference, x, y, _ema_sgd(), batch_size=16, steps=3)
    keras_reference(plain, x, y, keras.optimizers.SGD(0.1), batch_size=16, steps=3)
    assert max_weight_difference(reference, plain) > 1e-2
    model = make_model()
    if layout == "split":
        trainer = split_trainer(model, 2, optimizer=_ema_sgd())
        assert [tg.kind for tg in trainer.plan.taskgraphs] == ["replicate", "split"]
    else:
        trainer = _ema_mlp_trainer(model, layout)
    _fit(trainer, x, y)
    assert max_weight_difference(reference, model) < ATOL


@pytest.mark.combines("sync_batch_norm+one_device")
def test_synchronized_batch_norm_on_one_device_matches_keras():
    """Its statistics are reduced over a group of one replica: Keras's BatchNorm."""
    from epl_trainer.core.engine.sync_batch_norm import SyncBatchNorm

    x, y = train_sync_bn.make_data()
    reference, model = train_sync_bn.make_model(), train_sync_bn.make_model()
    reference.compile(keras.optimizers.SGD(0.1), LOSS)
    reference.fit(x, y, batch_size=train_sync_bn.BATCH, verbose=0, shuffle=False)
    config = {"cluster.virtual_devices": 1, "batch_norm.synchronized": True}
    trainer = epl.EPLTrainer(model, LOSS, keras.optimizers.SGD(0.1), config=config)
    trainer.fit(x, y, batch_size=train_sync_bn.BATCH, verbose=0, shuffle=False)
    assert isinstance(trainer.engine.program.hooks.batch_statistics, SyncBatchNorm)
    assert max_weight_difference(reference, model) < ATOL  # moving statistics included


# ---- the multi-worker modes: one job, one trainer per run (tests/scripts/train_modes.py)

MODE_RUNS = [
    pytest.param(
        "mw_zero_v0_recompute_amp",
        marks=pytest.mark.combines(
            "zero_v0+gradient_checkpoint+amp+steps_per_execution+multi_worker+data_parallel"
        ),
    ),
    pytest.param(
        "mw_jit_ema",
        marks=pytest.mark.combines(
            "jit_compile+ema+steps_per_execution+multi_worker+data_parallel"
        ),
    ),
    pytest.param(
        "saw_zero_v2_amp",
        marks=pytest.mark.combines(
            "zero_v2+amp+steps_per_execution+pipeline+stages_across_workers+data_parallel"
        ),
    ),
    pytest.param(
        "saw_zero_v0_jit",
        marks=pytest.mark.combines(
            "zero_v0+jit_compile+steps_per_execution+pipeline+stages_across_workers+data_parallel"
        ),
    ),
    pytest.param(
        "saw_ema_jit",
        marks=pytest.mark.combines(
            "ema+jit_compile+steps_per_execution+pipeline+stages_across_workers+data_parallel"
        ),
    ),
]


@pytest.fixture(scope="module")
def modes_job(tmp_path_factory):
    """The job of every run: 2 worker processes x 2 devices under epl-launch."""
    tmp_path = tmp_path_factory.mktemp("modes")
    script = os.path.join(SCRIPTS, "train_modes.py")
    result = run_launch(script, tmp_path, 2, 2, *train_modes.RUNS, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    logs = "".join(p.read_text() for p in (tmp_path / "logs").rglob("worker_*.log"))
    return tmp_path / "out", logs


def _keras_weights(ema: bool):
    x, y = train_span.make_data()
    model = train_span.make_model()
    model.compile(train_modes.make_optimizer(ema), LOSS)
    rows = train_modes.STEPS * train_modes.GLOBAL_BATCH
    model.fit(x[:rows], y[:rows], batch_size=train_modes.GLOBAL_BATCH, shuffle=False, verbose=0)
    return model.get_weights()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("run", MODE_RUNS)
def test_feature_in_a_multi_worker_mode(modes_job, run):
    """Both workers end with the weights of single-device Keras (AMP: of the same run in
    one process on 4 devices, whose float16 matmuls see the same rows per replica).
    multi_worker: 4 replicas, 2 per worker, each worker reads its half of the batch;
    stages_across_workers: both workers read the whole batch (no data sharding), each
    computes one stage of both replicas."""
    out, logs = modes_job
    spec = train_modes.RUNS[run]
    shards = 2 if spec["layout"] == "multi_worker" else 1
    config = spec.get("config", {})
    recomputed = [0, 1] if shards == 1 else [0]  # every stage of the replica
    ran = (
        f"data_shards={shards} compiled={spec.get('jit_compile', False)} "
        f"recomputed={recomputed if 'gradient_checkpoint.type' in config else []} "
        f"update={'ZeroUpdate' if 'zero.level' in config else 'ReplicatedUpdate'}"
    )
    for worker in range(2):
        assert f"worker {worker} {run} {ran}" in logs, logs
    if "amp.level" in config:
        x, y = train_span.make_data()
        model = train_span.make_model()
        trainer = train_modes.make_trainer(run, model, devices=4)
        _fit(trainer, x, y, steps=train_modes.STEPS)
        expected = model.get_weights()
    else:
        expected = _keras_weights(spec.get("ema", False))
        if spec.get("ema"):  # the moving averages are far from the trained weights
            plain = _keras_weights(False)
            assert max(float(np.abs(a - b).max()) for a, b in zip(expected, plain)) > 1e-2
    for worker in range(2):
        saved = np.load(out / f"{run}_{worker}.npz")
        weights = [saved[f"arr_{i}"] for i in range(len(saved.files))]
        assert len(weights) == len(expected)
        for got, want in zip(weights, expected):
            np.testing.assert_allclose(got, want, atol=ATOL)
