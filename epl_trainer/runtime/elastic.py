"""Elastic training, the trainer's side: a job restarted on another number of workers
keeps its global batch, and stops at a checkpoint when asked to change size. Pure
Python (the launcher imports RESIZE_EXIT_CODE from here).

`epl-launch --min_workers K` (launch_elastic.py) restarts a job that lost a worker on
the survivors, and on more workers again once one comes back; it sets the two
`elastic.*` keys below (as `EPL_ELASTIC_MAX_WORKERS`, `EPL_ELASTIC_RESIZE_FILE`), and
the script sets `io.global_batches`. Any scheduler that restarts the job with a new
TF_CONFIG gets the same by setting those keys:

- `io.global_batches`: fit's data yields global batches, the same on every worker, and
  each input shard trains on its rows of each (`data.rows_of_shard`). The batch a step
  trains on, and the checkpoint's input position (counted in global batches), then do
  not depend on how many workers share them.
- `elastic.max_workers`: the worker count the job is sized for. On fewer workers each
  takes more rows of a global batch, so the step raises its micro-batches (gradient
  accumulation) by ceil(max_workers / workers): no micro-batch is larger than on the
  full job, and the step's gradient is the same (the loss is normalised by the global
  batch's rows, not per micro-batch).
- `elastic.resize_file`: once this file exists, fit stops right after its next
  checkpoint on every worker (they agree, so none waits for a peer that left) and the
  process exits with `RESIZE_EXIT_CODE`; the job restarted on its new worker count
  resumes that checkpoint, which restores into any layout.
"""

from __future__ import annotations

import logging
import math
import os

logger = logging.getLogger(__name__)

# EX_TEMPFAIL: the process stopped at a checkpoint so that the job can change size.
RESIZE_EXIT_CODE = 75


class ResizeExit(SystemExit):
    """Raised out of fit (and the script) after the checkpoint of step `step`."""

    def __init__(self, step: int):
        super().__init__(RESIZE_EXIT_CODE)
        self.step = step


def sized_config(config, worker_num: int):
    """`config` for a job of `worker_num` workers: the micro-batches raised by
    ceil(elastic.max_workers / worker_num) when the job runs below its full size."""
    max_workers = config.elastic.max_workers
    factor = math.ceil(max_workers / worker_num) if max_workers else 1
    if factor <= 1:
        return config
    if not config.io.global_batches:
        logger.warning(
            "elastic.max_workers=%d on %d worker(s) without io.global_batches: each worker "
            "trains on its own batches as the data gives them, so the global batch is "
            "smaller than the full job's and the micro-batches are left as they are.",
            max_workers,
            worker_num,
        )
        return config
    micro_batches = config.pipeline.num_micro_batch * factor
    logger.warning(
        "Elastic job on %d of %d workers: %d micro-batches per step instead of %d "
        "(gradient accumulation: the global batch stays the full job's, and no "
        "micro-batch is larger than there).",
        worker_num,
        max_workers,
        micro_batches,
        config.pipeline.num_micro_batch,
    )
    return config.replace({"pipeline.num_micro_batch": micro_batches})


def stop_if_resize_requested(config, worker_num: int, agree, step: int) -> None:
    """After a checkpoint: raises ResizeExit on every worker once any of them sees
    elastic.resize_file. `agree(values, what)` gathers one int per worker (the
    trainer's host all-gather, under the watchdog)."""
    path = config.elastic.resize_file
    if not path:
        return
    requested = os.path.exists(path)
    if worker_num > 1:
        requested = any(flag for (flag,) in agree([int(requested)], "agreeing on a resize"))
    if requested:
        logger.warning(
            "Stopping after the checkpoint of step %d: the job restarts on another number "
            "of workers (%s exists).",
            step,
            path,
        )
        raise ResizeExit(step)
