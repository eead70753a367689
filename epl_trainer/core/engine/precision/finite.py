"""Passes that apply the update only when every lane's gradients are finite.

Both wrap the update hook the same way. The reduction runs first, unconditionally, so
its collectives start as soon as backward produces each bucket and never wait for a
global flag; finiteness is then decided from the *reduced* gradients
(`finite_everywhere`). In data parallelism every lane holds the same reduced gradients
and decides alone, with no extra collective; where lanes hold different shards (ZeRO,
split layers) one scalar all-reduce makes the decision global. Only the optimizers'
apply sits inside the conditional: every lane and worker applies or skips together.

* `apply_nonfinite_guard` (no AMP): a non-finite step is skipped and counted; the
  trainer stops or warns as `optimizer.nonfinite_loss` says.
* `apply_amp` (`amp.level="O1"`): loss scaling around the update (DeepSpeed's dynamic
  scaler or a fixed one): the objective is scaled, local gradients unscaled, and the
  scaler updated from the decision.
"""

from __future__ import annotations

import tensorflow as tf

from epl_trainer.core.engine.hooks import StepHooks
from epl_trainer.core.engine.layout import StepLayout
from epl_trainer.core.engine.precision import amp


def finite_everywhere(layout: StepLayout, update, reduced) -> tf.Tensor:
    """A scalar bool: the reduced gradients of every local and remote lane are finite.

    Args:
      update: the update whose `reduce` made `reduced` (its `reduced_agree` and
        `reduced_of_lane` say how the lanes' shares relate).
      reduced: what `update.reduce` returned.
    """
    flags = []
    for li, lane in enumerate(layout.lanes):
        with tf.device(lane.devices[layout.local_stages(li)[0]]):
            flags.append(tf.cast(amp.all_finite(update.reduced_of_lane(reduced, li)), tf.float32))
            if update.reduced_agree and not layout.spans_workers:
                return flags[0] > 0  # every lane holds the same gradients: one decides
    everyone = layout.everyone
    if layout.spans_workers:
        # A lane here holds only its local stages' gradients: the workers decide together,
        # each member of `everyone` (a local stage device) voting this worker's flags.
        with tf.device(layout.host):
            local = tf.reduce_min(tf.stack(flags))
        votes = []
        for device in everyone.local_devices:
            with tf.device(device):
                votes.append(tf.identity(local))
        return everyone.all_reduce(votes, "sum")[0] >= everyone.size
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
        reduced = inner.reduce(lane_grads)
        finite = finite_everywhere(layout, inner, reduced)
        applied = amp.apply_if_finite(finite, lambda: inner.apply(reduced))
        with tf.control_dependencies([applied]):
            inner.finish()
        with tf.device(layout.host):
            count.assign_add(tf.cast(tf.logical_not(applied), tf.int64))

    if skip_metrics:
        update_metrics = hooks.update_metrics

        def update_finite_metrics(labels, y_pred, loss, *weighing) -> None:
            def update():
                update_metrics(labels, y_pred, loss, *weighing)
                return tf.constant(True)

            if loss is None:  # reported once for the step (objective.py's data divisor)
                update()
                return
            with tf.device(layout.host):
                finite = tf.reduce_all(tf.math.is_finite(loss))
            tf.cond(finite, update, lambda: tf.constant(False))

        hooks.update_metrics = update_finite_metrics
    hooks.extra_logs["nonfinite_steps"] = count.value
    if not skip_metrics:
        hooks.stopping_steps = count.value
    hooks.update = GuardedUpdate(inner, update_if_finite)


def apply_amp(
    hooks: StepHooks, layout: StepLayout, amp_config, stop_on_nonfinite: bool = True
) -> None:
    """Loss scaling around the update (the model itself was switched to a mixed dtype
    policy before the state was created, see `amp.apply_mixed_precision`).

    `stop_on_nonfinite`: a fixed scale's skipped step stops training
    (`optimizer.nonfinite_loss="raise"`); a dynamic scaler's never does."""
    scaler = amp.make_loss_scaler(amp_config, layout.host)
    hooks.loss_scale = scaler.scale
    if hooks.gradient_sink is not None:  # gradients reduced per micro-batch: unscaled after
        hooks.gradient_sink.scale = scaler.scale
    hooks.output_cast = amp.float32_outputs
    hooks.extra_logs.update(
        loss_scale=scaler.scale, skipped_steps=lambda: scaler.skipped_steps.value()
    )
    if isinstance(scaler, amp.FixedLossScaler):
        # A fixed scale (bfloat16, or a number) never recovers from a non-finite step: it
        # would skip every following step in silence. The trainer reads this count and
        # stops or warns as optimizer.nonfinite_loss says, as it does without AMP.
        hooks.extra_logs["nonfinite_steps"] = lambda: scaler.skipped_steps.value()
        if stop_on_nonfinite:
            hooks.stopping_steps = lambda: scaler.skipped_steps.value()
    inner = hooks.update

    def update_if_finite(lane_grads: list[list]) -> None:
        scale = scaler.scale()
        # Unscaled before the reduction: clipping before it needs the true norm.
        lane_grads = [amp.unscale_gradients(grads, scale) for grads in lane_grads]
        reduced = inner.reduce(lane_grads)
        finite = finite_everywhere(layout, inner, reduced)
        applied = amp.apply_if_finite(finite, lambda: inner.apply(reduced))
        with tf.control_dependencies([applied]):
            inner.finish()
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
