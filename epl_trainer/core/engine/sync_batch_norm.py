"""Synchronized BatchNorm: batch statistics over every data-parallel replica.

Switched on for every `keras.layers.BatchNormalization` by `batch_norm.synchronized=True`,
or per layer by Keras's own `BatchNormalization(synchronized=True)`. (Keras's TensorFlow
backend synchronizes through `tf.distribute`'s replica context, which this engine does
not use: without this pass such a layer normalises over its lane's rows.)

What is normalised over: in training, micro-batch j of every lane of the job (every
replica of the layer's stage, on this worker and on the others) together, i.e. the rows
that one single-device Keras step on micro-batch j of the global batch would see. Rows
added to fill an odd batch do not count (they have weight 0 in the micro-batch's mask),
nor do positions masked by a Keras mask.

How: while a lane's forward of (stage, micro-batch) is traced, each synchronized layer's
batch moments (`BatchNormalization._moments`; Keras has no public seam for them) are
computed in two passes, as `tf.nn.moments` computes them on one device: (1) the sum
and count of the lane's rows, summed over the stage's group -> the mean; (2) the sum of
squared deviations from that mean, summed over the group -> the variance. Each sum is an
all-reduce whose gradient is the all-reduce of the upstream gradients, so every lane's
rows receive the gradient of the global batch's loss through the shared statistics.
The statistics stay float32 under AMP (Keras computes BatchNorm in float32). With
gradient checkpointing, the recomputed forward reuses the forward's reduced sums (the
statistics are identical, no collective runs twice) and keeps their gradient.

Keys: the collectives of lane li are created while lane li's tasks are traced, at other
points of the program than its peers'. They meet because each one's instance key is
chosen by what it is (stage, micro-batch, layer, call, pass, forward / backward), the
first lane to reach it allocating the key with `comm.next_instance_key`; every worker
traces the same program, so the keys agree across workers too.
"""

from __future__ import annotations

import contextlib
import dataclasses

import keras
import tensorflow as tf

from epl_trainer.core import comm
from epl_trainer.core.engine.hooks import LocalBatchStatistics, StepHooks
from epl_trainer.core.engine.layout import StepLayout
from epl_trainer.core.plan import rules


def synchronized_layers(model, synchronize_all: bool) -> list:
    """The BatchNormalization layers of `model` that normalise over every replica:
    all of them with `batch_norm.synchronized`, else those built with
    `synchronized=True`."""
    return [
        layer
        for layer in model._flatten_layers()
        if isinstance(layer, keras.layers.BatchNormalization)
        and (synchronize_all or getattr(layer, "synchronized", False))
    ]


def check_sync_batch_norm(model, synchronize_all: bool, jit_compile: bool, split: bool) -> None:
    """Refuses settings under which batch statistics cannot be reduced inside the forward.

    Raises:
      ValueError: synchronized BatchNorm with jit_compile=True (XLA compiles a stage
        whole and cannot run the collectives inside it on every device) or with split
        layers.
    """
    layers = synchronized_layers(model, synchronize_all)
    if not layers:
        return
    how = "batch_norm.synchronized=True" if synchronize_all else (
        f"BatchNormalization(synchronized=True) layers {[la.name for la in layers]}")  # fmt: skip
    rules.check_sync_batch_norm(how, jit_compile, split)


def apply_sync_batch_norm(hooks: StepHooks, layout: StepLayout, synchronize_all: bool) -> None:
    """The batch-statistics pass: fills `hooks.batch_statistics` when the model has a
    synchronized layer (`SyncBatchNorm`), else when it has BatchNormalization layers
    (`RealRowBatchNorm`: each lane's real rows); nothing changes otherwise."""
    layers = [synchronized_layers(stage.model, synchronize_all) for stage in layout.staged.stages]
    if not any(layers):
        local = [synchronized_layers(stage.model, True) for stage in layout.staged.stages]
        if any(local):
            hooks.batch_statistics = RealRowBatchNorm(local)
        return
    hooks.batch_statistics = SyncBatchNorm(layout, layers)
    # Its collectives' keys and the statistics a recompute reuses are found by the
    # micro-batch's index while tracing; in a loop over micro-batches it is a tensor.
    hooks.micro_batch_loop = False
    # Lane li's forward waits at each layer for every other lane's same forward: the
    # lanes' tasks are emitted together, so that nothing TF runs in program order (the
    # asserts of cross-worker transfers) makes lane li's next task wait for a later one.
    hooks.lanes_in_lockstep = True


