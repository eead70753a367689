"""DeepSpeed (PyTorch) update rules that Keras's optimizers lack, as Keras optimizers.

* Coupled (L2) weight decay: PyTorch's SGD and Adagrad, and DeepSpeed's Adam with
  `adam_w_mode: false`, add `weight_decay * w` to each gradient before the update
  (Keras's `weight_decay` is decoupled instead: AdamW-style, outside the update rule).
  `with_l2(cls)` is `cls` with that addition; a variable excluded from weight decay
  (`exclude_from_weight_decay`) gets none.
* `FusedLamb`: DeepSpeed's Lamb puts weight decay inside the trust ratio (the update is
  `m_hat / (sqrt(v_hat) + eps) + weight_decay * w`) and clamps the ratio to
  `[min_coeff, max_coeff]` (defaults 0.01 and 10); Keras's Lamb does neither.

Both are ordinary Keras optimizers (`get_config` holds the extra settings), so the
engine's per-lane and per-shard copies keep them. `deepspeed_run.build_optimizer` makes
them from the `OptimizerSpec` a DeepSpeed config translates to.
"""

from __future__ import annotations

import functools

import keras
import tensorflow as tf
from keras import ops


def _plus_l2(optimizer, gradient, variable):
    if not optimizer.l2_weight_decay or not optimizer._use_weight_decay(variable):
        return gradient
    gradient = tf.convert_to_tensor(gradient)  # an Embedding's rows become a dense table
    decay = ops.cast(optimizer.l2_weight_decay, variable.dtype)
    return ops.add(ops.cast(gradient, variable.dtype), ops.multiply(decay, variable))


@functools.cache
def with_l2(cls: type) -> type:
    """`cls` (a Keras optimizer class) with PyTorch's coupled weight decay,
    `l2_weight_decay`: gradient += l2_weight_decay * w."""

    class CoupledWeightDecay(cls):
        def __init__(self, *args, l2_weight_decay: float = 0.0, **kwargs):
            super().__init__(*args, **kwargs)
            self.l2_weight_decay = float(l2_weight_decay)

        def update_step(self, gradient, variable, learning_rate):
            gradient = _plus_l2(self, gradient, variable)
            return super().update_step(gradient, variable, learning_rate)

        def get_config(self):
            return {**super().get_config(), "l2_weight_decay": self.l2_weight_decay}

    CoupledWeightDecay.__name__ = CoupledWeightDecay.__qualname__ = f"{cls.__name__}WithL2"
    return CoupledWeightDecay


class FusedLamb(keras.optimizers.Lamb):
    """Keras's Lamb with DeepSpeed's FusedLamb rule: `lamb_weight_decay` inside the
    trust ratio, and the ratio clamped to `[min_coeff, max_coeff]`.

    For each variable w: update = m_hat / (sqrt(v_hat) + epsilon) + lamb_weight_decay *
    w; coefficient = |w| / |update| (1 when either norm is 0), clamped; w -= lr *
    coefficient * update.
    """

    def __init__(
        self,
        *args,
        lamb_weight_decay: float = 0.0,
        min_coeff: float = 0.01,
        max_coeff: float = 10.0,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(
                "FusedLamb needs 0 <= min_coeff <= max_coeff. "
                f"Received: min_coeff={min_coeff}, max_coeff={max_coeff}"
            )
        self.lamb_weight_decay = float(lamb_weight_decay)
        self.min_coeff, self.max_coeff = float(min_coeff), float(max_coeff)

    def update_step(self, gradient, variable, learning_rate):
        dtype = variable.dtype
        lr = ops.cast(learning_rate, dtype)
        gradient = ops.cast(gradient, dtype)
        step = ops.cast(self.iterations + 1, dtype)
        beta_1_power = ops.power(ops.cast(self.beta_1, dtype), step)
        beta_2_power = ops.power(ops.cast(self.beta_2, dtype), step)
        m = self._momentums[self._get_variable_index(variable)]
        v = self._velocities[self._get_variable_index(variable)]
        self.assign_add(m, ops.multiply(ops.subtract(gradient, m), 1 - self.beta_1))
        self.assign_add(v, ops.multiply(ops.subtract(ops.square(gradient), v), 1 - self.beta_2))
        m_hat = ops.divide(m, 1.0 - beta_1_power)
        denominator = ops.add(ops.sqrt(ops.divide(v, 1.0 - beta_2_power)), self.epsilon)
        update = ops.divide(m_hat, denominator)
        if self.lamb_weight_decay and self._use_weight_decay(variable):
            update = ops.add(
                update, ops.multiply(ops.cast(self.lamb_weight_decay, dtype), variable)
            )
        w_norm = ops.sqrt(ops.sum(ops.square(variable)))
        u_norm = ops.sqrt(ops.sum(ops.square(update)))
        both = ops.logical_and(ops.greater(w_norm, 0), ops.greater(u_norm, 0))
        ratio = ops.where(both, w_norm / ops.where(both, u_norm, 1.0), 1.0)
        ratio = ops.clip(ratio, self.min_coeff, self.max_coeff)
        self.assign_sub(variable, ratio * lr * update)

    def get_config(self):
        return {
            **super().get_config(),
            "lamb_weight_decay": self.lamb_weight_decay,
            "min_coeff": self.min_coeff,
            "max_coeff": self.max_coeff,
        }
