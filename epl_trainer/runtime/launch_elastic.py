"""`epl-launch --min_workers K`: the job shrinks when a worker is lost and grows back
when one joins. Pure Python, like the launcher (the trainer's side is elastic.py).

A job of N workers (`--num_workers`) with `--min_workers K` < N is elastic:

* **Shrink.** A worker that dies of a signal (``kill -9``, the OOM killer; in a cluster,
  a lost machine) is lost. The launcher stops the others at once (they would otherwise
  wait for the dead peer until the watchdog's timeout) and restarts the job on one
  worker fewer, as long as K remain; the workers resume the newest checkpoint in the
  new layout. A worker that fails with an exit code (an error in the script) is not
  lost: that failure goes to ``--max_restarts`` as before, since fewer workers would
  not fix it. Shrinking does not count as a restart.
* **Grow.** ``epl-launch --join RUN_DIR`` (from the machine that came back, an
  operator, a scheduler's hook) announces one more worker. The running job is asked
  to stop at its next checkpoint (the attempt's ``elastic.resize_file`` appears; every
  worker saves, agrees and exits with 75) and restarts with one more worker, at most N.
  A join while the job has all N workers is dropped with a message.

Every worker gets ``EPL_ELASTIC_MAX_WORKERS=N`` and ``EPL_ELASTIC_RESIZE_FILE`` (this
attempt's file in the run folder). The global batch stays the full job's only if the
script trains on global batches (``io.global_batches``); see elastic.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from epl_trainer.runtime.elastic import RESIZE_EXIT_CODE
from epl_trainer.runtime.launch_job import Job, say

JOIN_FOLDER = "join"


def request_join(run_dir: str | os.PathLike) -> Path:
    """``epl-launch --join RUN_DIR``: leaves a join request for the launcher of RUN_DIR.

    Raises:
        FileNotFoundError: RUN_DIR is not the run folder of an elastic launch.
    """
    folder = Path(run_dir) / JOIN_FOLDER
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{run_dir!r} is not the run folder of an elastic epl-launch (no {JOIN_FOLDER}/ "
            "in it; the launcher prints its run folder and needs --min_workers)."
        )
    request = folder / f"{time.time_ns()}-{os.getpid()}"
    request.write_text("")
    return request


class ElasticSize:
    """The worker count of each attempt of an elastic job, from losses and joins."""

    def __init__(self, max_workers: int, min_workers: int, run_dir: Path):
        self.max_workers, self.min_workers = max_workers, min_workers
        self.size = max_workers
        self.run_dir = Path(run_dir)
        self._joined = 0  # join requests taken while the job runs, not yet in `size`
        if self.enabled:
            (self.run_dir / JOIN_FOLDER).mkdir(exist_ok=True)

    @property
    def enabled(self) -> bool:
        return self.min_workers < self.max_workers

    def resize_file(self, attempt: int) -> Path:
        return self.run_dir / f"resize_{attempt}"

    def worker_env(self, attempt: int) -> dict[str, str]:
        """What every worker of `attempt` gets besides the launcher's usual variables."""
        if not self.enabled:
            return {}
        return {
            "EPL_ELASTIC_MAX_WORKERS": str(self.max_workers),
            "EPL_ELASTIC_RESIZE_FILE": str(self.resize_file(attempt)),
        }

    def poll(self, job: Job) -> None:
        """While `job` runs: takes join requests and asks the job to stop at its next
        checkpoint when it can grow."""
        if not self.enabled:
            return
        for request in sorted((self.run_dir / JOIN_FOLDER).iterdir()):
            request.unlink(missing_ok=True)
            if self.size + self._joined >= self.max_workers:
                say(f"a worker asked to join; the job already has {self.max_workers} (ignored)")
                continue
            self._joined += 1
            say(
                f"a worker asked to join: the job stops at its next checkpoint and restarts "
                f"on {self.size + self._joined} worker(s)"
            )
        if self._joined and not job.resizing:
            self.resize_file(job.attempt).write_text("")
            job.resizing = True

    def next_size(self, job: Job, code: int) -> int | None:
        """The worker count to restart with after `job` ended with `code` (not 0), or None
        when this is not an elastic restart (the failure rules of --max_restarts apply)."""
        if not self.enabled:
            return None
        lost = job.failure is not None and job.failure[1] < 0  # died of a signal
        if code == RESIZE_EXIT_CODE and job.resizing:
            size = self.size + self._joined
        elif lost and self.size - 1 + self._joined >= self.min_workers:
            size = self.size - 1 + self._joined
            say(
                f"worker {job.failure[0]} is lost; restarting on {size} worker(s) "
                f"(--min_workers {self.min_workers}) from the newest checkpoint"
            )
        else:
            if lost:
                say(f"fewer than --min_workers {self.min_workers} would remain; not shrinking")
            return None
        self.size, self._joined = size, 0
        return size
