"""One thread per process that stops the collectives when a peer worker dies or hangs.

A collective waits for every member of its group; a worker killed with `kill -9` never
joins, so its peers would wait forever. TF's collective ops take a `timeout_seconds`, but
each launch with a timeout leaves a timer thread alive for the whole timeout, so the
threads of a few minutes of training pile up until the process aborts
(docs/architecture.md, "No `timeout_seconds` on collectives"). So collectives run without a
timeout, and this watchdog bounds them instead, as MultiWorkerMirroredStrategy's
health-check thread does:

* while a step (or a metric sync, or an evaluation) is in flight for longer than one
  poll interval, it asks every peer's collective service whether it is alive; a peer
  that does not answer makes it abort the process's collectives at once;
* a step that has made no progress for `communication.timeout_seconds` while every peer
  still answers (a peer stuck or much slower) is aborted too.

The aborted collective raises in the step, and `cluster.detect_lost_workers` turns that
into a `WorkerLostError` naming the unreachable workers (or saying that they are stuck).
Aborting leaves the process's collective executor unusable: the job stops, and
`epl-launch --max_restarts` restarts it from the newest checkpoint.

A single worker has no peer that can die, but its devices still wait on each other in
the collectives among them (replicas, stages, split layers): one that never issues its
part (an ordering bug, TF running a stateful op in program order) would hang the step
with no error. So a single-worker job whose step spans several devices is watched too,
for progress alone (`watch(local_collectives=True)`); a job on one device runs no thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import tensorflow as tf

from epl_trainer.runtime.cluster import Cluster, detect_lost_workers

logger = logging.getLogger(__name__)

_PROBE_SECONDS = 5.0  # how long one peer may take to answer a health probe
_MAX_POLL_SECONDS = 10.0

_watchdogs: dict[tuple[str, ...], CollectiveWatchdog] = {}
_registry_lock = threading.Lock()


def watchdog_for(cluster: Cluster, timeout_seconds: float) -> CollectiveWatchdog:
    """The process's watchdog for `cluster` (one per job: trainers share it).

    The most recent `timeout_seconds` applies (`communication.timeout_seconds`).
    """
    key = tuple(cluster.task_name(w) for w in range(cluster.worker_num))
    with _registry_lock:
        watchdog = _watchdogs.get(key)
        if watchdog is None:
            watchdog = _watchdogs[key] = CollectiveWatchdog(cluster, timeout_seconds)
        watchdog.timeout_seconds = timeout_seconds
        return watchdog


@contextlib.contextmanager
def bounded(
    cluster: Cluster,
    timeout_seconds: float,
    what: str = "a training step",
    local_collectives: bool = False,
):
    """Bounds the collectives run inside the block by the process's watchdog, and turns
    their failure into a `WorkerLostError` naming the lost peers
    (`cluster.detect_lost_workers`): from the watchdog's own probe when one ran as they
    failed (`CollectiveWatchdog.found_unreachable`), so the job stops without probing each
    lost peer a second time. `local_collectives`: the block runs collectives among this
    worker's devices (watched in a single-worker job too)."""
    watchdog = watchdog_for(cluster, timeout_seconds)
    found = watchdog.found_unreachable
    with (
        detect_lost_workers(cluster, timeout_seconds, found),
        watchdog.watch(what, local_collectives=local_collectives),
    ):
        yield


