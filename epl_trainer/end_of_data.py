"""Workers agree on the end of their data before every training step.

Each worker feeds its own input pipeline. When one runs out first, its peers would wait
in the step's collectives for a partner that never comes (until the watchdog aborts
them). So in a multi-worker job every worker takes its next batch outside the compiled
step, and one tiny all-gather of "have a batch" flags over the workers' host CPUs lets
all of them end the epoch at the same step, as Keras' multi-worker training does, with
a warning naming the workers that ran out. Single-worker jobs do not pay for this.
"""

from __future__ import annotations

import logging

import tensorflow as tf

from epl_trainer.cluster import Cluster
from epl_trainer.core import comm

logger = logging.getLogger(__name__)


class EndOfDataAgreement:
    """`next_batch(iterator)` returns this worker's batch, or raises StopIteration on
    every worker at the first step where any worker has none."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        hosts = tuple(
            devices[0].rsplit("/device:", 1)[0] + "/device:CPU:0"
            for devices in cluster.devices_by_worker
        )
        self._group = comm.CollectiveGroup(hosts, (cluster.host_device,))
        # Made before tracing: a variable created inside the trace would trace it twice and
        # take a second instance key on this worker only (see trainer._synced_logs).
        comm.ordering_token(cluster.host_device)
        self._gather = tf.function(self._gather_flags)

    def _gather_flags(self, has_batch):
        with tf.device(self.cluster.host_device):
            flag = tf.reshape(tf.cast(has_batch, tf.int32), [1])
        return self._group.all_gather([flag])[0]

    def next_batch(self, iterator, step: int):
        optional = iterator.get_next_as_optional()
        flags = self._gather(optional.has_value())
        # Gathered in collective rank order: map ranks back to worker indices.
        ranks = [self._group.rank_of(device) for device in self._group.devices]
        have = {w: bool(flags.numpy()[ranks[w]]) for w in range(self.cluster.worker_num)}
        out_of_data = sorted(w for w, has in have.items() if not has)
        if out_of_data and len(out_of_data) < self.cluster.worker_num:
            logger.warning(
                "Worker(s) %s ran out of data at step %d of this epoch while others still "
                "had batches; every worker ends the epoch here (the remaining batches of "
                "the others are not used). Give every worker the same number of batches "
                "(e.g. drop_remainder, or steps_per_epoch).",
                out_of_data,
                step,
            )
        if out_of_data:
            raise StopIteration
        return optional.get_value()
