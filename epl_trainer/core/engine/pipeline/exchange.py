"""Every worker's Keras model gets the whole trained model, when replicas span workers
or a Keras layout holds blocks over a batch axis whose replicas are on several workers.

A worker that holds only some stages of its lanes has trained values for those stages'
variables only. After writing them into its Keras model, each worker contributes the
variables it owns (a stage's owner: the worker holding that stage in the job's first
lane) and zeros for the rest to one summing all-reduce over the workers' host CPUs, so
`model.get_weights()` and `model.save()` see the complete model on every worker, as in
Keras. A variable held in blocks across workers is written back partially (its local
blocks, zeros for the others: `EngineState.full_value`), and the sum completes it. It is
a collective: every worker writes back at the same points of `fit`.
"""

from __future__ import annotations

import tensorflow as tf

from epl_trainer.core import comm
from epl_trainer.core.engine.state import EngineState, Lane, is_seed_state


class WeightExchange:
    """Completes the Keras model on every worker from the stages' owners.

    Args:
      state: this worker's engine state.
      first_lane: the job's lane 0 (its `workers` say who owns each stage).
      group: the workers' host group (`comm.hosts.host_group`).
      worker: this worker.
      stages_span: the replicas' stages are on several workers (else only the `partial`
        variables are exchanged).
      partial: trainable indices held in blocks across workers: every worker's partial
        value is summed.
    """

    def __init__(
        self,
        state: EngineState,
        first_lane: Lane,
        group,
        worker: int,
        stages_span: bool = True,
        partial: frozenset[int] = frozenset(),
    ):
        (host,) = group.local_devices
        variables, owned = [], []  # owned: contributes its value (None: partial, summed)
        for i, (v, stage) in enumerate(zip(state.model_trainable, state.trainable_stage)):
            if i in partial:
                variables.append(v)
                owned.append(None)
            elif stages_span:
                variables.append(v)
                owned.append(first_lane.workers[stage] == worker)
        for v, stage in zip(state.model_non_trainable, state.non_trainable_stage):
            if stages_span and not is_seed_state(v):
                variables.append(v)
                owned.append(first_lane.workers[stage] == worker)
        sizes = [int(v.value.shape.num_elements()) for v in variables]
        buckets = comm.plan_buckets(sizes, [v.dtype for v in variables], 1)

        @tf.function(autograph=False)
        def exchange():
            with tf.device(host):
                values = [
                    v.value if mine is not False else tf.zeros(v.shape, v.dtype)
                    for v, mine in zip(variables, owned)
                ]
                summed = comm.fused_all_reduce(group, [values], buckets, "sum")[0]
                for v, mine, value in zip(variables, owned, summed):
                    if mine is not True:
                        v.assign(value)

        self._exchange = exchange

    def __call__(self) -> None:
        self._exchange()
