"""Pipeline replicas whose stages live in different worker processes (real processes).

Every case is compared with plain single-device Keras `fit` on the same data: the
weights every worker's Keras model holds after `fit`, the epoch loss, evaluate and
predict.
"""

import functools
import json
import os
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
from _launch import SCRIPTS, clean_env, run_launch, start_workers_by_hand

import epl_trainer as epl
from epl_trainer.runtime import launcher

SCRIPT = os.path.join(SCRIPTS, "train_span.py")
sys.path.insert(0, SCRIPTS)
import train_span  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
# communication.timeout_seconds once a worker has paused (the fault tests; test_hosts.py)
TIMEOUT_AFTER_PAUSE = 8


def _launch(tmp_path, num_workers, devices_per_worker, *script_args):
    return run_launch(SCRIPT, tmp_path, num_workers, devices_per_worker, *script_args)


@functools.cache  # the same reference for every test that asks for it (read only)
def _keras_reference(optimizer="sgd", steps=3, clipnorm=None):
    """Plain Keras on one device: weights, loss, evaluate and predict."""
    model = train_span.make_model()
    model.compile(
        train_span.make_optimizer(optimizer, clipnorm),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    x, y = train_span.make_data()
    batch = train_span.GLOBAL_BATCH
    history = model.fit(
        x[: steps * batch], y[: steps * batch], batch_size=batch, shuffle=False, verbose=0
    )
    evaluated = model.evaluate(x[:32], y[:32], batch_size=16, verbose=0, return_dict=True)
    return {
        "weights": model.get_weights(),
        "loss": history.history["loss"][-1],
        "evaluate": evaluated,
        "predict": model.predict(x[:8], verbose=0),
    }


def _check_workers(out, num_workers, reference, data_shards=1):
    for w in range(num_workers):
        loaded = np.load(out / f"weights_{w}.npz")
        weights = [loaded[f"arr_{i}"] for i in range(len(loaded.files))]
        assert len(weights) == len(reference["weights"])
        for got, want in zip(weights, reference["weights"]):
            np.testing.assert_allclose(got, want, atol=1e-5)
        result = json.loads((out / f"result_{w}.json").read_text())
        assert result["data_shards"] == data_shards
        np.testing.assert_allclose(result["loss"], reference["loss"], rtol=1e-5)
        np.testing.assert_allclose(
            result["evaluate"]["loss"], reference["evaluate"]["loss"], rtol=1e-5
        )
        np.testing.assert_allclose(
            result["evaluate"]["accuracy"], reference["evaluate"]["accuracy"], atol=1e-6
        )
        np.testing.assert_allclose(result["predict"], reference["predict"], atol=1e-5)


def _plan_lines(job, run):
    """The plan summary worker 0 printed for `run` (its lines begin with [run])."""
    logs = "".join(p.read_text() for p in (job / "logs").rglob("worker_0.log"))
    return [line for line in logs.splitlines() if line.startswith(f"[{run}] ")]


# The runs of one_device_job: name -> train_span.py flags.
ONE_DEVICE_RUNS = {
    "two_stages": "--optimizer adam --schedule PreferBackward",
    "interleaved": (
        "--stages 4 --optimizer adam --num_micro_batch 4 --schedule Interleaved1F1B "
        "--virtual_stages 2"
    ),
}


@pytest.fixture(scope="module")
def one_device_job(tmp_path_factory):
    """One job of 2 workers x 1 device (epl-launch) that trains each of ONE_DEVICE_RUNS in
    turn, a trainer each with its flags' config (one job, not one per run: each job's
    start is most of its time). Returns its folder: run NAME's results in out/NAME/."""
    tmp_path = tmp_path_factory.mktemp("span_one_device_runs")
    runs = [f"--run={name}={flags}" for name, flags in ONE_DEVICE_RUNS.items()]
    result = run_launch(SCRIPT, tmp_path, 2, 1, *runs, timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    return tmp_path


def test_two_stages_on_two_workers_equal_single_device_keras(one_device_job):
    """2 workers x 1 device: stage 0 on worker 0, stage 1 on worker 1; Adam, 1F1B (SGD
    and GPipe: the hand-started workers below)."""
    _check_workers(one_device_job / "out" / "two_stages", 2, _keras_reference("adam"))


@pytest.mark.combines("stages_across_workers+pipeline")
def test_interleaved_with_stages_on_two_workers(one_device_job):
    """Interleaved 1F1B (test_interleaved.py), 4 stages over 2 worker processes x 1
    device, v = 2: worker 0 holds stages 0 and 2, worker 1 stages 1 and 3, so every
    boundary crosses workers, both ways, and a worker's two stages are not adjacent (stage
    3 also reads stage 0's output: the skip connection). Adam, 4 micro-batches; every
    worker's weights, loss, evaluate and predict equal single-device Keras's."""
    lines = _plan_lines(one_device_job, "interleaved")
    assert any("4 TaskGraphs on 2 device slot(s)" in line for line in lines), lines
    _check_workers(one_device_job / "out" / "interleaved", 2, _keras_reference("adam"))


# The runs of two_device_job: name -> train_span.py flags.
TWO_DEVICE_RUNS = {
    "four_stages": "--stages 4 --optimizer adam --num_micro_batch 4 --recompute",
    "straddle": "--straddle --zero v1 --optimizer adam --clipnorm 0.05",
    "zero_v2_sgd": "--zero v2 --optimizer sgd",
    "zero_v2_adam": "--zero v2 --optimizer adam",
    "zero_v2_adam_offload": "--zero v2 --optimizer adam --offload",
    "zero_bubble_h1": "--stages 4 --optimizer adam --num_micro_batch 4 --schedule ZeroBubbleH1",
}


@pytest.fixture(scope="module")
def two_device_job(tmp_path_factory):
    """One job of 2 workers x 2 devices (epl-launch) that trains each of TWO_DEVICE_RUNS
    in turn, a trainer each with its flags' config (one job, not one per run: the five
    took 33.5 s, most of it starting processes). Returns its folder: run NAME's results
    in out/NAME/."""
    tmp_path = tmp_path_factory.mktemp("span_runs")
    runs = [f"--run={name}={flags}" for name, flags in TWO_DEVICE_RUNS.items()]
    result = run_launch(SCRIPT, tmp_path, 2, 2, *runs, timeout=400)
    assert result.returncode == 0, result.stdout + result.stderr
    return tmp_path


@pytest.mark.timeout(480)
@pytest.mark.combines("gradient_checkpoint+pipeline+stages_across_workers")
def test_one_four_stage_replica_over_two_workers_of_two_devices(two_device_job):
    """Stages 0-1 on worker 0, 2-3 on worker 1, each with gradient checkpointing."""
    lines = _plan_lines(two_device_job, "four_stages")
    assert any("w0:CPU:0" in line for line in lines), lines
    assert any("w1:CPU:1" in line for line in lines), lines
    _check_workers(two_device_job / "out" / "four_stages", 2, _keras_reference("adam"))


@pytest.mark.timeout(480)
def test_zero_bubble_h1_with_stages_on_two_workers(two_device_job):
    """ZB-H1 (test_zero_bubble.py), 4 stages over 2 worker processes x 2 devices (Adam, 4
    micro-batches): a W sends nothing, a B sends its input gradients to the other worker;
    every worker's weights, loss, evaluate and predict equal single-device Keras's, as
    the four_stages run checks for 1F1B."""
    _check_workers(two_device_job / "out" / "zero_bubble_h1", 2, _keras_reference("adam"))


@pytest.mark.timeout(480)
@pytest.mark.combines("zero_v1+pipeline+stages_across_workers+data_parallel")
def test_two_replicas_whose_stages_straddle_the_workers(two_device_job):
    """2 workers x 2 devices, --straddle: replica r = (stage 0 on w0:CPU:r, stage 1 on
    w1:CPU:r): data parallelism between replicas that each span both workers, with ZeRO
    v1 (each stage's Adam state sharded over its two replicas, on one worker) and
    global-norm clipping after the reduction (the norm sums both workers' stages)."""
    out = two_device_job / "out" / "straddle"
    _check_workers(out, 2, _keras_reference("adam", clipnorm=0.05))


@pytest.mark.combines("checkpoint+pipeline+stages_across_workers", "checkpoint+one_device")
def test_workers_started_by_hand_save_a_checkpoint_that_restores_into_one_device(tmp_path):
    """No epl-launch: each process gets only TF_CONFIG, as a Kubernetes training operator
    (TFJob) sets it. SGD, GPipe, 2 stages on the 2 workers; after 3 steps each worker
    writes the shard of the stage it holds, and one device restores both and trains on
    exactly as uninterrupted single-device Keras."""
    ports = launcher.free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    processes = []
    for index in range(2):
        env = clean_env()
        env["TF_CONFIG"] = json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": index}}
        )
        processes.append(
            subprocess.Popen(
                [
                    sys.executable,
                    SCRIPT,
                    str(tmp_path / "out"),
                    "--schedule",
                    "PreferForward",
                    "--save_dir",
                    str(tmp_path / "ckpt"),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=240)[0] for p in processes]
    for p, output in zip(processes, outputs):
        assert p.returncode == 0, output
    _check_workers(tmp_path / "out", 2, _keras_reference())

    manifest = next((tmp_path / "ckpt").rglob("manifest.json")).read_text()
    assert "shard-0" in manifest and "shard-1" in manifest, manifest
    trainer = epl.EPLTrainer(
        train_span.make_model(),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        train_span.make_optimizer("sgd"),
        config={"cluster.virtual_devices": 1},
    )
    trainer.restore_checkpoint(str(tmp_path / "ckpt"))
    assert int(trainer.optimizer.iterations) == 3
    x, y = train_span.make_data()
    batch = train_span.GLOBAL_BATCH
    epochs = trainer.epochs_done + 1  # after a restore `epochs` is the final epoch
    trainer.fit(
        x[3 * batch :], y[3 * batch :], batch_size=batch, epochs=epochs, verbose=0, shuffle=False
    )
    for got, want in zip(trainer.model.get_weights(), _keras_reference(steps=6)["weights"]):
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize(
    "pause",
    [
        ("--pause_at_step", 2),
        # After training: fit's write-back to the Keras model exchanges the stages'
        # values, predict sends activations between the stages (unguarded before: the
        # survivor hung or failed without naming the lost worker).
        ("--pause_in", "epoch_end"),
        ("--pause_in", "predict"),
    ],
    ids=["in_a_step", "before_the_write_back", "before_predict"],
)
def test_kill_of_a_stage_worker_stops_the_other_with_the_named_error(tmp_path, pause):
    """The first step (tracing) runs with a 20 s timeout; from the pause on, both workers
    run with 8 s, so the watchdog polls every 2 s instead of 5 (the kill is seen sooner,
    and 8 s still leaves the test ample time to kill the paused worker before a live peer
    could be reported as stuck)."""
    timeout = 20
    ports, processes = start_workers_by_hand(
        SCRIPT, tmp_path / "out", "--steps", 50 if pause[0] == "--pause_at_step" else 3,
        "--timeout", timeout, "--pause_worker", 1, *pause,
        "--timeout_after_pause", TIMEOUT_AFTER_PAUSE,
    )  # fmt: skip
    survivor, victim = processes
    try:
        paused = tmp_path / "out" / "paused_1"
        deadline = time.monotonic() + 120
        while not (paused.exists() and paused.read_text()):
            assert time.monotonic() < deadline and victim.poll() is None, "worker 1 never paused"
            time.sleep(0.1)
        os.kill(int(paused.read_text()), signal.SIGKILL)
        killed_at = time.monotonic()
        output, _ = survivor.communicate(timeout=timeout + 60)
        elapsed = time.monotonic() - killed_at
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
            p.communicate()
    print(f"kill -9 of stage 1's worker -> worker 0's error after {elapsed:.1f} s")
    assert survivor.returncode == 1, output
    assert "WorkerLostError" in output, output
    assert f"worker 1 (127.0.0.1:{ports[1]}, /job:worker/replica:0/task:1)" in output, output
    assert elapsed < timeout + 30


@pytest.mark.parametrize(
    ("optimizer", "run"),
    [
        ("sgd", "zero_v2_sgd"),
        ("adam", "zero_v2_adam"),
        pytest.param(
            "adam",
            "zero_v2_adam_offload",
            marks=pytest.mark.combines("offload+pipeline+multi_worker"),
        ),
    ],
)
@pytest.mark.timeout(480)
@pytest.mark.combines("zero_v2+pipeline+multi_worker")
def test_zero_v2_with_stage_groups_across_workers_equals_keras(two_device_job, optimizer, run):
    """2 workers x 2 devices, 2 stages: replica w on worker w, so each stage's group has
    a member on each worker. ZeRO v2 holds each parameter only as pieces spread over both
    workers: every read (each lane's forward, evaluate, predict, the write-back, the
    checkpoint) is an all-gather across them. Equal to Keras (before: refused). With
    offload, the pieces and their optimizer state live on each worker's host."""
    out = two_device_job / "out" / run
    _check_workers(out, 2, _keras_reference(optimizer), data_shards=2)
