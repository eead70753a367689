"""Tests for ``epl_trainer.runtime.launcher``.

No TensorFlow here: the workers are tiny Python / bash scripts written to ``tmp_path``,
run by the real launcher as real processes on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from epl_trainer.runtime import launcher

REPO_ROOT = Path(__file__).resolve().parents[1]


def write_script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def launch(tmp_path: Path, script: Path, *extra: str, workers: int = 2, gpus: int = 1) -> int:
    """Run the launcher in-process with its logs under ``tmp_path/logs``."""
    argv = [
        "--num_workers", str(workers), "--gpu_per_worker", str(gpus),
        "--log_dir", str(tmp_path / "logs"), *extra, str(script),
    ]  # fmt: skip
    return launcher.main(argv)


def launch_with_script_args(tmp_path: Path, script: Path, script_args: list[str]) -> int:
    argv = ["--num_workers", "2", "--gpu_per_worker", "1", "--log_dir", str(tmp_path / "logs")]
    return launcher.main([*argv, str(script), *script_args])


def run_dir(tmp_path: Path) -> Path:
    (only,) = (tmp_path / "logs").iterdir()
    return only


def worker_log(tmp_path: Path, index: int | str) -> str:
    return (run_dir(tmp_path) / f"worker_{index}.log").read_text()


def wait_until_gone(pid: int, timeout: float = 5.0) -> bool:
    """True once ``pid`` no longer runs (zombies awaiting their reaper count as gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(autouse=True)
def no_gpus(monkeypatch):
    """Take the CPU path regardless of the test machine."""
    monkeypatch.setattr(launcher, "detect_gpus", lambda: 0)


# ----------------------------------------------------------------------------- units


@pytest.mark.timeout(60)
@pytest.mark.parametrize("index", [0, 1, 2])
def test_worker_env_tf_config(index):
    env = launcher.worker_env(index, [1111, 2222, 3333], gpu_per_worker=1)
    assert json.loads(env["TF_CONFIG"]) == {
        "cluster": {"worker": ["127.0.0.1:1111", "127.0.0.1:2222", "127.0.0.1:3333"]},
        "task": {"type": "worker", "index": index},
    }
    assert env["EPL_WORKER_INDEX"] == str(index)
    assert env["EPL_NUM_WORKERS"] == "3"
    assert env["PYTHONUNBUFFERED"] == "1"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("gpus", "cpu_devices", "expected"), [(2, None, "2"), (2, 4, "4")])
def test_worker_env_virtual_devices_without_gpus(gpus, cpu_devices, expected):
    env = launcher.worker_env(0, [1111], gpus, cpu_devices, num_gpus=0)
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["EPL_CLUSTER_VIRTUAL_DEVICES"] == expected


@pytest.mark.timeout(60)
def test_worker_env_assigns_gpu_slices():
    base = {"PATH": "/bin", "EPL_CLUSTER_VIRTUAL_DEVICES": "8"}
    envs = [launcher.worker_env(i, [1, 2], 2, num_gpus=4, base_env=base) for i in range(2)]
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["0,1", "2,3"]
    assert all("EPL_CLUSTER_VIRTUAL_DEVICES" not in env for env in envs)
    assert all(env["PATH"] == "/bin" for env in envs)
    assert base["EPL_CLUSTER_VIRTUAL_DEVICES"] == "8"  # the caller's dict is not modified


@pytest.mark.timeout(60)
def test_worker_env_rejects_bad_values():
    with pytest.raises(ValueError, match=r"gpu_per_worker\(2\) = 4 > available_gpus\(3\)"):
        launcher.worker_env(0, [1, 2], 2, num_gpus=3)
    with pytest.raises(ValueError, match="gpu_per_worker=0"):
        launcher.worker_env(0, [1], 0)
    with pytest.raises(ValueError, match="cpu_devices_per_worker=0"):
        launcher.worker_env(0, [1], 1, cpu_devices_per_worker=0)
    with pytest.raises(ValueError, match="index=2, num_workers=2"):
        launcher.worker_env(2, [1, 2], 1)


@pytest.mark.timeout(60)
def test_free_ports_are_distinct():
    ports = launcher.free_ports(8)
    assert len(set(ports)) == 8
    assert all(0 < port < 65536 for port in ports)


@pytest.mark.timeout(60)
def test_free_ports_lie_below_the_ephemeral_range():
    """bind(port 0) hands out ephemeral ports: two launchers at once (tests in parallel)
    received the same just-released one, and one job's worker reached the other's
    coordinator. Ports below the ephemeral range are never handed out that way, and
    80 draws of 2 ports from ~12,000 seldom meet."""
    start = launcher._ephemeral_start()
    drawn = [tuple(launcher.free_ports(2)) for _ in range(40)]
    ports = [port for pair in drawn for port in pair]
    assert all(port < start for port in ports)
    assert len(set(ports)) > 70


