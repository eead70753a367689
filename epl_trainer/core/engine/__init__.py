"""Execution: engine-owned state, the tf.function steps, and the passes that shape them.

The trainer's entry point is `plan_engine` then `build_engine` (engine.py, builder.py);
it drives the resulting `Engine`. Inside:

* `state`, `layout`: where every variable copy lives; lanes, stage groups;
* `hooks`, `program`, `pipeline`: the steps and their extension points; one lane's
  micro-batches through its stages in schedule order;
* `reduce`, `update`, `zero`: gradient reduction and clipping, the replicated update
  (grouped apply, offload), ZeRO's sharded update;
* `split`, `split_lanes`, `recompute`, `gradient_check`, `amp`, `finite`: the passes.
"""

from epl_trainer.core.engine.builder import build_engine
from epl_trainer.core.engine.engine import Engine, EnginePlan, plan_engine
from epl_trainer.core.engine.precision import MinLossScaleError, min_scale_error
from epl_trainer.core.engine.program import BATCH_SIZE_KEY, ROWS_BY_WORKER_KEY, STEPS_KEY

__all__ = [
    "BATCH_SIZE_KEY",
    "ROWS_BY_WORKER_KEY",
    "STEPS_KEY",
    "Engine",
    "EnginePlan",
    "MinLossScaleError",
    "build_engine",
    "min_scale_error",
    "plan_engine",
]