class CollectiveWatchdog:
    """Aborts this process's collectives when a watched phase stops making progress.

    Args:
      cluster: the job; peers are probed only when it has more than one worker.
      timeout_seconds: how long one watched phase may run while every peer answers.
      poll_seconds: how often the thread looks; by default a quarter of the timeout,
        between 0.5 and 10 s. Phases shorter than one poll are never probed.
    """

    def __init__(self, cluster: Cluster, timeout_seconds: float, poll_seconds=None):
        self.cluster = cluster
        self.timeout_seconds = float(timeout_seconds)
        self._poll_seconds = poll_seconds
        self._lock = threading.Lock()
        self._phase: tuple[float, str] | None = None  # (start, what) of the phase in flight
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.aborted: str | None = None  # why the collectives were aborted, once they were
        self._lost: dict[int, str] = {}  # {worker: why} of the probe behind that abort
        self._probe_done = threading.Event()  # clear while a probe is in flight
        self._probe_done.set()
        self._probed: dict[int, str] = {}  # what the last probe found unreachable

    @property
    def poll_seconds(self) -> float:
        if self._poll_seconds is not None:
            return self._poll_seconds
        return min(max(self.timeout_seconds / 4, 0.5), _MAX_POLL_SECONDS)

    @contextlib.contextmanager
    def watch(
        self, what: str = "a training step", local_collectives: bool = False
    ) -> Iterator[None]:
        """Bounds the collectives run inside the block; a no-op for a single worker
        unless `local_collectives` (the block's collectives join several of its devices).
        """
        if self.cluster.worker_num == 1 and not local_collectives:
            yield
            return
        self._ensure_thread()
        with self._lock:
            self._phase = (time.monotonic(), what)
        try:
            yield
        finally:
            with self._lock:
                self._phase = None

    def found_unreachable(self) -> dict[int, str]:
        """The peers this watchdog found unreachable when a watched phase failed, for the
        error to name them (cluster.detect_lost_workers) without probing them again: those
        of the probe behind its abort, else, when something else failed the phase during a
        probe (TF's coordination service also notices a silent peer), that probe's once it
        ends. {} otherwise: the caller probes."""
        if self._lost:
            return self._lost
        if self._probe_done.is_set():
            return {}
        self._probe_done.wait(_PROBE_SECONDS + 1)
        return dict(self._probed)

    def stop(self) -> None:
        """Stops the thread (tests; the thread is a daemon and dies with the process)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _ensure_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="epl-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            with self._lock:
                phase = self._phase
            if phase is None or self.aborted:
                continue
            started, what = phase
            elapsed = time.monotonic() - started
            if elapsed < self.poll_seconds:
                continue  # fast phases cost no probe
            reason = self._check(what, elapsed)
            with self._lock:
                still_same_phase = self._phase == phase
            if reason and still_same_phase:
                self._abort(*reason)

    def _check(self, what: str, elapsed: float):
        """(error code, message, unreachable peers) when the phase must be aborted, else
        None."""
        lost = self._probe()
        if lost:
            names = ", ".join(f"worker {w}" for w in sorted(lost))
            message = f"epl watchdog: {names} unreachable during {what}"
            return tf.errors.UNAVAILABLE, message, lost
        if elapsed > self.timeout_seconds:
            message = (
                f"epl watchdog: {what} made no progress for {elapsed:.0f} s "
                f"(communication.timeout_seconds={self.timeout_seconds:g})"
            )
            if self.cluster.worker_num == 1:
                message += (
                    ": a collective among this process's devices did not complete, so one "
                    "device waits for another that never joins it (a deadlock; please "
                    "report it with the model and config). A step that legitimately takes "
                    "longer needs a larger communication.timeout_seconds. This process's "
                    "collectives are aborted: restart it"
                )
            return tf.errors.DEADLINE_EXCEEDED, message, {}
        return None

    def _probe(self) -> dict[int, str]:
        self._probed = {}
        self._probe_done.clear()
        try:
            self._probed = self.cluster.unreachable_workers(_PROBE_SECONDS)
        finally:
            self._probe_done.set()
        return self._probed

    def _abort(self, code: int, message: str, lost: dict[int, str]) -> None:
        from tensorflow.python.eager import context  # what MWMS's health check calls

        logger.error("%s; aborting this worker's collectives.", message)
        self._lost = dict(lost)  # before the abort raises in the step
        self.aborted = message
        context.context().abort_collective_ops(code, message)