@pytest.mark.timeout(60)
def test_build_command(tmp_path):
    py = write_script(tmp_path, "a.py", "")
    sh = write_script(tmp_path, "b.sh", "")
    assert launcher.build_command(str(py), ["-x"]) == [sys.executable, str(py), "-x"]
    assert launcher.build_command(str(sh), ["y z"]) == ["bash", str(sh), "y z"]


@pytest.mark.timeout(60)
def test_split_script_args_keeps_script_args_untouched():
    split = launcher.split_script_args
    assert split(["--num_workers", "2", "--log_dir=d", "t.py", "--", "--num_workers", "5"]) == (
        ["--num_workers", "2", "--log_dir=d", "t.py"],
        ["--", "--num_workers", "5"],
    )
    assert split(["--timeout", "3", "--", "-t.py", "-h"]) == (
        ["--timeout", "3", "--", "-t.py"],
        ["-h"],
    )


@pytest.mark.timeout(60)
def test_detect_gpus_counts_nvidia_smi_lines(tmp_path, monkeypatch):
    monkeypatch.undo()  # drop the autouse stub; this test exercises the real detection
    fake = write_script(
        tmp_path,
        "nvidia-smi",
        """\
        #!/bin/sh
        echo "GPU 0: Tesla V100 (UUID: GPU-a)"
        echo "  MIG 1g.5gb Device 0: (UUID: MIG-b)"
        echo "GPU 1: Tesla V100 (UUID: GPU-c)"
        """,
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert launcher.detect_gpus() == 2
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert launcher.detect_gpus() == 0


@pytest.mark.timeout(60)
def test_launcher_does_not_import_tensorflow():
    """The launcher (and launch_job.py, which it imports) starts without TensorFlow."""
    code = (
        "import sys, epl_trainer.runtime.launcher; "
        "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=True
    )
    assert result.stdout.strip() == "[]"


# ------------------------------------------------------------------ usage errors


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("flag", "value"),
    [("--num_workers", "0"), ("--gpu_per_worker", "0"), ("--cpu_devices_per_worker", "-1")],
)
def test_non_positive_counts_exit_2(tmp_path, capfd, flag, value):
    script = write_script(tmp_path, "ok.py", "")
    argv = ["--num_workers", "1", "--gpu_per_worker", "1", flag, value, str(script)]
    assert launcher.main(argv) == 2
    assert f"{flag[2:]}={value}" in capfd.readouterr().err
    assert not (tmp_path / "epl_logs").exists()


@pytest.mark.timeout(60)
def test_missing_script_exits_2(tmp_path, capfd):
    missing = tmp_path / "nope.py"
    assert launch(tmp_path, missing) == 2
    err = capfd.readouterr().err
    assert "Script not found" in err and str(missing) in err


@pytest.mark.timeout(60)
def test_unsupported_suffix_exits_2(tmp_path, capfd):
    script = write_script(tmp_path, "train.txt", "")
    assert launch(tmp_path, script) == 2
    err = capfd.readouterr().err
    assert "Unsupported script type '.txt'" in err and str(script) in err


