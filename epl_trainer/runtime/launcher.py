"""Run one training script as N local worker processes: ``epl-launch``.

Usage::

    epl-launch --num_workers N --gpu_per_worker G [--cpu_devices_per_worker K]
               [--log_dir DIR] [--timeout SECONDS] [--max_restarts R] [--min_workers K]
               SCRIPT [ARGS...]            # or -m MODULE [ARGS...]
    epl-launch --join RUN_DIR     # one more worker for a running elastic job

    # for example
    epl-launch --num_workers 2 --gpu_per_worker 1 train.py --epochs 3
    python -m epl_trainer.runtime.launcher --num_workers 2 --gpu_per_worker 2 run.sh

``SCRIPT`` is a ``.py`` file (run with the launcher's own Python interpreter) or a
``.sh`` file (run with ``bash``); ``-m MODULE`` in its place runs ``python -m MODULE``.
Everything after ``SCRIPT`` is passed to it untouched, even arguments that look like
launcher flags. Nothing goes through a shell.

What each worker ``i`` (of ``N``) gets in its environment:

* ``TF_CONFIG``: ``{"cluster": {"worker": ["127.0.0.1:p0", ...]}, "task": {"type":
  "worker", "index": i}}``, with ``N`` distinct free ports chosen by the launcher.
* ``EPL_WORKER_INDEX=i``, ``EPL_NUM_WORKERS=N``, ``PYTHONUNBUFFERED=1``, and
  ``EPL_RESTART_ATTEMPT`` (0, then 1, 2, ... for each restart of the job).
* With ``--min_workers``: ``EPL_ELASTIC_MAX_WORKERS`` and ``EPL_ELASTIC_RESIZE_FILE``
  (``elastic.*`` config keys; ``N`` is then the attempt's worker count).
* Devices. On a machine with GPUs (counted with ``nvidia-smi -L``),
  ``CUDA_VISIBLE_DEVICES`` lists GPUs ``i*G .. i*G+G-1`` of those the launcher may use:
  the ones its own ``CUDA_VISIBLE_DEVICES`` names (a scheduler's allocation), else all;
  asking for more GPUs than that is an error. On a machine without GPUs,
  ``CUDA_VISIBLE_DEVICES=""`` and ``EPL_CLUSTER_VIRTUAL_DEVICES=K``
  (``--cpu_devices_per_worker``, default ``G``), which the config system reads to create
  ``K`` logical CPU devices per worker, so a GPU recipe runs unchanged on a laptop.

Logs: every run gets ``<log_dir>/run_<YYYYmmdd-HHMMSS>_<pid>/`` (``--log_dir`` defaults
to ``./epl_logs``) holding ``worker_<i>.log`` with that worker's stdout and stderr.
Worker 0's output is also streamed live to the launcher's stdout; the launcher's own
messages go to stderr.

Supervision and exit codes:

* every worker runs in its own process group (session), so stopping a worker also stops
  the processes it started;
* if a worker exits non-zero, the others are stopped (SIGTERM to their process groups,
  SIGKILL after a grace period), the failing worker's index, exit code and last log lines
  are printed, and the launcher exits with that code (``128 + s`` for a worker killed by
  signal ``s``, e.g. 137 for SIGKILL);
* ``--max_restarts R`` (default 0): after a failure, the whole job is started again (new
  ports, every worker), up to R times; a script that sets ``checkpoint.dir`` resumes from
  its newest checkpoint. Logs of restart k are ``worker_<i>.restart_<k>.log``. The exit
  code is the last attempt's;
* ``--min_workers K`` (default ``N``): elastic. A worker killed by a signal is lost: the
  job restarts on the survivors from its newest checkpoint while at least K remain, and
  ``epl-launch --join RUN_DIR`` grows it back at its next checkpoint (see
  ``launch_elastic.py``; this does not count against ``--max_restarts``);
* under ``srun`` over several nodes (one launcher per node, ``srun --ntasks-per-node=1``),
  each launcher starts its node's N workers and TF_CONFIG names every node's, on ports
  ``EPL_SLURM_PORT_BASE`` (default 8888) + i (``slurm.NodeAllocation``); restarts and
  elastic resizing are per launcher, so they are refused there (Slurm's requeue restarts
  the whole step);
* ``--timeout SECONDS`` stops everything and exits with 124 once exceeded (over all
  attempts; a timed-out job is not restarted);
* SIGINT / SIGTERM to the launcher stop all workers and exit with 130 / 143;
* usage errors (bad flag values, a missing script, an unsupported suffix) exit with 2;
* 0 when every worker exits with 0.

Workers import ``epl_trainer`` like any other package, so install it (``pip install -e
.``) or put it on ``PYTHONPATH``. The launcher itself never imports TensorFlow, so it
starts in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from epl_trainer.runtime import slurm
from epl_trainer.runtime.launch_elastic import ElasticSize, request_join
from epl_trainer.runtime.launch_job import PROG, Job, say

HOST = "127.0.0.1"
VIRTUAL_DEVICES_ENV = "EPL_CLUSTER_VIRTUAL_DEVICES"
EXIT_USAGE = 2
# How each supported script suffix is run; the script path and its args follow.
SCRIPT_RUNNERS: dict[str, tuple[str, ...]] = {".py": (sys.executable,), ".sh": ("bash",)}


class LaunchError(ValueError):
    """A mistake in the launch request; the CLI prints it and exits with code 2."""


def _int_at_least(minimum: int, name: str):
    """An argparse ``type=`` that accepts integers >= minimum and names the flag otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an integer. Received: {name}={text!r}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}. Received: {name}={value}")
        return value

    return parse


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds. Received: timeout={text!r}"
        ) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0. Received: timeout={value}")
    return value