class RealRowBatchNorm(LocalBatchStatistics):
    """`StepHooks.batch_statistics` of BatchNorm that is not synchronized: each lane's
    layers normalise over the lane's rows, as before, but only its real ones. Rows added
    to fill an odd batch (copies with weight 0) would otherwise enter the batch moments,
    so the normalisation of the real rows and the moving statistics. A micro-batch with no
    real row leaves the moving statistics where they are.

    Args:
      layers: per stage, its BatchNormalization layers.
    """

    def __init__(self, layers: list[list]):
        self.layers = layers
        self._open_masks: dict = {}  # stage -> the row mask of its open context

    def forward(self, li: int, stage: int, micro_batch, mask):
        return self._installed(stage, mask)

    def backward(self, li: int, stage: int, micro_batch, mask):
        return self._installed(stage, mask)  # a recomputed forward: the same moments

    def traced_mask(self, stage: int):
        return self._open_masks.get(stage) if self.layers[stage] else None

    def installed_mask(self, stage: int, mask):
        return self._installed(stage, mask)

    @contextlib.contextmanager
    def _installed(self, stage: int, row_mask):
        layers = self.layers[stage] if row_mask is not None else []
        # A compiled stage installs its own mask inside the context its caller opened:
        # on leaving, the caller's comes back.
        previous = [layer.__dict__.get("_moments") for layer in layers]
        previous_mask = self._open_masks.get(stage)
        try:
            self._open_masks[stage] = row_mask
            for layer in layers:
                object.__setattr__(layer, "_moments", _real_row_moments(layer, row_mask))
            yield
        finally:
            self._open_masks[stage] = previous_mask
            for layer, moments in zip(layers, previous):
                if moments is not None:
                    object.__setattr__(layer, "_moments", moments)
                elif "_moments" in layer.__dict__:
                    object.__delattr__(layer, "_moments")


def _real_row_moments(layer, row_mask):
    """Keras's `_moments(inputs, mask)` for `layer` over the rows where `row_mask` is 1."""

    def moments(inputs, mask=None):
        weights = _row_weights(layer, inputs, row_mask, mask)
        return _weighted_moments(layer, inputs, weights, lambda name, value: value)

    return moments


def _weighted_moments(layer, x, weights, summed):
    """Mean and variance of `x` over `layer`'s reduction axes, each value counted by
    `weights` (None: all), as `tf.nn.moments` computes them; `summed(name, value)` reduces
    the sums over the rows of other lanes ("sum": sums and counts, "squares": squared
    deviations), or returns them for one lane. Shaped like Keras's own `_moments`."""
    axes = list(layer._reduction_axes)
    keep = [1 if i in axes else x.shape[i] for i in range(len(x.shape))]
    if weights is None:
        sums = tf.reduce_sum(x, axes)
        count = tf.fill(tf.shape(sums), tf.cast(tf.size(x), x.dtype)
                        / tf.cast(tf.size(sums), x.dtype))  # fmt: skip
    else:
        sums = tf.reduce_sum(x * weights, axes)
        count = tf.reduce_sum(tf.broadcast_to(weights, tf.shape(x)), axes)
    channels = int(sums.shape[0])
    totals = summed("sum", tf.concat([sums, count], axis=0))
    total_sum, total_count = totals[:channels], totals[channels:]
    mean = tf.math.divide_no_nan(total_sum, total_count)
    # As tf.nn.moments: deviations from the mean without its gradient (which is 0).
    deviations = tf.square(x - tf.reshape(tf.stop_gradient(mean), keep))
    if weights is not None:
        deviations = deviations * weights
    squares = summed("squares", tf.reduce_sum(deviations, axes))
    variance = tf.math.divide_no_nan(squares, total_count)
    if weights is not None:
        # A micro-batch without a real row (filling up a tiny batch) keeps the moving
        # statistics where they are, as if it did not exist.
        seen = total_count > 0
        mean = tf.where(seen, mean, keras.ops.cast(layer.moving_mean, mean.dtype))
        variance = tf.where(seen, variance, keras.ops.cast(layer.moving_variance, mean.dtype))
    return mean, variance


@dataclasses.dataclass
class _Pass:
    """One lane's forward (or backward, for a recomputed forward) of one (stage,
    micro-batch)."""

    lane: int
    stage: int
    micro_batch: int
    mask: tf.Tensor | None
    replay: bool  # a recomputed forward: reuse the forward's reduced sums
    calls: dict = dataclasses.field(default_factory=dict)  # layer position -> calls so far


