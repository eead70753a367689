"""Slurm job steps: TF_CONFIG from the allocation (epl_trainer/runtime/slurm.py).

The environment is what `srun` sets for each task; the workers are real processes on
this machine, started the way `srun --ntasks 2` starts them.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from _launch import SCRIPTS, clean_env
from test_multiworker import _single_process_weights

from epl_trainer.runtime import launcher, slurm

STEP = {
    "SLURM_PROCID": "1",
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_STEP_TASKS_PER_NODE": "2,1",
    "EPL_SLURM_PORT_BASE": "7000",
}


def test_a_job_steps_tasks_become_the_workers_of_tf_config(monkeypatch):
    for key, value in STEP.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi: tasks without GPUs
    assert slurm.in_job_step()
    assert json.loads(slurm.tf_config_of_step()) == {
        "cluster": {"worker": ["node1:7000", "node1:7001", "node2:7000"]},
        "task": {"type": "worker", "index": 1},
    }
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")
    assert not slurm.in_job_step()  # one task: a single-worker job
    monkeypatch.delenv("SLURM_PROCID")
    assert not slurm.in_job_step()  # an allocation outside srun
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.setenv("EPL_SLURM_PORT_BASE", "http")
    with pytest.raises(ValueError, match=r"EPL_SLURM_PORT_BASE must be a port number\."):
        slurm.tf_config_of_step()


def _two_free_ports_in_a_row() -> int:
    while True:
        (base,) = launcher.free_ports(1)
        with socket.socket() as probe:
            try:
                probe.bind((launcher.HOST, base + 1))
            except OSError:
                continue
        return base


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_tasks_of_a_job_step_train_as_two_workers(tmp_path):
    """`srun --ntasks 2 python train_dp.py` on one node: no TF_CONFIG, no launcher; the
    two tasks find each other from the Slurm variables and end with one process's
    weights."""
    base = _two_free_ports_in_a_row()
    tasks = []
    for rank in range(2):
        env = clean_env(
            CUDA_VISIBLE_DEVICES="",
            EPL_CLUSTER_VIRTUAL_DEVICES="1",
            SLURM_PROCID=str(rank),
            SLURM_STEP_NUM_TASKS="2",
            SLURM_STEP_NODELIST="localhost",
            SLURM_STEP_TASKS_PER_NODE="2",
            EPL_SLURM_PORT_BASE=str(base),
        )
        command = [sys.executable, os.path.join(SCRIPTS, "train_dp.py"), str(tmp_path)]
        tasks.append(
            subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = [task.communicate(timeout=200)[0] for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], "\n".join(outputs)
    assert "worker 0/2 devices=1" in outputs[0], outputs[0]
    expected = _single_process_weights()
    for rank in range(2):
        weights = np.load(tmp_path / f"weights_{rank}.npz")
        for i, value in enumerate(expected):
            np.testing.assert_allclose(weights[f"arr_{i}"], value, atol=1e-5)
