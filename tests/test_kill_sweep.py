"""Crash safety, tested by killing: a job saving after every step, synchronously or
asynchronously, is SIGKILLed at random moments and restarted on the same folder.

After every kill, `latest` must name a checkpoint that restores and holds exactly the state
the uninterrupted run had at that step; a save the kill tore is a hidden temporary that no
restore reads (named in a warning, removed by the next save). A job that reaches its end
through any number of kills ends with the uninterrupted run's weights, bit for bit.

The default suite runs a handful of kills; the sweep 200 (100 per mode, two jobs at a
time, about half an hour on 2 cores): `EPL_SWEEPS=1 python -m pytest tests/test_kill_sweep.py`.
"""

import concurrent.futures
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from _launch import SCRIPTS, clean_env

from epl_trainer.training import checkpoint as ckpt

SCRIPT = os.path.join(SCRIPTS, "save_every_step.py")
EPOCHS = 20  # 160 steps of 8 rows
KILL_WINDOW_S = 1.5  # a kill lands uniformly in this window after the first step


def _entries(path) -> tuple[int, dict]:
    manifest, values = ckpt.read_all(path)
    return manifest["step"], values


def _start(out, asynchronous):
    command = [sys.executable, SCRIPT, str(out), "--epochs", str(EPOCHS)]
    command += ["--async_save"] if asynchronous else []
    env = clean_env(CUDA_VISIBLE_DEVICES="")
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted job, keeping every step's checkpoint: {step: entries}, weights."""
    out = tmp_path_factory.mktemp("reference")
    command = [sys.executable, SCRIPT, str(out), "--epochs", str(EPOCHS), "--keep_max", "1000"]
    env = clean_env(CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    folder = out / "ckpt"
    steps = {}
    for step in ckpt.list_checkpoints(str(folder)):
        steps[step] = _entries(str(folder / f"ckpt-{step}"))[1]
    return steps, _weights(out)


def _weights(out):
    loaded = np.load(out / "weights.npz")
    return [loaded[f"arr_{i}"] for i in range(len(loaded.files))]


class _Job:
    """One job folder, killed and restarted until it finishes."""

    def __init__(self, root, asynchronous, rng):
        self.root, self.asynchronous, self.rng = root, asynchronous, rng
        self.process, self.out = None, None
        self.counts = {"kills": 0, "torn": 0, "finished": 0, "no checkpoint yet": 0}

    def start(self):
        if self.out is None:
            self.out = self.root / f"job{self.counts['finished']}"
            self.out.mkdir()
        self.process = _start(self.out, self.asynchronous)
        self.process.stdout.readline()  # blocks until the first step
        self.kill_at = time.monotonic() + self.rng.uniform(0, KILL_WINDOW_S)

    def kill_and_check(self, reference):
        steps, final = reference
        time.sleep(max(0.0, self.kill_at - time.monotonic()))
        self.process.send_signal(signal.SIGKILL)
        _, err = self.process.communicate(timeout=120)
        folder = self.out / "ckpt"
        if self.process.returncode == 0:  # finished before the kill
            for got, want in zip(_weights(self.out), final):
                np.testing.assert_array_equal(got, want)
            self.counts["finished"] += 1
            shutil.rmtree(self.out)
            self.out = None
            return
        assert self.process.returncode == -signal.SIGKILL, err.decode()[-3000:]
        self.counts["kills"] += 1
        self.counts["torn"] += bool(ckpt.torn_saves(str(folder)))
        if not ckpt.exists(str(folder)):
            self.counts["no checkpoint yet"] += 1
            return
        step, values = _entries(ckpt.latest(str(folder)))  # `latest` restores
        for key, want in steps[step].items():
            np.testing.assert_array_equal(values[key], want, err_msg=f"step {step} {key}")


def _sweep(tmp_path, reference, kills_per_mode, seed):
    """Kills jobs of both modes, two at a time (one per mode); returns the counts."""
    rng = random.Random(seed)
    jobs = [_Job(tmp_path / f"{mode}", mode == "async", rng) for mode in ("sync", "async")]
    for job in jobs:
        job.root.mkdir()

    def once(job):
        job.start()
        job.kill_and_check(reference)

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        for _ in range(kills_per_mode):
            for future in [pool.submit(once, job) for job in jobs]:
                future.result()  # a failed check fails the test
    return {("async" if job.asynchronous else "sync"): job.counts for job in jobs}


def _kills_checked(tmp_path, reference, kills_per_mode, seed):
    """Runs the sweep; every run of each mode was killed or finished (the checks ran)."""
    counts = _sweep(tmp_path, reference, kills_per_mode, seed)
    print(counts)
    for mode in ("sync", "async"):
        assert counts[mode]["kills"] + counts[mode]["finished"] == kills_per_mode
    return counts


@pytest.mark.timeout(600)
def test_a_handful_of_kills_never_leave_a_latest_that_does_not_restore(tmp_path, reference):
    _kills_checked(tmp_path, reference, kills_per_mode=2, seed=0)


@pytest.mark.slow
@pytest.mark.sweep
@pytest.mark.timeout(3600)
def test_200_kills_never_leave_a_latest_that_does_not_restore(tmp_path, reference):
    counts = _kills_checked(tmp_path, reference, kills_per_mode=100, seed=1)
    assert all(counts[mode]["torn"] > 0 for mode in counts)  # kills landed inside saves