# The launcher's flags, all of which take a value. Kept as data so that
# split_script_args() knows which tokens belong to the launcher.
_FLAGS: tuple[tuple[str, dict], ...] = (
    (
        "--num_workers",
        dict(
            type=_int_at_least(1, "num_workers"),
            required=True,
            metavar="N",
            help="number of worker processes (>= 1)",
        ),
    ),
    (
        "--gpu_per_worker",
        dict(
            type=_int_at_least(1, "gpu_per_worker"),
            required=True,
            metavar="G",
            help="GPUs given to each worker (>= 1)",
        ),
    ),
    (
        "--cpu_devices_per_worker",
        dict(
            type=_int_at_least(1, "cpu_devices_per_worker"),
            default=None,
            metavar="K",
            help="without GPUs: logical CPU devices per worker (default: G)",
        ),
    ),
    (
        "--log_dir",
        dict(
            default="./epl_logs",
            metavar="DIR",
            help="parent of the run's log folder (default: ./epl_logs)",
        ),
    ),
    (
        "--timeout",
        dict(
            type=_positive_seconds,
            default=None,
            metavar="SECONDS",
            help="stop everything and exit 124 after this long (default: none)",
        ),
    ),
    (
        "--min_workers",
        dict(
            type=_int_at_least(1, "min_workers"),
            default=None,
            metavar="K",
            help="elastic: go on with as few as K workers when one is lost, grow back "
            "when one joins (epl-launch --join RUN_DIR); default: N, not elastic",
        ),
    ),
    (
        "--max_restarts",
        dict(
            type=_int_at_least(0, "max_restarts"),
            default=0,
            metavar="R",
            help="restart the whole job up to R times after a failure (default: 0)",
        ),
    ),
)


def split_script_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split ``argv`` into the launcher's part (ending with SCRIPT) and SCRIPT's args.

    argparse alone would drop a ``--`` meant for the script, so the split is done by
    hand: the first token that is neither a launcher flag nor a flag's value is SCRIPT.
    """
    argv = list(argv)
    value_flags = {flag for flag, _ in _FLAGS}
    index = 0
    while index < len(argv):
        token = argv[index]
        if token in ("--", "-m"):  # end of launcher flags; SCRIPT (or -m MODULE) follows
            return argv[: index + 2], argv[index + 2 :]
        if not token.startswith("-") or token == "-":
            return argv[: index + 1], argv[index + 1 :]
        index += 2 if token in value_flags else 1  # unknown flags: argparse reports them
    return argv, []


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; argparse exits with code 2 on a usage error.

    Returns:
        The flags plus ``script`` and ``script_args`` (everything after SCRIPT, as given).
    """
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run SCRIPT as N local workers with TF_CONFIG set (see module docs).",
        usage=f"{PROG} --num_workers N --gpu_per_worker G [options] SCRIPT [ARGS...]",
        allow_abbrev=False,
    )
    for flag, kwargs in _FLAGS:
        parser.add_argument(flag, **kwargs)
    parser.add_argument("script", metavar="SCRIPT", nargs="?", help="a .py or .sh file")
    parser.add_argument(
        "script_args", nargs="*", default=[], metavar="ARGS", help="passed to SCRIPT untouched"
    )
    launcher_argv, script_args = split_script_args(sys.argv[1:] if argv is None else argv)
    module = None
    if launcher_argv[-2:-1] == ["-m"]:  # -m MODULE, as `python -m`
        module, launcher_argv = launcher_argv[-1], launcher_argv[:-2]
    args = parser.parse_args(launcher_argv)
    if (args.script is None) == (module is None):
        parser.error("give one SCRIPT or -m MODULE")
    args.module = module
    args.script_args = script_args
    return args


