"""The worker processes of one `epl-launch` attempt: started, logged, supervised, stopped.

Each worker runs in its own process group (session), so stopping it stops what it
started; its output is copied to its log file (worker 0's also to the console). A
worker that fails stops the others: SIGTERM to their groups, SIGKILL after a grace
period. Pure Python, like the launcher.
"""

from __future__ import annotations

import codecs
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psutil

from epl_trainer.runtime.elastic import RESIZE_EXIT_CODE

PROG = "epl-launch"
EXIT_TIMEOUT = 124
GRACE_SECONDS = 5.0
POLL_SECONDS = 0.1
TAIL_LINES = 20


def exit_code(returncode: int) -> int:
    """A shell-style exit code: ``128 + s`` for a process killed by signal ``s``."""
    return 128 - returncode if returncode < 0 else returncode


def log_tail(path: Path, num_lines: int = TAIL_LINES) -> list[str]:
    """The last ``num_lines`` lines of a log file (empty if it cannot be read)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return [line.rstrip("\n") for line in deque(file, maxlen=num_lines)]
    except OSError:
        return []


def _tee(pipe: IO[bytes], log_file: IO[bytes], console: IO[str] | None) -> None:
    """Copy a worker's output to its log file and, decoded, to the console until EOF."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with pipe, log_file:
        # read1 returns whatever is available, so partial lines (prompts, progress
        # bars) reach the console without waiting for a newline.
        while chunk := pipe.read1(65536):
            log_file.write(chunk)
            log_file.flush()
            if console is None:
                continue
            try:
                console.write(decoder.decode(chunk))
                console.flush()
            except (OSError, ValueError):
                console = None  # a closed console must not stop the log file


def say(message: str) -> None:
    """A launcher message: to stderr, so stdout carries only worker 0's output."""
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already empty


