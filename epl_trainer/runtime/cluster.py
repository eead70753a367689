"""The job's workers and each worker's devices; the one place TensorFlow is configured.

A job is one process per worker. Workers learn about each other from `TF_CONFIG`
(the schema Kubeflow TFJob, Ray Train and `tf.distribute` use); without it the job is
one local worker. A worker's devices are its visible GPUs or, on a machine without
GPUs, N logical CPU devices (`cluster.virtual_devices`), which give real placement and
real collectives so every parallel mode is testable on a laptop.

TensorFlow's devices and thread pools can only be configured before it initialises,
so `configure_tensorflow` is the single function that does it (tests call it from
`conftest.py`; the library calls it from `epl.init`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping

import tensorflow as tf

from epl_trainer.runtime import slurm, startup_watch

logger = logging.getLogger(__name__)

_CONFIGURED_CPU_DEVICES: int | None = None
_COLLECTIVE_STRATEGY = None  # keeps the multi-worker runtime alive for the process


class ClusterError(ValueError):
    """A malformed TF_CONFIG or an impossible device request."""


class WorkerLostError(RuntimeError):
    """A collective failed because a peer worker died, hung or became unreachable.

    Attributes:
      workers: indices of the workers found unreachable (empty when every peer still
        answered, i.e. one is alive but stuck or slower than the timeout).
    """

    def __init__(self, message: str, workers: tuple[int, ...] = ()):
        super().__init__(message)
        self.workers = workers


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """Where the workers of the job are, and which one this process is (from TF_CONFIG)."""

    addresses: tuple[str, ...]  # indexed by global worker index
    job_names: tuple[tuple[str, int], ...]  # (TF job name, task index) per worker
    worker_index: int

    @property
    def worker_num(self) -> int:
        return len(self.addresses)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The job as the planner sees it.

    Attributes:
      worker_num: number of worker processes in the job.
      worker_index: this process's worker (the chief, when there is one, is worker 0).
      local_devices: full TensorFlow names of this worker's compute devices.
      devices_by_worker: the compute devices of every worker (same count on each).
      host_device: this worker's CPU, where inputs and metric state live.
      device_type: "GPU" or "CPU".
      addresses: every worker's "host:port" from TF_CONFIG (for error messages).
    """

    worker_num: int
    worker_index: int
    local_devices: tuple[str, ...]
    devices_by_worker: tuple[tuple[str, ...], ...]
    host_device: str
    device_type: str
    addresses: tuple[str, ...] = ()

    @property
    def total_gpu_num(self) -> int:
        """Devices in the whole job (EPL's name; counts logical CPU devices too)."""
        return sum(len(devices) for devices in self.devices_by_worker)

    @property
    def is_chief(self) -> bool:
        return self.worker_index == 0

    def task_name(self, worker: int) -> str:
        """`/job:J/replica:0/task:T` of a worker, as the collective runtime names it."""
        return self.devices_by_worker[worker][0].rsplit("/device:", 1)[0]

    def unreachable_workers(self, probe_seconds: float = 5.0) -> dict[int, str]:
        """Asks every peer's collective service whether it is alive.

        Returns:
          {worker index: why it is unreachable} for every peer that did not answer
          within `probe_seconds` (this worker is never probed).
        """
        from tensorflow.python.eager import context  # the health check MWMS itself uses

        lost = {}
        for worker in range(self.worker_num):
            if worker == self.worker_index:
                continue
            try:
                context.context().check_collective_ops_peer_health(
                    self.task_name(worker), timeout_in_ms=int(probe_seconds * 1000)
                )
            except tf.errors.OpError as e:
                lost[worker] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        return lost


