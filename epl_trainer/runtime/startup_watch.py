"""A worker's start, bounded: a watcher process ends the worker, naming the absent peers,
if the job has not started within `cluster.startup_timeout_seconds`.

TensorFlow waits for every worker while it starts the collective runtime
(MultiWorkerMirroredStrategy's construction) in C++, holding the GIL and catching
SIGTERM (its preemption notifier) all along, for up to its own hour. A worker whose peer
never starts (its port taken, its pod never scheduled, a typo in TF_CONFIG) would hang
that long, deaf to its scheduler's stop, and no thread or signal handler of its own
Python can run meanwhile. So a small process (no TensorFlow) watches it: the worker
closes the watcher's stdin once started (or by dying); if that does not happen in time,
the watcher prints which peers never listened and kills the worker (SIGKILL).

    python -m epl_trainer.runtime.startup_watch PID WORKER_INDEX SECONDS ADDRESS...
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence


@contextlib.contextmanager
def watching(addresses: Sequence[str], worker_index: int, seconds: float) -> Iterator[None]:
    """The block (the job's start) runs under a watcher that kills this process, naming
    the workers that never listened, if it lasts longer than `seconds`."""
    command = [sys.executable, "-m", __name__, str(os.getpid()), str(worker_index)]
    watcher = subprocess.Popen([*command, f"{seconds:g}", *addresses], stdin=subprocess.PIPE)
    try:
        yield
    finally:
        watcher.stdin.close()  # started: the watcher sees end-of-file and exits
        watcher.wait(timeout=30)


def message(worker_index: int, seconds: str, addresses: Sequence[str]) -> str:
    absent = [
        f"worker {w} ({address})"
        for w, address in enumerate(addresses)
        if w != worker_index and not _listening(address)
    ]
    why = (
        f"{', '.join(absent)} never listened (not started, or its port was taken)."
        if absent
        else "every peer listens, but they did not start one job: check that every worker "
        "has the same TF_CONFIG cluster."
    )
    return (
        f"epl_trainer: error: worker {worker_index} waited cluster.startup_timeout_seconds="
        f"{seconds} for the job's workers to start; {why} Stopping it (TensorFlow's wait "
        "cannot be interrupted)."
    )


def _listening(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return True
    except (OSError, ValueError):
        return False


def main(argv: Sequence[str]) -> int:
    pid, worker_index, seconds, *addresses = argv
    started, _, _ = select.select([sys.stdin], [], [], float(seconds))
    if started:  # end-of-file: the worker started, or exited on its own
        return 0
    # A script's own error line (as the launcher's), not a library message: this watcher
    # is a process of its own that no logging configuration of the user's reaches, and
    # the line must be on the worker's stderr before the SIGKILL below.
    print(message(int(worker_index), seconds, addresses), file=sys.stderr, flush=True)
    with contextlib.suppress(ProcessLookupError):
        os.kill(int(pid), signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
