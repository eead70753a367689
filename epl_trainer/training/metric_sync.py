"""Epoch metrics over every worker: each metric's state variables summed across workers.

Keras metrics keep sums and counts in variables; summing those over the workers' host
CPUs (one fused all-reduce) and computing the result from the sums gives the metric of
the whole job's data, whatever share each worker saw. It works without the engine's
program, since a worker that got no evaluation data built none.
"""

from __future__ import annotations

import tensorflow as tf

from epl_trainer.core import comm
from epl_trainer.core.comm.hosts import host_group
from epl_trainer.runtime.cluster import Cluster
from epl_trainer.training.fit_inputs import log_value


class MetricSync:
    """Reduces the state of a fixed list of metrics over the workers of `cluster`."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self._reduce = None

    def results(self, named_metrics) -> dict:
        """{log key: value over all workers} of [(log key, metric)] (the metrics must
        stay the same); a metric whose result is a dict (Keras's `CompileMetrics`) gives
        its items, as Keras flattens logs."""
        if self._reduce is None:
            self._reduce = self._build([v for _, m in named_metrics for v in m.variables])
        reduced = iter(self._reduce())
        logs = {}
        for name, m in named_metrics:
            values = [next(reduced) for _ in m.variables]
            result = m.stateless_result(values)
            if isinstance(result, dict):
                logs.update({key: log_value(value) for key, value in result.items()})
            else:
                logs[name] = log_value(result)
        return logs

    def _build(self, variables):
        host = self.cluster.host_device
        # host_group creates the ordering token now, before the trace (a worker that got
        # no evaluation data and built no program must not trace twice, see hosts.py).
        group = host_group(self.cluster.devices_by_worker, host)
        buckets = comm.plan_buckets([1] * len(variables), [v.dtype for v in variables], 1)

        @tf.function
        def reduce_all():
            with tf.device(host):
                values = [tf.identity(v.value) for v in variables]
            return comm.fused_all_reduce(group, [values], buckets, "sum")[0]

        return reduce_all
