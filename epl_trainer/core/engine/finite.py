"""Passes that apply the update only when every lane's gradients are finite.

Both wrap the update hook the same way: each lane checks its own gradients, one scalar
all-reduce over every lane of the job makes the decision global (`finite_everywhere`),
and the whole update, collectives included, runs or is skipped on every lane and
worker alike.

* `apply_nonfinite_guard` (no AMP): a non-finite step is skipped and counted; the
  trainer stops or warns as `optimizer.nonfinite_loss` says.
* `apply_amp` (`amp.level="O1"`): loss scaling around the update (DeepSpeed's dynamic
  scaler or a fixed one): the objective is scaled, local gradients unscaled, and the
  scaler updated from the decision.
"""

from __future__ import annotations

import tensorflow as tf

from epl_trainer.core.engine import amp
from epl_trainer.core.engine.hooks import StepHooks
from epl_trainer.core.engine.layout import StepLayout


def finite_everywhere(layout: StepLayout, lane_grads: list[list]) -> tf.Tensor:
    """A scalar bool: every local and remote lane's gradients are all finite."""
    flags = []
    for lane, grads in zip(layout.lanes, lane_grads):
        with tf.device(lane.devices[0]):
            flags.append(tf.cast(amp.all_finite(grads), tf.float32))
    everyone = layout.everyone
    return everyone.all_reduce(flags, "sum")[0] >= everyone.size


def apply_nonfinite_guard(hooks: StepHooks, layout: StepLayout, skip_metrics: bool) -> None:
    """Without AMP: a step whose gradients are not finite is skipped everywhere and counted.

    A NaN or Inf loss gives non-finite gradients, and applying them would destroy the
    weights and the optimizer state. The trainer reads the `nonfinite_steps` log after
    each step and stops with an error naming the step, or warns and goes on
    (`optimizer.nonfinite_loss`); when it goes on (`skip_metrics`), non-finite
    micro-batch losses are also left out of the running metrics, so one bad batch does
    not turn the epoch's loss into NaN.
    """
    with tf.init_scope(), tf.device(layout.host):
        count = tf.Variable(0, dtype=tf.int64, trainable=False, name="nonfinite_steps")
    inner = hooks.update

    def update_if_finite(lane_grads: list[list]) -> None:
        applied = amp.apply_if_finite(
            finite_everywhere(layout, lane_grads), lambda: inner(lane_grads)
        )
        with tf.device(layout.host):
            count.assign_add(tf.cast(tf.logical_not(applied), tf.int64))

    if skip_metrics:
        update_metrics = hooks.update_metrics

        def update_finite_metrics(labels, y_pred, loss) -> None:
            def update():
                update_metrics(labels, y_pred, loss)
                return tf.constant(True)

            with tf.device(layout.host):
                finite = tf.reduce_all(tf.math.is_finite(loss))
            tf.cond(finite, update, lambda: tf.constant(False))

        hooks.update_metrics = update_finite_metrics
    hooks.extra_logs["nonfinite_steps"] = count.value
    hooks.update = GuardedUpdate(inner, update_if_finite)


def apply_amp(hooks: StepHooks, layout: StepLayout, amp_config) -> None:
    """Loss scaling around the update (the model itself was switched to a mixed dtype
    policy before the state was created, see `amp.apply_mixed_precision`)."""
    scaler = amp.make_loss_scaler(amp_config, layout.host)
    hooks.loss_scale = scaler.scale
    hooks.output_cast = amp.float32_outputs
    hooks.extra_logs.update(
        loss_scale=scaler.scale, skipped_steps=lambda: scaler.skipped_steps.value()
    )
    if isinstance(scaler, amp.FixedLossScaler):
        # A fixed scale (bfloat16, or a number) never recovers from a non-finite step: it
        # would skip every following step in silence. The trainer reads this count and
        # stops or warns as optimizer.nonfinite_loss says, as it does without AMP.
        hooks.extra_logs["nonfinite_steps"] = lambda: scaler.skipped_steps.value()
    inner = hooks.update

    def update_if_finite(lane_grads: list[list]) -> None:
        scale = scaler.scale()
        lane_grads = [amp.unscale_gradients(grads, scale) for grads in lane_grads]
        finite = finite_everywhere(layout, lane_grads)
        amp.apply_if_finite(finite, lambda: inner(lane_grads))
        scaler.update(finite)

    hooks.update = AmpUpdate(inner, update_if_finite, scaler)


class GuardedUpdate:
    """An update wrapped by a finiteness check: same interface and state as `inner`."""

    def __init__(self, inner, call):
        self.inner, self._call = inner, call

    def __call__(self, lane_grads) -> None:
        self._call(lane_grads)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class AmpUpdate(GuardedUpdate):
    """An update wrapped by loss scaling: same interface, plus the scaler's state."""

    def __init__(self, inner, call, scaler):
        super().__init__(inner, call)
        self.scaler = scaler

    def checkpoint_variables(self) -> dict:
        named = dict(self.inner.checkpoint_variables())
        named.update({f"amp/{i}": v for i, v in enumerate(self.scaler.variables)})
        return named