def build_command(script: str | None, args: Sequence[str], module: str | None = None) -> list[str]:
    """The argv that runs ``script`` (or ``python -m module``) with ``args`` (no shell).

    Raises:
        LaunchError: the script does not exist or is neither ``.py`` nor ``.sh``; the
            module is not a dotted module name.
    """
    if module is not None:
        if not all(part.isidentifier() for part in module.split(".")):
            raise LaunchError(
                "-m takes a module name such as pkg.train (a file is given without -m). "
                f"Received: module={module!r}"
            )
        return [sys.executable, "-m", module, *args]
    path = Path(script)
    if not path.is_file():
        raise LaunchError(f"Script not found. Received: script={script!r}")
    runner = SCRIPT_RUNNERS.get(path.suffix.lower())
    if runner is None:
        raise LaunchError(
            f"Unsupported script type {path.suffix or '(no suffix)'!r}; expected a "
            f"{' or '.join(SCRIPT_RUNNERS)} file. Received: script={script!r}"
        )
    return [*runner, script, *args]


def free_ports(count: int, host: str = HOST) -> list[int]:
    """``count`` distinct free TCP ports on ``host``.

    Ports are drawn at random below the kernel's ephemeral range, which the kernel never
    hands to outgoing connections or to another ``bind(port 0)``: two launchers running
    at once (tests in parallel) used to receive the same just-released ephemeral port,
    and a worker of one job then reached the other's coordinator ("different
    incarnation", "Could not start gRPC server"). All sockets stay bound until every
    port is chosen, so the ports are distinct. Another process could still bind a port
    before a worker does; that race is accepted, as in every launcher that hands out
    ports ahead of time. Without a usable range the kernel picks (port 0).
    """
    low, high = _PORT_RANGE[0], min(_PORT_RANGE[1], _ephemeral_start() - 1)
    rng = random.SystemRandom()
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            for attempt in range(200):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                port = rng.randint(low, high) if low < high and attempt < 199 else 0
                try:
                    sock.bind((host, port))
                except OSError:
                    sock.close()
                    continue
                sockets.append(sock)
                break
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


_PORT_RANGE = (20000, 32767)


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux; else IANA's 49152)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152