def parse_tf_config(environ: Mapping[str, str] | None = None) -> WorkerSpec:
    """Reads TF_CONFIG; without it the job is one local worker.

    EPL's convention: a `chief` task is worker 0 and `worker` tasks follow it. `ps` and
    `evaluator` tasks take no part in collective training.
    """
    environ = os.environ if environ is None else environ
    raw = environ.get("TF_CONFIG", "").strip()
    if not raw:
        return WorkerSpec(addresses=("localhost",), job_names=(("localhost", 0),), worker_index=0)
    try:
        tf_config = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ClusterError(f"TF_CONFIG is not valid JSON ({e}). Received: TF_CONFIG={raw!r}") from e
    if not isinstance(tf_config, dict):
        raise ClusterError(f"TF_CONFIG must be a JSON object. Received: TF_CONFIG={raw!r}")
    cluster = tf_config.get("cluster")
    task = tf_config.get("task")
    if not isinstance(cluster, dict) or not isinstance(task, dict):
        raise ClusterError(
            f'TF_CONFIG needs a "cluster" object and a "task" object. Received: TF_CONFIG={raw!r}'
        )
    job_names = []
    addresses = []
    for job in ("chief", "worker"):
        hosts = cluster.get(job, [])
        if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
            raise ClusterError(
                f'TF_CONFIG cluster["{job}"] must be a list of "host:port" strings. '
                f"Received: {hosts!r}"
            )
        for index, host in enumerate(hosts):
            job_names.append((job, index))
            addresses.append(host)
    if not addresses:
        raise ClusterError(
            f'TF_CONFIG has no "chief" or "worker" tasks. Received: TF_CONFIG={raw!r}'
        )
    task_type, task_index = task.get("type"), task.get("index", 0)
    if task_type in ("ps", "evaluator"):
        raise ClusterError(
            f"This process is a {task_type!r} task. epl_trainer reduces gradients with "
            "collective all-reduce and has no parameter servers or side-car evaluators: "
            "start only chief and worker tasks."
        )
    if (task_type, task_index) not in job_names:
        raise ClusterError(
            f"TF_CONFIG task {task_type!r} index {task_index!r} is not in the cluster "
            f"{dict(cluster)!r}."
        )
    return WorkerSpec(tuple(addresses), tuple(job_names), job_names.index((task_type, task_index)))


def configure_tensorflow(
    num_cpu_devices: int = 1,
    *,
    intra_op_threads: int | None = None,
    inter_op_threads: int | None = None,
    visible_gpus: str = "",
) -> None:
    """Creates the logical CPU devices and thread pools before TensorFlow initialises.

    Idempotent: once TensorFlow runs, a later call only checks that at least
    `num_cpu_devices` logical devices exist (asking for more is an error, since they
    cannot be added any more).
    """
    global _CONFIGURED_CPU_DEVICES
    if num_cpu_devices < 1:
        raise ClusterError(f"num_cpu_devices must be >= 1. Received: {num_cpu_devices}")
    if _CONFIGURED_CPU_DEVICES is not None or _tensorflow_initialized():
        available = len(tf.config.list_logical_devices("CPU"))
        if num_cpu_devices > available:
            raise ClusterError(
                f"{num_cpu_devices} logical CPU devices were asked for, but TensorFlow is "
                f"already initialised with {available}. Configure the device count before "
                "TensorFlow starts (epl.init() first, or conftest.py in tests)."
            )
        _check_visible_gpus_unchanged(visible_gpus)
        return
    # Memory statistics (peak bytes) on every CPU: TensorFlow's default CPU allocator
    # keeps none, and it picks its BFC allocator, which does, only where oneDNN is on (by
    # default only on some CPUs: off on an AVX2-only AMD EPYC). Read when the allocator
    # is created, so before TensorFlow starts; an explicit user setting wins.
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    if visible_gpus:
        tf.config.set_visible_devices(_chosen_gpus(visible_gpus), "GPU")
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(num_cpu_devices)]
    )
    if intra_op_threads:
        tf.config.threading.set_intra_op_parallelism_threads(intra_op_threads)
    if inter_op_threads:
        tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads)
    _CONFIGURED_CPU_DEVICES = num_cpu_devices


def _chosen_gpus(visible_gpus: str) -> list:
    """The physical GPUs `cluster.run_visible_devices` ("0,2") names."""
    gpus = tf.config.list_physical_devices("GPU")
    try:
        return [gpus[int(i)] for i in visible_gpus.split(",") if i.strip()]
    except (ValueError, IndexError) as e:
        raise ClusterError(
            f"cluster.run_visible_devices={visible_gpus!r} does not name visible GPUs "
            f"(this machine has {len(gpus)})."
        ) from e