@pytest.mark.timeout(60)
def test_not_enough_gpus_exits_2(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(launcher, "detect_gpus", lambda: 1)
    script = write_script(tmp_path, "ok.py", "")
    assert launch(tmp_path, script, workers=2, gpus=1) == 2
    assert "available_gpus(1)" in capfd.readouterr().err


# ------------------------------------------------------------------ real workers

REPORT_PY = """\
import json, os, sys
task = json.loads(os.environ["TF_CONFIG"])["task"]
print(f"task_index={task['index']}")
print(f"virtual_devices={os.environ.get('EPL_CLUSTER_VIRTUAL_DEVICES')}")
print(f"cuda={os.environ['CUDA_VISIBLE_DEVICES']!r}")
print(f"argv={sys.argv[1:]}")
print(f"stderr of {task['index']}", file=sys.stderr)
"""


@pytest.mark.timeout(60)
def test_two_python_workers_succeed(tmp_path, capfd):
    script = write_script(tmp_path, "report.py", REPORT_PY)
    assert launch(tmp_path, script, "--cpu_devices_per_worker", "3") == 0
    for index in range(2):
        log = worker_log(tmp_path, index)
        assert f"task_index={index}" in log
        assert "virtual_devices=3" in log
        assert "cuda=''" in log
        assert f"stderr of {index}" in log
    out, err = capfd.readouterr()
    assert "task_index=0" in out and "stderr of 0" in out
    assert "task_index=1" not in out
    assert f"starting 2 worker(s); logs in {run_dir(tmp_path)}" in err


@pytest.mark.timeout(60)
def test_script_args_pass_through_untouched(tmp_path):
    script = write_script(tmp_path, "report.py", REPORT_PY)
    args = ["--num_workers", "5", "--", "a b", "-h"]
    assert launch_with_script_args(tmp_path, script, args) == 0
    assert f"argv={args}" in worker_log(tmp_path, 1)


@pytest.mark.timeout(60)
def test_gpu_machine_gets_gpu_slices(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "detect_gpus", lambda: 4)
    script = write_script(tmp_path, "report.py", REPORT_PY)
    assert launch(tmp_path, script, gpus=2) == 0
    assert "cuda='0,1'" in worker_log(tmp_path, 0)
    assert "cuda='2,3'" in worker_log(tmp_path, 1)
    assert "virtual_devices=None" in worker_log(tmp_path, 1)


@pytest.mark.timeout(60)
def test_workers_share_out_the_gpus_of_an_inherited_cuda_visible_devices():
    """A scheduler (Slurm, a container runtime) gives the launcher some GPUs by
    CUDA_VISIBLE_DEVICES; the workers get slices of those, not of the machine's."""
    base = {"CUDA_VISIBLE_DEVICES": "4,5,GPU-uuid-a,7"}
    envs = [launcher.worker_env(i, [1, 2], 2, num_gpus=8, base_env=base) for i in range(2)]
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["4,5", "GPU-uuid-a,7"]
    with pytest.raises(ValueError, match=r"available_gpus\(2\) \(CUDA_VISIBLE_DEVICES='4,5'\)"):
        launcher.worker_env(0, [1, 2], 2, num_gpus=8, base_env={"CUDA_VISIBLE_DEVICES": "4,5"})
    hidden = launcher.worker_env(0, [1], 2, num_gpus=8, base_env={"CUDA_VISIBLE_DEVICES": ""})
    assert (hidden["CUDA_VISIBLE_DEVICES"], hidden["EPL_CLUSTER_VIRTUAL_DEVICES"]) == ("", "2")


@pytest.mark.timeout(60)
def test_a_module_runs_as_python_m_with_its_args(tmp_path, monkeypatch):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "report.py").write_text(textwrap.dedent(REPORT_PY))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    argv = ["--num_workers", "2", "--gpu_per_worker", "1", "--log_dir", str(tmp_path / "logs")]
    assert launcher.main([*argv, "-m", "pkg.report", "--epochs", "3", "-m", "x"]) == 0
    assert "argv=['--epochs', '3', '-m', 'x']" in worker_log(tmp_path, 1)
    assert launcher.build_command(None, ["a"], "pkg.report") == [
        sys.executable, "-m", "pkg.report", "a"
    ]  # fmt: skip
    with pytest.raises(launcher.LaunchError, match=r"module='pkg/report\.py'"):
        launcher.build_command(None, [], "pkg/report.py")
    assert launcher.main([*argv]) == launcher.EXIT_USAGE  # neither SCRIPT nor -m


@pytest.mark.timeout(60)
def test_shell_script_receives_args(tmp_path):
    script = write_script(
        tmp_path,
        "run.sh",
        """\
        echo "worker=$EPL_WORKER_INDEX of $EPL_NUM_WORKERS nargs=$# first=$1 second=$2"
        """,
    )
    assert launch_with_script_args(tmp_path, script, ["one two", "$HOME"]) == 0
    assert "worker=1 of 2 nargs=2 first=one two second=$HOME" in worker_log(tmp_path, 1)


