"""What every part of the trainer reads: the run's settings, settled in two steps.

`EPLTrainer` is a facade over parts that each own their state (the engine runtime, the
data feeder, the checkpoint manager, the inference runner, the fit loop, ...). What they
share is this context: the resolved config and cluster, the options given to the
trainer, and what planning adds (the model, the optimizer, the engine plan). It is
written in two places only: the trainer's construction, and the model planner
(model_planning.py) when it plans the model, at construction or at the first data.
Everything that changes while training runs belongs to a part, not here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras

from epl_trainer.config.sections import Config
from epl_trainer.core import engine
from epl_trainer.training.end_of_data import EndOfDataAgreement
from epl_trainer.training.metric_sync import MetricSync


@dataclasses.dataclass
class TrainerContext:
    """The run's settings, as the parts read them.

    Attributes:
      config: the resolved config (DeepSpeed's accumulation and Keras's mixed precision
        included).
      cluster: this job's cluster (`runtime/cluster.py`).
      optimizer: the user's optimizer, the "master" every engine copy follows.
      steps_per_execution: training steps per call of the compiled step.
      jit_compile: True, False or "auto".
      params: an Estimator-style model_fn's `params`.
      deepspeed: the DeepSpeed run of a DeepSpeed config (deepspeed_run.py), or None.
      distribution: the `keras.distribution` the run follows (keras_distribution.py), or
        None.
      model: the Keras model; None until a model_fn is called.
      engine_plan: the planned engine (`engine.plan_engine`); None until planned.
      metric_sync: sums the metrics over workers; None with one worker.
      end_of_data: the workers' agreement on the end of the data; None with one worker.
    """

    config: Config
    cluster: Any
    optimizer: keras.optimizers.Optimizer
    steps_per_execution: int
    jit_compile: bool | str
    params: Any = None
    deepspeed: Any = None
    distribution: Any = None
    model: keras.Model | None = None
    engine_plan: engine.EnginePlan | None = None
    metric_sync: MetricSync | None = dataclasses.field(default=None, init=False)
    end_of_data: EndOfDataAgreement | None = dataclasses.field(default=None, init=False)

    def __post_init__(self):
        if self.cluster.worker_num > 1:
            self.metric_sync = MetricSync(self.cluster)
            self.end_of_data = EndOfDataAgreement(self.cluster)

    @property
    def plan(self):
        """The parallel plan: TaskGraphs x replicas x devices, micro-batches, schedule."""
        return self.engine_plan.plan

    @property
    def data_shards(self) -> int:
        """Input shards the job reads: the worker count, unless replicas span workers
        (those workers read the same batches). A worker's batch = global batch / this."""
        planned = self.engine_plan  # None: a model_fn not built yet
        return self.cluster.worker_num if planned is None else planned.data_shards[0]

    @property
    def data_shard(self) -> int:
        """The input shard this worker reads (`fit` and `evaluate` shard arrays by it)."""
        planned, worker = self.engine_plan, self.cluster.worker_index
        return worker if planned is None else planned.data_shards[1][worker]

    @property
    def runs_user_steps(self) -> bool:
        """The model's own train_step (or compute_loss, ...) runs (user_steps.py)."""
        return self.engine_plan is not None and bool(self.engine_plan.user_steps)