def detect_gpus() -> int:
    """Number of GPUs listed by ``nvidia-smi -L``; 0 if it is missing or fails."""
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return 0
    try:
        result = subprocess.run(
            [executable, "-L"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"{PROG}: warning: nvidia-smi -L failed ({exc}); assuming no GPUs", file=sys.stderr)
        return 0
    if result.returncode != 0:
        print(
            f"{PROG}: warning: nvidia-smi -L exited with {result.returncode}; assuming no GPUs",
            file=sys.stderr,
        )
        return 0
    # MIG devices are listed as indented lines under their GPU; count whole GPUs only.
    return sum(1 for line in result.stdout.splitlines() if line.startswith("GPU "))


def visible_gpus(num_gpus: int, base_env: Mapping[str, str]) -> list[str]:
    """The GPUs the workers share out: those of an inherited ``CUDA_VISIBLE_DEVICES``
    (indices or UUIDs, as a scheduler such as Slurm sets it; empty: none), else all
    ``num_gpus`` of the machine."""
    if num_gpus < 1:
        return []
    inherited = base_env.get("CUDA_VISIBLE_DEVICES")
    if inherited is None:
        return [str(g) for g in range(num_gpus)]
    return [gpu.strip() for gpu in inherited.split(",") if gpu.strip()]


def worker_env(
    index: int,
    ports: Sequence[int],
    gpu_per_worker: int,
    cpu_devices_per_worker: int | None = None,
    num_gpus: int = 0,
    base_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of worker ``index`` in a cluster with one worker per port.

    Args:
        index: this worker's task index, ``0 <= index < len(ports)``.
        ports: one port per worker on 127.0.0.1; ``len(ports)`` is the number of workers.
        gpu_per_worker: GPUs per worker; also the default number of logical CPU devices
            when the machine has no GPUs.
        cpu_devices_per_worker: logical CPU devices per worker when there are no GPUs.
        num_gpus: GPUs on the machine (``detect_gpus()``); 0 selects the CPU path.
        base_env: variables to start from (the launcher passes ``os.environ``).

    Returns:
        A new dict: ``base_env`` plus ``TF_CONFIG``, ``CUDA_VISIBLE_DEVICES``,
        ``EPL_CLUSTER_VIRTUAL_DEVICES`` (CPU path only), ``EPL_WORKER_INDEX``,
        ``EPL_NUM_WORKERS`` and ``PYTHONUNBUFFERED``.

    Raises:
        LaunchError: a count is < 1, or the workers need more GPUs than the machine has.
    """
    num_workers = len(ports)
    if num_workers < 1 or gpu_per_worker < 1:
        raise LaunchError(
            "A cluster needs at least one worker and one GPU per worker. "
            f"Received: num_workers={num_workers}, gpu_per_worker={gpu_per_worker}"
        )
    if cpu_devices_per_worker is not None and cpu_devices_per_worker < 1:
        raise LaunchError(
            f"cpu_devices_per_worker must be >= 1. "
            f"Received: cpu_devices_per_worker={cpu_devices_per_worker}"
        )
    if not 0 <= index < num_workers:
        raise LaunchError(
            f"Worker index out of range. Received: index={index}, num_workers={num_workers}"
        )
    env = dict(base_env or {})
    env["TF_CONFIG"] = json.dumps(
        {
            "cluster": {"worker": [f"{HOST}:{port}" for port in ports]},
            "task": {"type": "worker", "index": index},
        }
    )
    gpus = visible_gpus(num_gpus, env)
    if gpus:
        needed = num_workers * gpu_per_worker
        if needed > len(gpus):
            inherited = env.get("CUDA_VISIBLE_DEVICES")
            where = "" if inherited is None else f" (CUDA_VISIBLE_DEVICES={inherited!r})"
            raise LaunchError(
                f"Not enough GPUs: num_workers({num_workers}) * "
                f"gpu_per_worker({gpu_per_worker}) = {needed} > available_gpus({len(gpus)})" + where
            )
        first = index * gpu_per_worker
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[first : first + gpu_per_worker])
        # A value inherited from the caller would make a GPU worker fake CPU devices.
        env.pop(VIRTUAL_DEVICES_ENV, None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        virtual = gpu_per_worker if cpu_devices_per_worker is None else cpu_devices_per_worker
        env[VIRTUAL_DEVICES_ENV] = str(virtual)
    env["EPL_WORKER_INDEX"] = str(index)
    env["EPL_NUM_WORKERS"] = str(num_workers)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def make_run_dir(log_dir: str | os.PathLike) -> Path:
    """Create ``<log_dir>/run_<YYYYmmdd-HHMMSS>_<pid>/`` (suffixed if it already exists)."""
    base = Path(log_dir) / f"run_{time.strftime('%Y%m%d-%H%M%S')}_{os.getpid()}"
    candidate, attempt = base, 0
    while True:
        try:
            candidate.mkdir(parents=True)
            return candidate
        except FileExistsError:
            attempt += 1
            candidate = base.with_name(f"{base.name}-{attempt}")


def _install_signal_handlers(job: Job) -> dict[int, object]:
    """Route SIGINT/SIGTERM to ``job.request_stop``; returns the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}  # signal.signal only works in the main thread
    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, lambda s, _frame: job.request_stop(s))
    return previous


