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
    _assert_single_process_weights(tmp_path, workers=2)


def _assert_single_process_weights(out, workers: int) -> None:
    expected = _single_process_weights()
    for rank in range(workers):
        weights = np.load(out / f"weights_{rank}.npz")
        for i, value in enumerate(expected):
            np.testing.assert_allclose(weights[f"arr_{i}"], value, atol=1e-5)


def _fake_scontrol(folder, hosts) -> str:
    """A PATH whose `scontrol show hostnames` prints `hosts` (Slurm's client, as on a
    cluster node; anything else fails like a wrong call)."""
    folder.mkdir(exist_ok=True)
    script = folder / "scontrol"
    listing = "\\n".join(hosts)
    script.write_text(
        f'#!/bin/sh\n[ "$1 $2" = "show hostnames" ] || exit 3\nprintf "{listing}\\n"\n'
    )
    script.chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


def _step_on_node(node: int, nodes: int = 2, tasks: int = 2, **extra) -> dict:
    return {
        "SLURM_PROCID": str(node),
        "SLURM_NODEID": str(node),
        "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_STEP_NUM_TASKS": str(tasks),
        "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        **extra,
    }


def test_epl_launch_on_each_node_of_a_step_makes_one_cluster(tmp_path, monkeypatch):
    """`srun --nodes 2 --ntasks-per-node 1 epl-launch --num_workers 2 ...`, node 1: its
    two workers are workers 2 and 3 of four, and TF_CONFIG names both nodes'."""
    monkeypatch.setenv("PATH", _fake_scontrol(tmp_path / "bin", ["node1", "node2"]))
    for key, value in _step_on_node(1, EPL_SLURM_PORT_BASE="7000").items():
        monkeypatch.setenv(key, value)
    args = launcher.parse_args(["--num_workers", "2", "--gpu_per_worker", "1", "train.py"])
    allocation = launcher._checked_allocation(args)
    envs = launcher._env_factory(args, 0, allocation)(0, 2)
    workers = ["node1:7000", "node1:7001", "node2:7000", "node2:7001"]
    for local, env in enumerate(envs):
        assert json.loads(env["TF_CONFIG"]) == {
            "cluster": {"worker": workers},
            "task": {"type": "worker", "index": 2 + local},
        }
        assert (env["EPL_WORKER_INDEX"], env["EPL_NUM_WORKERS"]) == (str(2 + local), "4")
        assert env["EPL_CLUSTER_VIRTUAL_DEVICES"] == "1"


def test_a_step_epl_launch_cannot_serve_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _fake_scontrol(tmp_path / "bin", ["node1", "node2"]))
    args = launcher.parse_args(["--num_workers", "1", "--gpu_per_worker", "1", "train.py"])
    for key, value in _step_on_node(0, tasks=4).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(launcher.LaunchError, match=r"once per node .*SLURM_STEP_NUM_TASKS=4"):
        launcher._checked_allocation(args)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    restarting = launcher.parse_args(
        ["--num_workers", "1", "--gpu_per_worker", "1", "--max_restarts", "1", "train.py"]
    )
    with pytest.raises(launcher.LaunchError, match=r"--requeue .*max_restarts=1"):
        launcher._checked_allocation(restarting)
    monkeypatch.setenv("SLURM_STEP_NUM_NODES", "1")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")
    assert launcher._checked_allocation(args) is None  # one node: a local launch
    monkeypatch.setenv("SLURM_STEP_NUM_NODES", "2")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(launcher.LaunchError, match=r"needs `scontrol`"):
        launcher._checked_allocation(args)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_epl_launch_under_srun_on_two_hosts_trains_as_one_job(tmp_path):
    """Two hosts with their own addresses (network namespaces), one epl-launch on each as
    `srun --ntasks-per-node 1` starts it: the two workers end with one process's weights."""
    from _hosts import NetworkHosts, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no test hosts: {reason}")
    with NetworkHosts(2) as hosts:
        path = _fake_scontrol(tmp_path / "bin", hosts.addresses)
        launchers = []
        for node in range(2):
            env = clean_env(PATH=path, **_step_on_node(node, EPL_SLURM_PORT_BASE="2222"))
            env.pop("CUDA_VISIBLE_DEVICES", None)
            argv = [sys.executable, "-m", "epl_trainer.runtime.launcher", "--num_workers", "1",
                    "--gpu_per_worker", "1", "--log_dir", tmp_path / f"logs_{node}",
                    os.path.join(SCRIPTS, "train_dp.py"), tmp_path]  # fmt: skip
            launchers.append(
                subprocess.Popen(
                    hosts.command(node, argv),
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        try:
            outputs = [p.communicate(timeout=240)[0] for p in launchers]
        finally:
            for p in launchers:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
    assert [p.returncode for p in launchers] == [0, 0], "\n".join(outputs)
    assert "Slurm step: node 1 of ['10.77.0.1', '10.77.0.2']" in outputs[1], outputs[1]
    _assert_single_process_weights(tmp_path, workers=2)
