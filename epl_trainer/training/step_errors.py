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


def nonfinite_loss_error(where: str) -> NonFiniteLossError:
    """The error for the step at `where` ("training step 3 (epoch 1, batch 2)")."""
    return NonFiniteLossError(
        f"The loss or its gradients are not finite (NaN or Inf) at {where}. "
        "The step was not applied: weights and optimizer state are those before "
        "it. Look for the source (learning rate, input data, a log of zero), or "
        "set optimizer.nonfinite_loss='skip' to skip such steps."
    )


def run_checked(step_fn, *args):
    """Runs a step; AMP's in-graph minimum-scale assertion becomes the error it stands for."""
    try:
        return step_fn(*args)
    except tf.errors.InvalidArgumentError as e:
        if (error := engine.min_scale_error(e)) is not None:
            raise error from None
        raise