def _check_visible_gpus_unchanged(visible_gpus: str) -> None:
    """`cluster.run_visible_devices` once TensorFlow runs: the visible GPUs are fixed by
    then, so a value naming others is refused rather than ignored (before, it was
    ignored without a word: every GPU stayed in the job, or none existed)."""
    if not visible_gpus:
        return
    chosen = _chosen_gpus(visible_gpus)
    visible = tf.config.get_visible_devices("GPU")
    if [d.name for d in chosen] != [d.name for d in visible]:
        raise ClusterError(
            f"cluster.run_visible_devices={visible_gpus!r} cannot be applied: TensorFlow "
            f"already runs with GPUs {[d.name for d in visible]} visible. Set it before "
            "TensorFlow starts (the first epl.init), or set CUDA_VISIBLE_DEVICES."
        )


def available_cores() -> int:
    """The CPU cores this process may run on: its affinity where the OS keeps one (Linux:
    a container's or taskset's limit), else every core (macOS has no affinity call)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def default_intra_op_threads(num_cpu_devices: int, cores: int) -> int | None:
    """Threads per op when `cluster.intra_op_threads` is 0: with several simulated CPU
    devices, each gets its share of the cores; with one, TensorFlow's default (None).

    The simulated devices share one intra-op pool. When every op may use all the cores,
    the stages of a pipeline (or the replicas of data parallelism), which run on
    different devices, compete for the same threads instead of running side by side
    (docs/benchmarks.md#threads-per-simulated-device).
    """
    if num_cpu_devices <= 1:
        return None
    return max(1, cores // num_cpu_devices)


def _warn_unapplied_thread_keys(cluster_config) -> None:
    """Thread pools are fixed when TensorFlow starts: a key set after that (a second
    `epl.init` in one process) cannot take effect, so say so rather than ignore it."""
    threading = tf.config.threading
    for key, asked, current in (
        ("intra_op_threads", cluster_config.intra_op_threads,
         threading.get_intra_op_parallelism_threads()),
        ("inter_op_threads", cluster_config.inter_op_threads,
         threading.get_inter_op_parallelism_threads()),
    ):  # fmt: skip
        if asked and asked != current:
            logger.warning(
                "cluster.%s=%d is not applied: TensorFlow already started with %d (0: its "
                "default). Set it before TensorFlow runs (the first epl.init).",
                key, asked, current,
            )  # fmt: skip


def _tensorflow_initialized() -> bool:
    from tensorflow.python.eager import context  # no public query exists

    return context.context()._context_handle is not None


def _start_collective_runtime(spec: WorkerSpec, startup_timeout: float) -> None:
    """Starts this worker's gRPC server and TF's collective runtime (public API only).

    Constructing MultiWorkerMirroredStrategy from TF_CONFIG configures the collective
    executor for the whole job; we keep the object alive but never use it for training.
    It waits for every worker to start, within `startup_timeout` seconds
    (`startup_watch`).
    """
    global _COLLECTIVE_STRATEGY
    if _COLLECTIVE_STRATEGY is None:
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        with startup_watch.watching(spec.addresses, spec.worker_index, startup_timeout):
            _COLLECTIVE_STRATEGY = tf.distribute.MultiWorkerMirroredStrategy(
                cluster_resolver=resolver
            )
        logger.info(
            "Collective runtime started: worker %d of %d", spec.worker_index, spec.worker_num
        )


def is_single_worker_job() -> bool:
    """Whether this process is its job's only worker, as `build_cluster` will find (no
    TF_CONFIG or one naming one worker, and no Slurm job step of several tasks); known
    before anything starts, e.g. to choose a layout."""
    return not slurm.in_job_step() and parse_tf_config().worker_num == 1


def build_cluster(cluster_config, environ: Mapping[str, str] | None = None) -> Cluster:
    """Builds the Cluster for this process from the `cluster` config section and TF_CONFIG
    (which a Slurm job step without one gets from its allocation: slurm.py)."""
    if environ is None and not os.environ.get("TF_CONFIG") and slurm.in_job_step():
        os.environ["TF_CONFIG"] = slurm.tf_config_of_step()
    spec = parse_tf_config(environ)
    num_cpu = max(1, cluster_config.virtual_devices)
    intra_op_threads = cluster_config.intra_op_threads or default_intra_op_threads(
        num_cpu, available_cores()
    )
    configure_tensorflow(
        num_cpu,
        intra_op_threads=intra_op_threads,
        inter_op_threads=cluster_config.inter_op_threads or None,
        visible_gpus=cluster_config.run_visible_devices,
    )
    _warn_unapplied_thread_keys(cluster_config)
    if spec.worker_num > 1:
        _start_collective_runtime(spec, cluster_config.startup_timeout_seconds)
    gpus = tf.config.list_logical_devices("GPU")
    device_type = "GPU" if gpus else "CPU"
    count = len(gpus) if gpus else num_cpu

    def names(worker: int) -> tuple[str, ...]:
        return tuple(f"{_task_prefix(spec, worker)}/device:{device_type}:{i}" for i in range(count))

    devices_by_worker = tuple(names(w) for w in range(spec.worker_num))
    return Cluster(
        worker_num=spec.worker_num,
        worker_index=spec.worker_index,
        local_devices=devices_by_worker[spec.worker_index],
        devices_by_worker=devices_by_worker,
        host_device=f"{_task_prefix(spec, spec.worker_index)}/device:CPU:0",
        device_type=device_type,
        addresses=spec.addresses,
    )


# What a collective raises when a peer is gone: its own timeout (DeadlineExceeded), a
# refused or dropped connection (Unavailable), or an abort started by another collective
# or by MultiWorkerMirroredStrategy's health check (Aborted / Cancelled / Unavailable).
_PEER_FAILURES = (
    tf.errors.DeadlineExceededError,
    tf.errors.UnavailableError,
    tf.errors.AbortedError,
    tf.errors.CancelledError,
)


@contextlib.contextmanager
def detect_lost_workers(
    cluster: Cluster,
    timeout_seconds: float,
    found: Callable[[], Mapping[int, str]] | None = None,
) -> Iterator[None]:
    """Turns a collective failure in a multi-worker job into a `WorkerLostError`.

    The error names each peer that no longer answers, so a user sees "worker 1
    (127.0.0.1:4321) is unreachable" instead of a bare DeadlineExceededError. Single-
    worker jobs, and errors other than peer failures, pass through unchanged.

    `found`: the peers already found unreachable when the failure was raised (the
    watchdog's probe, whose abort raised it): named without probing them again, which
    would cost each of them the probe's 5 s before the job stops. Without such a finding
    every peer is probed.
    """
    try:
        yield
    except _PEER_FAILURES as e:
        if cluster.worker_num == 1:
            raise
        lost = dict(found() if found is not None else {}) or cluster.unreachable_workers()
        cause = _first_message_line(str(e))
        if lost:
            names = "; ".join(
                f"worker {w} ({_address(cluster, w)}, {cluster.task_name(w)}): {why}"
                for w, why in sorted(lost.items())
            )
            message = (
                f"Worker {cluster.worker_index} stopped: a collective failed because "
                f"{len(lost)} peer worker(s) are unreachable: {names}. The job cannot "
                "continue without them; restart it (epl-launch --max_restarts N resumes from "
                "the newest checkpoint). "
            )
        else:
            message = (
                f"Worker {cluster.worker_index} stopped: a collective did not complete within "
                f"communication.timeout_seconds={timeout_seconds:g}, yet every peer still "
                "answers: one of them is stuck or slower than the timeout (raise it for long "
                "pauses such as checkpoints on slow storage). "
            )
        raise WorkerLostError(
            message + f"Collective error: {type(e).__name__}: {cause}", tuple(sorted(lost))
        ) from e


def _first_message_line(text: str) -> str:
    """The line of a TF error that says what happened (not the traceback around it)."""
    noise = ("Graph execution error", "Detected at node", "File ", "[[", "The error could be")
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(noise):
            return line
    return text.strip()[:200]


def _address(cluster: Cluster, worker: int) -> str:
    return cluster.addresses[worker] if worker < len(cluster.addresses) else "unknown address"


def _task_prefix(spec: WorkerSpec, worker: int) -> str:
    if spec.worker_num == 1:
        return "/job:localhost/replica:0/task:0"
    job, index = spec.job_names[worker]
    return f"/job:{job}/replica:0/task:{index}"
