"""Agreement among the workers on a few integers, over their host CPUs.

Saves agree on the step and the temporary folder before writing, and meet after it (the
barrier); a resume agrees on the checkpoint; `fit` on the shuffling seed; an elastic job
on a resize. Each is one tiny all-gather, bounded by the lost-worker check.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from epl_trainer.core.comm.hosts import host_group, rows_by_worker


class HostAgreement:
    """`gather(values, what)` returns every worker's int64 vector (the same length on
    every worker), by worker index. The collective group is made at the first gather.

    Args:
      cluster: the job's cluster.
      watch: `watch(what)`, a context manager naming a lost peer within the timeout
        (`EngineRuntime.watch`).
    """

    def __init__(self, cluster, watch: Callable):
        self.cluster = cluster
        self._watch = watch
        self._group = None
        self._gather = None

    def _gather_values(self, values):
        with tf.device(self.cluster.host_device):
            return self._group.all_gather([tf.identity(values)])[0]

    def gather(self, values: list[int], what: str = "a checkpoint save") -> list[list[int]]:
        if self._group is None:
            self._group = host_group(self.cluster.devices_by_worker, self.cluster.host_device)
            self._gather = tf.function(self._gather_values)
        with self._watch(what):
            gathered = self._gather(tf.constant(values, tf.int64)).numpy()
        return rows_by_worker(self._group, gathered).tolist()