class SyncBatchNorm(LocalBatchStatistics):
    """`StepHooks.batch_statistics` of synchronized BatchNorm.

    Args:
      layout: the step's layout (each stage's collective group, the lanes' devices).
      layers: per stage, its synchronized BatchNormalization layers.
    """

    def __init__(self, layout: StepLayout, layers: list[list]):
        self.layout = layout
        self.layers = layers
        self._keys: dict[tuple, int] = {}
        self._saved: dict[tuple, tf.Tensor] = {}  # forward's reduced sums, for a recompute
        self._calls: dict[tuple, int] = {}  # (lane, stage, micro-batch, layer) -> calls

    def begin_trace(self) -> None:
        self._keys.clear()
        self._saved.clear()
        self._calls.clear()

    def forward(self, li: int, stage: int, micro_batch, mask):
        return self._installed(_Pass(li, stage, micro_batch, mask, replay=False))

    def backward(self, li: int, stage: int, micro_batch, mask):
        return self._installed(_Pass(li, stage, micro_batch, mask, replay=True))

    @contextlib.contextmanager
    def _installed(self, run: _Pass):
        layers = self.layers[run.stage]
        if layers and run.micro_batch is None:
            raise AssertionError("synchronized BatchNorm needs unrolled micro-batches")
        try:
            for position, layer in enumerate(layers):
                moments = self._moments_of(run, position, layer)
                # The same seam split.py uses for a layer's call: an instance attribute
                # while this lane's forward is traced, removed right after.
                object.__setattr__(layer, "_moments", moments)
            yield
        finally:
            for layer in layers:
                if "_moments" in layer.__dict__:
                    object.__delattr__(layer, "_moments")

    def _moments_of(self, run: _Pass, position: int, layer):
        def moments(inputs, mask=None):
            call = run.calls.get(position, 0)
            run.calls[position] = call + 1
            slot = (run.stage, run.micro_batch, position, call)
            if not run.replay:
                self._calls[(run.lane, *slot[:3])] = call + 1
            elif self._calls.get((run.lane, *slot[:3]), 0) > 1:
                raise ValueError(
                    f"Synchronized BatchNormalization {layer.name!r} is called "
                    f"{self._calls[(run.lane, *slot[:3])]} times in one forward of stage "
                    f"{run.stage}; with gradient checkpointing each synchronized layer must "
                    "be called once per forward. Received: a recomputed call"
                )
            return self._global_moments(run, slot, layer, inputs, mask)

        return moments

    def _global_moments(self, run: _Pass, slot: tuple, layer, x, keras_mask):
        """Mean and variance over the (stage, micro-batch)'s rows of every lane, shaped
        like Keras's own `_moments` (one value per channel)."""
        weights = _row_weights(layer, x, run.mask, keras_mask)
        return _weighted_moments(
            layer, x, weights, lambda name, value: self._summed(run, (*slot, name), value)
        )

    def _summed(self, run: _Pass, slot: tuple, local):
        """`local` summed over the lanes of the stage's group (differentiable: the
        gradient is the sum of the lanes' upstream gradients)."""
        group = self.layout.stage_groups[run.stage]
        if group.size == 1:
            return local
        device = self.layout.lanes[run.lane].devices[run.stage]
        member = comm.CollectiveGroup(group.devices, (device,))
        saved_at = (run.lane, *slot)
        saved = self._saved.get(saved_at) if run.replay else None
        if run.replay and saved is None:
            raise AssertionError(f"no forward statistics for a recomputed forward: {slot}")

        @tf.custom_gradient
        def summed(value):
            if saved is None:
                total = member.all_reduce([value], "sum", self._key(group, (*slot, "F")))[0]
            else:
                total = tf.identity(saved)

            def grad(upstream):
                key = self._key(group, (*slot, "B"))
                return member.all_reduce([upstream], "sum", key)[0]

            return total, grad

        with tf.device(device):
            total = summed(local)
        if not run.replay:
            self._saved[saved_at] = tf.stop_gradient(total)
        return total

    def _key(self, group, name: tuple) -> int:
        if name not in self._keys:
            self._keys[name] = comm.next_instance_key(group.key)
        return self._keys[name]


def _row_weights(layer, x, row_mask, keras_mask):
    """1 where a value counts, broadcastable to `x` (None: all count): the micro-batch's
    real rows times Keras's mask (expanded over channels, as Keras's `_moments` does)."""
    weights = None
    if row_mask is not None:
        rows, mask_rows = x.shape[0], row_mask.shape[0]
        if rows is not None and mask_rows is not None and rows != mask_rows:
            raise ValueError(
                f"Synchronized BatchNormalization {layer.name!r} normalises rows of its "
                "micro-batch and must see them on its input's first axis. Received: input "
                f"shape {x.shape}, {mask_rows} rows in the micro-batch"
            )
        weights = tf.reshape(tf.cast(row_mask, x.dtype), [-1] + [1] * (len(x.shape) - 1))
    if keras_mask is not None:
        expanded = tf.cast(tf.expand_dims(keras_mask, -1), x.dtype)
        weights = expanded if weights is None else weights * expanded
    return weights
