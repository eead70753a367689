"""Each lane's forward and backward as one XLA function on the lane's device.

Data parallelism on one worker runs a lane per device; each lane's schedule (one stage,
one micro-batch) is then a whole forward and backward that no other lane's op joins
until the update's reduction. Compiled as one function per lane (jit_choice.py says
when), the lanes run side by side as a few XLA executables instead of hundreds of
TensorFlow ops each; the reduction, the update and the metrics stay outside.
"""

from __future__ import annotations

import tensorflow as tf

from epl_trainer.core.engine.pipeline import MicroBatch, run_to_end

# What the step reads of a micro-batch after its lane ran (metrics, the data divisor).
_REPORTED = ("labels", "y_pred", "loss", "mask", "rows", "weights", "data_share", "data_estimate")


def emit_lanes_compiled(lane_runs: list, devices: list, hooks) -> list:
    """Runs each lane's `LaneExecutor.steps` generator inside its own XLA function.

    Args:
      lane_runs: per lane, the generator (not started: its ops are emitted inside the
        function, which captures the lane's inputs and variables).
      devices: per lane, its one device.
      hooks: the step's `StepHooks` (`hooks.lanes.lane(li)` scopes each lane).

    Returns:
      Per lane, what `LaneExecutor.run` returns, the micro-batches holding only what
      the step reads of them afterwards.
    """
    # A compiled function reads only resources on its own device: AMP's loss scale, a
    # variable on the host, is read once outside and captured as a value.
    loss_scale = hooks.loss_scale
    if loss_scale is not None:
        value = loss_scale()
        hooks.loss_scale = lambda: value
    try:
        return _emit(lane_runs, devices, hooks)
    finally:
        hooks.loss_scale = loss_scale


def _emit(lane_runs: list, devices: list, hooks) -> list:
    results = []
    for li, (run, device) in enumerate(zip(lane_runs, devices)):

        def lane(run=run):
            grads, non_trainable, micro_batches = run_to_end(run)
            reported = [{key: getattr(mb, key) for key in _REPORTED} for mb in micro_batches]
            return grads, non_trainable, reported

        with hooks.lanes.lane(li), tf.device(device):
            compiled = tf.function(lane, jit_compile=True, autograph=False)
            grads, non_trainable, reported = compiled()
        micro_batches = [MicroBatch(values={}, index=None, **fields) for fields in reported]
        results.append((grads, non_trainable, micro_batches))
    return results
