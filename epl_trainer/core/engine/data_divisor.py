"""The gradients' correction when a loss's divisor is known only from the data.

A masked loss, or one with reduction "mean_with_sample_weight", divides by a number of
rows (or a weight sum) that each micro-batch knows only for itself; objective.py scales
each micro-batch's gradients by an estimate of the global divisor, and this pass
replaces the estimate by the true value once every lane has reported its share.
"""

from __future__ import annotations

import tensorflow as tf

from epl_trainer.core.engine.hooks import StepHooks
from epl_trainer.core.engine.layout import StepLayout
from epl_trainer.core.engine.update import scaled


def correct_data_divisor(
    layout: StepLayout,
    hooks: StepHooks,
    loss_tracker,
    lane_grads: list[list],
    data_shares: list,
    rows,
) -> list[list]:
    """Multiplies the gradients by (the global divisor they were scaled by) / (the true
    one) when the loss's divisor depends on the data (a mask, or
    "mean_with_sample_weight"; objective.py), and reports the step's loss (the
    global weighted sum / the global divisor): one all-reduce of four scalars over
    every lane of the job (divisor, loss sum, estimate, count).

    Args:
      data_shares: (lane, [divisor, weighted loss sum], estimated global divisor) of
        every micro-batch whose loss has a data divisor.
      rows: the step's real rows (the reported loss's weight).
    """
    everyone = layout.everyone
    by_lane: dict[int, list] = {}
    for li, share, estimate in data_shares:
        by_lane.setdefault(li, []).append((share, estimate))
    # `everyone` has one member per local lane (its first stage), or, when lanes span
    # workers, one per local stage of each lane: the last stage's member contributes.
    last = layout.num_stages - 1
    if layout.spans_workers:  # a device hosting several stages is one member
        by_device: dict = {}
        for k in range(layout.num_stages):
            for li in layout.stage_lanes[k]:
                device = layout.lanes[li].devices[k]
                by_device[device] = (li, by_device.get(device, (li, False))[1] or k == last)
        roles = [by_device[device] for device in everyone.local_devices]
    else:
        roles = [(li, True) for li in layout.stage_lanes[0]]
    members = []
    for device, (li, contributes) in zip(everyone.local_devices, roles):
        with tf.device(device):
            if contributes and li in by_lane:
                share = tf.add_n([s for s, _ in by_lane[li]])
                estimate = tf.cast(by_lane[li][0][1], tf.float32)
                members.append(tf.concat([share, [estimate, 1.0]], axis=0))
            else:
                members.append(tf.zeros([4]))
    total = everyone.all_reduce(members, "sum")[0]
    with tf.device(layout.host):
        divisor, loss_sum, estimate, count = tf.unstack(total)
        factor = tf.math.divide_no_nan(estimate / tf.maximum(count, 1.0), divisor)
        loss_tracker.update_state(tf.math.divide_no_nan(loss_sum, divisor), rows)
    if hooks.gradient_sink is not None:  # reduced per micro-batch: corrected after it
        hooks.gradient_sink.correction = factor
    return [[None if g is None else scaled(g, factor) for g in grads] for grads in lane_grads]
