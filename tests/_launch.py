"""Jobs started the way a user starts them: `python -m epl_trainer.runtime.launcher` (epl-launch)
with a worker script of tests/scripts, or one worker process at a time by hand.

Shared by the multi-process tests (test_multiworker.py, test_span_workers.py,
test_fault_tolerance.py) so that the command line and the environment are built in one
place.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "scripts")


def clean_env(**extra) -> dict:
    """This process's environment without EPL_* and TF_CONFIG (the launcher, or a test
    starting workers by hand, sets those per worker), with the worktree on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPL_") and k != "TF_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def launch_command(
    script, log_dir, num_workers, devices_per_worker, *script_args, max_restarts=None
) -> list:
    """The epl-launch command line: `num_workers` workers of `devices_per_worker` devices
    each run `script *script_args`; logs go to `log_dir`."""
    command = [
        sys.executable,
        "-m",
        "epl_trainer.runtime.launcher",
        "--num_workers",
        str(num_workers),
        "--gpu_per_worker",
        str(devices_per_worker),
        "--log_dir",
        str(log_dir),
    ]
    if max_restarts is not None:
        command += ["--max_restarts", str(max_restarts)]
    return [*command, str(script), *(str(a) for a in script_args)]


def run_launch(script, tmp_path, num_workers, devices_per_worker, *script_args, timeout=240):
    """Runs epl-launch to the end: logs in tmp_path/logs, the script's OUTPUT_DIR (its first
    argument) is tmp_path/out. Returns the CompletedProcess (text stdout and stderr)."""
    command = launch_command(
        script, tmp_path / "logs", num_workers, devices_per_worker, tmp_path / "out", *script_args
    )
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=clean_env())


def start_workers_by_hand(script, *script_args, num_workers=2, base_env=None):
    """`num_workers` single-device workers of one job started directly, each with only
    its TF_CONFIG (no launcher), running `script *script_args`, output piped as text.

    Returns (ports, the Popen of each worker in worker order)."""
    from epl_trainer.runtime import launcher

    ports = launcher.free_ports(num_workers)
    workers = [
        subprocess.Popen(
            [sys.executable, str(script), *(str(a) for a in script_args)],
            env=launcher.worker_env(index, ports, 1, base_env=base_env or clean_env()),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for index in range(num_workers)
    ]
    return ports, workers
