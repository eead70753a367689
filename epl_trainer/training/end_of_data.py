"""Workers agree on the end of their data before every training step.

Each worker feeds its own input pipeline. When one runs out first, its peers would wait
in the step's collectives for a partner that never comes (until the watchdog aborts
them). So in a multi-worker job every worker takes its next batch outside the compiled
step, and one tiny all-gather of each worker's batch rows (0: no batch) over the
workers' host CPUs lets all of them end the epoch at the same step, as Keras'
multi-worker training does, with a warning naming the workers that ran out. The same
gather gives the global batch's rows, which the step's loss is normalised by: a worker's
last batch may be shorter than its peers'. Single-worker jobs do not pay for this.
"""

from __future__ import annotations

import logging

import tensorflow as tf

from epl_trainer.core.comm.hosts import host_group, rows_by_worker
from epl_trainer.runtime.cluster import Cluster

logger = logging.getLogger(__name__)


class EndOfDataAgreement:
    """`next_batch(iterator)` returns this worker's batch and the global batch's rows, or
    raises StopIteration on every worker at the first step where any worker has none."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self._group = host_group(cluster.devices_by_worker, cluster.host_device)
        self._gather = tf.function(self._gather_rows)

    def _gather_rows(self, optional):
        with tf.device(self.cluster.host_device):
            rows = tf.cond(
                optional.has_value(), lambda: _rows(optional.get_value()), lambda: tf.constant(0)
            )
            rows = tf.reshape(rows, [1])
        return self._group.all_gather([rows])[0]

    def next_batch(self, iterator, step: int, shard_of_worker):
        """(this worker's batch, the global batch's rows).

        Args:
          shard_of_worker: the input shard each worker reads; workers of one shard (the
            stages of a replica spanning them) read the same batch, counted once.
        """
        optional = iterator.get_next_as_optional()
        rows = [int(r) for r in rows_by_worker(self._group, self._gather(optional)).ravel()]
        if warn_if_out_of_data(rows, step):
            raise StopIteration
        by_shard = dict(zip(shard_of_worker, rows))
        return optional.get_value(), sum(by_shard.values())

    def in_graph(self, shard_of_worker) -> InGraphAgreement:
        """The agreement as graph ops, for a loop of steps compiled into one call
        (steps_per_execution > 1)."""
        return InGraphAgreement(self, shard_of_worker)


class InGraphAgreement:
    """`agreement(optional)` in a compiled loop, before each step: (whether every worker
    has a batch, the global batch's rows as float32, each worker's rows [workers])."""

    def __init__(self, agreement: EndOfDataAgreement, shard_of_worker):
        group = agreement._group
        self._agreement = agreement
        self._ranks = [group.rank_of(device) for device in group.devices]
        self._first_of_shard = [shard_of_worker.index(s) for s in sorted(set(shard_of_worker))]
        self.workers = agreement.cluster.worker_num

    def __call__(self, optional):
        with tf.device(self._agreement.cluster.host_device):
            by_worker = tf.gather(self._agreement._gather_rows(optional), self._ranks)
            total = tf.reduce_sum(tf.gather(by_worker, self._first_of_shard))
            return tf.reduce_min(by_worker) > 0, tf.cast(total, tf.float32), by_worker


def warn_if_out_of_data(rows, step: int) -> bool:
    """Whether any worker ran out of data (rows[w] == 0) at `step`; warns when some still
    had batches."""
    out_of_data = [w for w, count in enumerate(rows) if count == 0]
    if out_of_data and len(out_of_data) < len(rows):
        logger.warning(
            "Worker(s) %s ran out of data at step %d of this epoch while others still "
            "had batches; every worker ends the epoch here (the remaining batches of "
            "the others are not used). Give every worker the same number of batches "
            "(e.g. drop_remainder, or steps_per_epoch).",
            out_of_data,
            step,
        )
    return bool(out_of_data)


def _rows(element) -> tf.Tensor:
    """A batch's rows (int32): the first dimension of its first tensor."""
    first = tf.nest.flatten(element)[0]
    if isinstance(first, tf.RaggedTensor):
        return tf.cast(first.nrows(), tf.int32)
    return tf.shape(first)[0]
