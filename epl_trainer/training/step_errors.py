"""What a failed or skipped training step stands for, as the user's error.

`fit`'s loop and `train_on_batch` run the engine's training step the same way: through
`run_checked` (AMP's in-graph minimum-scale assertion becomes `MinLossScaleError`), and a
step the engine skipped for a non-finite loss stops training with `NonFiniteLossError`
unless `optimizer.nonfinite_loss="skip"`.
"""

from __future__ import annotations

import tensorflow as tf

from epl_trainer.core import engine


class NonFiniteLossError(FloatingPointError):
    """A float32 training step produced a NaN or Inf loss (non-finite gradients)."""


# The largest finite float16.
_FLOAT16_MAX = 65504.0


def nonfinite_loss_error(where: str, communication=None) -> NonFiniteLossError:
    """The error for the step at `where` ("training step 3 (epoch 1, batch 2)").

    Args:
      communication: the `communication` config section: with `fp16` on, the float16
        wire is named as a likely source (a finite loss whose scaled gradients pass
        65504 overflows there, and the message pointed at the data instead).
    """
    wire = ""
    if communication is not None and communication.fp16:
        scale = communication.fp16_scale
        wire = (
            " With communication.fp16=True gradients are reduced as float16 after "
            f"multiplication by communication.fp16_scale={scale:g}: a gradient above "
            f"{_FLOAT16_MAX / scale:g} overflows there; lower the scale or set "
            "communication.fp16=False."
        )
    return NonFiniteLossError(
        f"The loss or its gradients are not finite (NaN or Inf) at {where}. "
        "The step was not applied: weights and optimizer state are those before "
        "it. Look for the source (learning rate, input data, a log of zero), or "
        f"set optimizer.nonfinite_loss='skip' to skip such steps.{wire}"
    )


def run_checked(step_fn, *args):
    """Runs a step; AMP's in-graph minimum-scale assertion becomes the error it stands for."""
    try:
        return step_fn(*args)
    except tf.errors.InvalidArgumentError as e:
        if (error := engine.min_scale_error(e)) is not None:
            raise error from None
        raise