# Worker 0 starts a grandchild and sleeps; worker 1 fails once worker 0 is set up.
FAILING_PY = """\
import os, pathlib, signal, subprocess, sys, time
pids = pathlib.Path(sys.argv[1])
if os.environ["EPL_WORKER_INDEX"] == "0":
    child = subprocess.Popen(["sleep", "60"])
    pids.with_suffix(".tmp").write_text(f"{os.getpid()} {child.pid}")
    pids.with_suffix(".tmp").rename(pids)
    time.sleep(60)
else:
    deadline = time.monotonic() + 10
    while not pids.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    print("worker 1 about to fail")
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("mode", "expected"), [("exit", 3), ("kill", 137)])
def test_failing_worker_stops_the_others(tmp_path, capfd, mode, expected):
    script = write_script(tmp_path, "fail.py", FAILING_PY)
    pid_file = tmp_path / "pids"
    start = time.monotonic()
    assert launch_with_script_args(tmp_path, script, [str(pid_file), mode]) == expected
    assert time.monotonic() - start < 10
    worker0, grandchild = map(int, pid_file.read_text().split())
    assert wait_until_gone(worker0)
    assert wait_until_gone(grandchild)
    err = capfd.readouterr().err
    assert f"worker 1 {'failed' if mode == 'exit' else 'was killed by SIGKILL'}" in err
    assert f"(exit code {expected})" in err
    assert "  | worker 1 about to fail" in err


@pytest.mark.timeout(60)
def test_timeout_exits_124(tmp_path, capfd):
    script = write_script(tmp_path, "sleep.py", "import time\ntime.sleep(60)\n")
    start = time.monotonic()
    assert launch(tmp_path, script, "--timeout", "0.5") == 124
    assert time.monotonic() - start < 10
    assert "timeout of 0.5s exceeded" in capfd.readouterr().err


@pytest.mark.timeout(60)
def test_sigterm_to_launcher_stops_workers(tmp_path):
    pid_file = tmp_path / "pid"
    script = write_script(
        tmp_path,
        "sleep.py",
        f"""\
        import os, pathlib, time
        if os.environ["EPL_WORKER_INDEX"] == "1":
            pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))
        time.sleep(60)
        """,
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    argv = ["--num_workers", "2", "--gpu_per_worker", "1", "--log_dir", str(tmp_path / "logs")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "epl_trainer.runtime.launcher", *argv, str(script)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.1)  # the pid file is written after the worker started
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert "received SIGTERM" in err
    assert wait_until_gone(int(pid_file.read_text()))


@pytest.mark.timeout(60)
def test_stop_kills_workers_that_ignore_sigterm(tmp_path, capfd):
    script = write_script(
        tmp_path,
        "stubborn.py",
        """\
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(60)
        """,
    )
    envs = [launcher.worker_env(0, [1], 1, base_env=os.environ)]
    job = launcher.Job(launcher.build_command(str(script), []), envs, tmp_path, grace_seconds=0.5)
    job.start()
    try:
        deadline = time.monotonic() + 20
        while "ready" not in (tmp_path / "worker_0.log").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        start = time.monotonic()
        job.stop()
    assert 0.4 < time.monotonic() - start < 5
    assert job.workers[0].process.returncode == -signal.SIGKILL
    assert "ready" in capfd.readouterr().out


# Records each attempt's TF_CONFIG port and fails (worker 1 by SIGKILL) until attempt K.
RESTARTING_PY = """\
import json, os, pathlib, signal, sys, time
attempt = int(os.environ["EPL_RESTART_ATTEMPT"])
index = os.environ["EPL_WORKER_INDEX"]
port = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"][int(index)].split(":")[1]
with open(pathlib.Path(sys.argv[1]) / f"attempts_{index}", "a") as f:
    f.write(f"{attempt} {port}\\n")
print(f"worker {index} attempt {attempt}")
if attempt < int(sys.argv[2]) and index == "1":
    # Die only once worker 0 has recorded this attempt (else the launcher may stop it first).
    record = pathlib.Path(sys.argv[1]) / "attempts_0"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (
        record.exists() and f"{attempt} " in record.read_text()
    ):
        time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("max_restarts", "succeeds_at", "expected", "attempts"),
    [(2, 1, 0, 2), (1, 5, 137, 2), (0, 1, 137, 1)],
)
def test_max_restarts_restarts_the_whole_job(
    tmp_path, capfd, max_restarts, succeeds_at, expected, attempts
):
    script = write_script(tmp_path, "restart.py", RESTARTING_PY)
    argv = ["--num_workers", "2", "--gpu_per_worker", "1", "--log_dir", str(tmp_path / "logs")]
    argv += ["--max_restarts", str(max_restarts), str(script), str(tmp_path), str(succeeds_at)]
    assert launcher.main(argv) == expected
    for index in range(2):
        lines = (tmp_path / f"attempts_{index}").read_text().split("\n")[:-1]
        assert [int(line.split()[0]) for line in lines] == list(range(attempts))
    ports = {line.split()[1] for line in (tmp_path / "attempts_0").read_text().splitlines()}
    assert len(ports) == attempts  # every attempt gets fresh ports
    err = capfd.readouterr().err
    assert err.count("worker 1 was killed by SIGKILL") == min(attempts, succeeds_at)
    for attempt in range(1, attempts):
        assert f"restart {attempt}/{max_restarts}: starting 2 worker(s)" in err
        assert f"worker 1 attempt {attempt}" in worker_log(tmp_path, f"1.restart_{attempt}")


@pytest.mark.timeout(60)
def test_a_timed_out_job_is_not_restarted(tmp_path, capfd):
    script = write_script(tmp_path, "sleep.py", "import time\ntime.sleep(60)\n")
    assert launch(tmp_path, script, "--timeout", "0.5", "--max_restarts", "3") == 124
    assert "restart" not in capfd.readouterr().err
