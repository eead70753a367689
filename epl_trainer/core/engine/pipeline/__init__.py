"""Pipeline parallelism: one lane's micro-batches through its stages in schedule order
(`executor`), stage boundaries that cross worker processes (`boundaries`), and the whole
model's weights for every worker when replicas span workers (`exchange`)."""

from epl_trainer.core.engine.surface import lazy_surface

__getattr__, __dir__, __all__ = lazy_surface(
    __name__,
    {
        "LaneExecutor": "executor",
        "MicroBatch": "executor",
        "MicroBatchInput": "executor",
        "run_to_end": "executor",
        "compiled_stage_call": "executor",
        "stateless_stage_call": "executor",
        "training_kwargs": "executor",
        "Boundaries": "boundaries",
        "LaneBoundaries": "boundaries",
        "WeightExchange": "exchange",
        "TaskClock": "task_clock",
    },
)