def _restore_signal_handlers(previous: Mapping[int, object]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``epl-launch`` entry point; returns the exit code (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--join"]:
        return _join(argv[1:])
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # argparse has printed usage or help already
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    try:
        command = build_command(args.script, args.script_args, args.module)
        num_gpus = detect_gpus()
        min_workers = _checked_min_workers(args)
        allocation = _checked_allocation(args)
        make_envs = _env_factory(args, num_gpus, allocation)
        envs = make_envs(0, args.num_workers)  # checks the request before anything starts
    except LaunchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    run_dir = make_run_dir(args.log_dir)
    sizing = ElasticSize(args.num_workers, min_workers, run_dir)
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    attempt = restarts = 0
    what = "starting"
    while True:
        envs = [{**env, **sizing.worker_env(attempt)} for env in envs]
        job = Job(command, envs, run_dir, attempt=attempt)
        job.on_poll = sizing.poll
        say(f"{what} {len(envs)} worker(s); logs in {run_dir}")
        code = _run_job(job, args.timeout, deadline)
        if code == 0 or job.stop_requested or job.timed_out:
            return code
        size = sizing.next_size(job, code)
        if size is None:
            if restarts >= args.max_restarts:
                return code
            restarts += 1
            size = len(envs)
            what = f"restart {restarts}/{args.max_restarts}: starting"
        else:
            what = f"elastic attempt {attempt + 1}: starting"
        attempt += 1
        envs = make_envs(attempt, size)  # fresh ports: the old ones may still be held


def _join(argv: Sequence[str]) -> int:
    """``epl-launch --join RUN_DIR``: one more worker for the elastic job of RUN_DIR."""
    if len(argv) != 1:
        print(f"{PROG}: error: usage: {PROG} --join RUN_DIR", file=sys.stderr)
        return EXIT_USAGE
    try:
        request = request_join(argv[0])
    except FileNotFoundError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    say(f"join requested ({request}); the job grows at its next checkpoint")
    return 0


def _checked_min_workers(args: argparse.Namespace) -> int:
    if args.min_workers is None:
        return args.num_workers
    if args.min_workers > args.num_workers:
        raise LaunchError(
            "min_workers cannot exceed num_workers. Received: "
            f"min_workers={args.min_workers}, num_workers={args.num_workers}"
        )
    return args.min_workers


def _checked_allocation(args: argparse.Namespace) -> slurm.NodeAllocation | None:
    """This node's place in a Slurm step over several nodes, or None (a local launch)."""
    try:
        allocation = slurm.node_allocation(os.environ)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    if allocation is None:
        return None
    if args.max_restarts or args.min_workers is not None:
        raise LaunchError(
            "Under srun over several nodes, each node's epl-launch would restart or resize "
            "only its own workers; use Slurm's --requeue to restart the step. Received: "
            f"max_restarts={args.max_restarts}, min_workers={args.min_workers}, "
            f"nodes={list(allocation.hosts)}"
        )
    say(
        f"Slurm step: node {allocation.node_index} of {list(allocation.hosts)}, "
        f"{args.num_workers} worker(s) per node on ports {allocation.port_base}+"
    )
    return allocation


def _env_factory(
    args: argparse.Namespace, num_gpus: int, allocation: slurm.NodeAllocation | None = None
):
    """Returns (attempt, workers) -> every worker's environment, on newly chosen ports
    (under a Slurm step over several nodes: this node's workers of the whole cluster)."""

    def make(attempt: int, num_workers: int) -> list[dict[str, str]]:
        ports = free_ports(num_workers)
        envs = [
            worker_env(
                index, ports, args.gpu_per_worker, args.cpu_devices_per_worker, num_gpus, os.environ
            )
            for index in range(num_workers)
        ]
        for index, env in enumerate(envs):
            env["EPL_RESTART_ATTEMPT"] = str(attempt)
            if allocation is not None:
                allocation.place(env, index, num_workers)
        return envs

    return make


def _run_job(job: Job, timeout: float | None, deadline: float | None) -> int:
    """Starts and supervises one attempt of the job; returns its exit code."""
    previous_handlers = _install_signal_handlers(job)
    try:
        job.start()
        return job.wait(timeout, deadline=deadline)
    finally:
        job.stop()
        _restore_signal_handlers(previous_handlers)


if __name__ == "__main__":
    sys.exit(main())