def _group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a member that is not a zombie.

    A grandchild orphaned by its worker waits as a zombie until init reaps it, which can
    take a second or never happen (a launcher running as PID 1 in a container), so
    zombies are skipped (psutil reads each process's state on any Unix).
    """
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    for process in psutil.process_iter(["status"]):
        try:
            if os.getpgid(process.pid) == pgid and process.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, PermissionError):
            continue  # the process exited while we looked
    return False


@dataclass
class _Worker:
    index: int
    process: subprocess.Popen
    log_path: Path
    reader: threading.Thread | None = None


class Job:
    """One command run as several workers, each in its own process group, supervised.

    ``start()`` spawns the workers, ``wait()`` supervises them and returns the exit code
    for the launcher, ``stop()`` stops every process group (idempotent; call it in a
    ``finally``). ``request_stop()`` is safe to call from a signal handler.
    """

    def __init__(
        self,
        command: Sequence[str],
        envs: Sequence[Mapping[str, str]],
        run_dir: Path,
        *,
        console: IO[str] | None = None,
        grace_seconds: float = GRACE_SECONDS,
        attempt: int = 0,
    ):
        self.attempt = attempt
        self.timed_out = False
        self.command = list(command)
        self.envs = [dict(env) for env in envs]
        self.run_dir = Path(run_dir)
        self.console = sys.stdout if console is None else console
        self.grace_seconds = grace_seconds
        self.workers: list[_Worker] = []
        self._stop_signal: int | None = None
        # The first worker to fail: (index, Popen returncode; negative = killed by signal).
        self.failure: tuple[int, int] | None = None
        # The workers were asked to stop at a checkpoint to resize (launch_elastic.py):
        # their exit code 75 is then expected, not a failure.
        self.resizing = False
        self.on_poll = None  # called with the job at every poll of wait()

    def log_path(self, index: int) -> Path:
        suffix = f".restart_{self.attempt}" if self.attempt else ""
        return self.run_dir / f"worker_{index}{suffix}.log"

    def start(self) -> None:
        """Spawn every worker; worker 0's output is teed to the console."""
        for index, env in enumerate(self.envs):
            self.workers.append(self._spawn(index, env, stream=index == 0))

    def _spawn(self, index: int, env: Mapping[str, str], stream: bool) -> _Worker:
        log_path = self.log_path(index)
        log_file = open(log_path, "wb")  # noqa: SIM115 - closed below or by the tee thread
        try:
            process = subprocess.Popen(
                self.command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if stream else log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: stop() reaches grandchildren
            )
        except BaseException:
            log_file.close()
            raise
        worker = _Worker(index, process, log_path)
        if stream:
            worker.reader = threading.Thread(
                target=_tee,
                args=(process.stdout, log_file, self.console),
                name=f"epl-launch-tee-{index}",
                daemon=True,
            )
            worker.reader.start()
        else:
            log_file.close()  # the child holds its own descriptor
        return worker

    @property
    def stop_requested(self) -> bool:
        return self._stop_signal is not None

    def request_stop(self, signum: int) -> None:
        """Ask ``wait()`` to stop all workers and return ``128 + signum``."""
        self._stop_signal = signum

    def wait(self, timeout: float | None = None, *, deadline: float | None = None) -> int:
        """Supervise the workers until all succeed, one fails, time runs out or a stop
        is requested; returns the launcher's exit code (see the module docstring).

        ``deadline`` (a ``time.monotonic()`` value) replaces ``now + timeout`` when a
        timeout spans several attempts of the job.
        """
        if deadline is None and timeout is not None:
            deadline = time.monotonic() + timeout
        while True:
            if self._stop_signal is not None:
                say(f"received {_signal_name(self._stop_signal)}; stopping all workers")
                self.stop()
                return 128 + self._stop_signal
            if self.on_poll is not None:
                self.on_poll(self)
            failed = self._first_failure()
            if failed is not None:
                self.failure = (failed.index, failed.process.returncode)
                if self.resizing and failed.process.returncode == RESIZE_EXIT_CODE:
                    say(f"worker {failed.index} stopped at a checkpoint to resize the job")
                    self.stop()
                    return RESIZE_EXIT_CODE
                self._report_failure(failed)
                return exit_code(failed.process.returncode)
            if all(worker.process.poll() == 0 for worker in self.workers):
                self.stop()  # reaps leftover grandchildren and the tee thread
                say(f"all {len(self.workers)} worker(s) finished successfully")
                return 0
            if deadline is not None and time.monotonic() >= deadline:
                say(f"timeout of {timeout:g}s exceeded; stopping all workers")
                self.timed_out = True
                self.stop()
                return EXIT_TIMEOUT
            time.sleep(POLL_SECONDS)

    def _first_failure(self) -> _Worker | None:
        """The failed worker that caused the failure: one killed by a signal before one
        that exited with an error (its peers fail because they lost it: the elastic
        launcher must see the kill, not a survivor's WorkerLostError)."""
        failed = [w for w in self.workers if w.process.poll() not in (None, 0)]
        killed = [w for w in failed if w.process.returncode < 0]
        return (killed or failed or [None])[0]

    def _report_failure(self, worker: _Worker) -> None:
        returncode = worker.process.returncode
        how = f"was killed by {_signal_name(-returncode)}" if returncode < 0 else "failed"
        say(
            f"worker {worker.index} {how} (exit code {exit_code(returncode)}); "
            "stopping the other workers"
        )
        self.stop()  # also lets worker 0's tee thread finish its log before the tail
        tail = log_tail(worker.log_path)
        say(f"last {len(tail)} lines of {worker.log_path}:")
        for line in tail:
            print(f"  | {line}", file=sys.stderr)
        sys.stderr.flush()

    def stop(self) -> None:
        """Stop every worker's process group: SIGTERM, then SIGKILL after the grace period.

        Groups whose leader already exited are signalled too, so nothing a worker
        started outlives the launcher.
        """
        pgids = [worker.process.pid for worker in self.workers]  # leader pid == pgid
        for pgid in pgids:
            _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_seconds
        while time.monotonic() < deadline:
            for worker in self.workers:
                worker.process.poll()  # reap leaders so zombies do not count as alive
            if not any(_group_alive(pgid) for pgid in pgids):
                break
            time.sleep(0.05)
        for pgid in pgids:
            _signal_group(pgid, signal.SIGKILL)
        for worker in self.workers:
            worker.process.wait()
            if worker.reader is not None:
                worker.reader.join(timeout=self.grace_seconds)
