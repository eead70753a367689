"""One-batch loss semantics: the gradient of a step is the single-device gradient of
the global batch, however the batch is cut into micro-batches, lanes and workers.

Keras reduces a batch's loss as `sum(weight * loss) / divisor`, where the divisor is
the number of loss elements ("sum_over_batch_size"), the number of unmasked elements
(a mask on the predictions, e.g. behind `Embedding(mask_zero=True)`), the sum of the
sample weights ("mean_with_sample_weight"), or 1 ("sum"). A mean of the micro-batches'
own means equals that only for unweighted, unmasked per-sample means. So each
micro-batch contributes its weighted *sum* (`LossTerm.total`), and is divided once by
the global batch's divisor:

* a per-row divisor (elements, no mask) follows from the global row count, known when
  the step starts: each micro-batch's objective is `total * lanes / (elements per row *
  real rows)`, so after the gradients are averaged over the lanes of the job (the
  reduction's "mean") the step's gradient is `sum(grad total) / global divisor`;
* "sum" has no divisor: `total * lanes`, and the average over lanes is the sum;
* a data-dependent divisor (a mask, or "mean_with_sample_weight") is known only after
  every micro-batch's forward: its micro-batches are first scaled as if unmasked, and
  the gradients are corrected by one factor once the global divisor is known
  (`DataDivisor`).

Rows added to fill an odd batch (`pad_to_multiple`) carry weight 0, and the row count
is the real one, so they change neither the sum nor the divisor.
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf
from keras import tree

# Not exported by keras.losses; what `Loss.__call__` itself uses to merge masks and weights.
from keras.src.backend import get_keras_mask
from keras.src.losses.loss import apply_mask, squeeze_or_expand_to_same_rank

PER_ROW, SUM, DATA = "per_row", "sum", "data"
# Keras's error for a step with neither a compiled loss nor an `add_loss` loss.
NO_LOSS_MESSAGE = "No loss to compute. Provide a `loss` argument in `compile()`."


@dataclasses.dataclass
class LossTerm:
    """One output's loss on one micro-batch, before the division by the batch's divisor.

    Attributes:
      total: sum of weight * loss over the micro-batch, times the output's loss weight.
      divisor: Keras's divisor on this micro-batch (elements, unmasked elements, weight
        sum; 1 for "sum").
      kind: PER_ROW (elements: the same per row in every micro-batch), SUM, or DATA
        (unmasked elements or weight sums: known only from the data).
      elements: loss elements on this micro-batch (padding included).
      unweighted: `total` before the output's loss weight (None: the same), what Keras
        reports as the output's own loss (`<output>_loss`).
    """

    total: tf.Tensor
    divisor: tf.Tensor
    kind: str
    elements: tf.Tensor
    unweighted: tf.Tensor | None = None


def keras_loss_term(
    loss: keras.losses.Loss, y_true, y_pred, sample_weight, loss_weight=1.0, real_rows=None
):
    """`loss(y_true, y_pred, sample_weight)` as a `LossTerm` (Keras's `Loss.__call__`,
    with the reduction's sum and divisor kept apart). A Loss that overrides `__call__`
    itself is called as Keras calls it (`called_loss_term`).

    Args:
      real_rows: None, or the rows of the batch before the rows added to fill it (which
        follow them): only a Loss overriding `__call__` needs it.
    """
    if overrides_call(loss):
        return called_loss_term(loss, y_true, y_pred, sample_weight, loss_weight, real_rows)
    reduction = loss.reduction
    if reduction in (None, "none"):
        raise ValueError(
            f"Loss {loss.name!r} has reduction={reduction!r}: the trainer needs a scalar loss "
            "per batch. Use 'sum_over_batch_size' (Keras's default), 'sum', 'mean' or "
            "'mean_with_sample_weight'."
        )
    in_mask = get_keras_mask(y_pred)
    convert = keras.ops.convert_to_tensor  # casts, as Keras's `Loss.__call__` does
    y_pred = tree.map_structure(lambda x: convert(x, dtype=loss.dtype), y_pred)
    y_true = tree.map_structure(lambda x: convert(x, dtype=loss.dtype), y_true)
    values = convert(loss.call(y_true, y_pred), dtype=loss.dtype)
    out_mask = get_keras_mask(values)
    masks = [m for m in (in_mask, out_mask) if m is not None]
    mask = None
    if masks:
        mask = masks[0] if len(masks) == 1 else tf.logical_and(*masks)
    if sample_weight is not None:
        sample_weight = convert(sample_weight, dtype=loss.dtype)
        rank = values.shape.rank
        if sample_weight.shape.rank == 1 and rank is not None and rank > 1:
            # A weight per row applies to each of the row's loss elements (per token).
            sample_weight = tf.reshape(sample_weight, [-1] + [1] * (rank - 1))
    # "sum" merges mask and weights without Keras's total/valid rescaling of the mask.
    weights = apply_mask(sample_weight, mask, dtype=values.dtype, reduction="sum")
    if weights is not None:
        values, weights = squeeze_or_expand_to_same_rank(values, tf.cast(weights, values.dtype))
        values = values * weights
    total = tf.reduce_sum(values)
    if reduction == "sum" or values.shape.rank == 0:
        divisor, kind = tf.ones([], total.dtype), SUM
    elif reduction == "mean_with_sample_weight" and weights is not None:
        divisor, kind = tf.reduce_sum(weights), DATA
    elif mask is not None:
        divisor, kind = tf.reduce_sum(tf.cast(mask, total.dtype)), DATA
    else:
        divisor, kind = tf.cast(tf.size(values), total.dtype), PER_ROW
    unweighted = total
    if loss_weight != 1.0:
        total = total * loss_weight
    elements = tf.cast(tf.size(values), total.dtype)
    return LossTerm(total, divisor, kind, elements, unweighted)


def overrides_call(loss) -> bool:
    """A Keras Loss whose class replaces `Loss.__call__` (its `call` may not exist)."""
    return isinstance(loss, keras.losses.Loss) and (
        type(loss).__call__ is not keras.losses.Loss.__call__
    )


def called_loss_term(
    loss, y_true, y_pred, sample_weight, loss_weight=1.0, real_rows=None
) -> LossTerm:
    """A Loss overriding `__call__`, called as Keras calls it: `loss(y_true, y_pred,
    sample_weight)`. Its (sum, divisor) split is not visible, so the value is read by the
    loss's `reduction`: "sum" is a sum over the rows given (a SUM term), anything else a
    mean over them (a PER_ROW term: value x rows is their sum). It is called on the real
    rows only (`real_rows`): rows added to fill an odd batch carry weight 0, which a
    `__call__` that ignores sample weights would still count.

    Raises:
      ValueError: `reduction` None / "none" (a loss per element, not a batch's scalar).
    """
    if loss.reduction in (None, "none"):
        raise ValueError(
            f"Loss {loss.name!r} overrides __call__ and has reduction={loss.reduction!r}: the "
            "trainer cannot tell how its value sums over rows. Give it reduction 'sum' or "
            "'sum_over_batch_size', or implement `call` (per-element losses) instead of "
            "`__call__`."
        )
    padded = tf.cast(tf.shape(tree.flatten(y_pred)[0])[0], tf.float32)
    if real_rows is not None:
        y_true, y_pred, sample_weight = tree.map_structure(
            lambda x: x if x is None else x[:real_rows], (y_true, y_pred, sample_weight)
        )
    rows = padded if real_rows is None else tf.cast(real_rows, tf.float32)
    value = tf.reshape(tf.cast(loss(y_true, y_pred, sample_weight=sample_weight), tf.float32), [])
    if loss.reduction == "sum":
        total, divisor, kind = value, tf.ones([], value.dtype), SUM
    else:  # a mean over the real rows: one element per row (padding included), as any
        total, divisor, kind = value * rows, padded, PER_ROW  # PER_ROW term counts them
    return LossTerm(total * loss_weight, divisor, kind, padded, total)


@dataclasses.dataclass
class StepRows:
    """What one step's objective is normalised by, known when the step starts.

    Attributes:
      real_rows: rows of this worker's batch before padding (float32 scalar).
      lanes: lanes of the job the gradient reduction averages over.
      data_shards: workers reading different batches (the global batch is this many
        worker batches).
      single: the step is one micro-batch on one lane of one worker: a data-dependent
        divisor is then known where the loss is computed.
      agreed_rows: the global batch's rows when the workers agreed on them before the
        step (float32 scalar; their batches may differ: an uneven last batch), or None:
        every shard's batch has `real_rows`.
    """

    real_rows: tf.Tensor
    lanes: int
    data_shards: int
    single: bool = False
    agreed_rows: tf.Tensor | None = None

    @property
    def global_rows(self) -> tf.Tensor:
        if self.agreed_rows is not None:
            return self.agreed_rows
        return self.real_rows * float(self.data_shards)


def micro_batch_objective(terms, padded_rows, rows: StepRows):
    """The objective one micro-batch differentiates (before auxiliary losses and loss
    scaling), so that the reduced gradient is the global batch's.

    A DATA term is scaled here as if it were unmasked (by its elements); the step then
    multiplies the gradients by `data_correction` once every micro-batch's divisor is
    known.

    Args:
      terms: the micro-batch's `LossTerm`s.
      padded_rows: rows of the micro-batch, padding included (every micro-batch of the
        step has as many).
    """
    padded_rows = tf.cast(padded_rows, tf.float32)
    parts = []
    for term in terms:
        total = tf.cast(term.total, tf.float32)
        if term.kind == SUM:
            parts.append(total * float(rows.lanes))
            continue
        if term.kind == DATA and rows.single:
            parts.append(tf.math.divide_no_nan(total, tf.cast(term.divisor, tf.float32)))
            continue
        # Elements per row, from this micro-batch's shape (the same in all of them).
        per_row = tf.cast(term.elements, tf.float32) / padded_rows
        parts.append(total * float(rows.lanes) / (per_row * rows.global_rows))
    return tf.add_n(parts) if parts else tf.zeros([], tf.float32)


def data_estimate(terms, padded_rows, rows: StepRows):
    """The global divisor a DATA term was scaled by in `micro_batch_objective` (its
    elements as if unmasked, for the global batch)."""
    (term,) = [t for t in terms if t.kind == DATA]
    per_row = tf.cast(term.elements, tf.float32) / tf.cast(padded_rows, tf.float32)
    return per_row * rows.global_rows


def micro_batch_report(terms, padded_rows, real_rows, rows: StepRows):
    """The micro-batch's loss as Keras would report it for the global batch, per real
    row: the loss tracker averages it weighted by `real_rows`, giving the step's loss."""
    parts = [_term_report(t, t.total, padded_rows, real_rows, rows) for t in terms]
    return tf.add_n(parts) if parts else tf.zeros([], tf.float32)


def output_reports(terms, padded_rows, real_rows, rows: StepRows) -> list:
    """Each term's own loss before its loss weight, reported as `micro_batch_report`
    reports the total (Keras's `<output>_loss` logs)."""
    return [
        _term_report(t, t.total if t.unweighted is None else t.unweighted, padded_rows,
                     real_rows, rows)
        for t in terms
    ]  # fmt: skip


def _term_report(term, total, padded_rows, real_rows, rows: StepRows):
    padded_rows = tf.cast(padded_rows, tf.float32)
    real_rows = tf.cast(real_rows, tf.float32)
    total = tf.cast(total, tf.float32)
    if term.kind == SUM:  # the batch's loss is the sum over all its rows
        return tf.math.divide_no_nan(total * rows.global_rows, real_rows)
    if term.kind == PER_ROW:
        per_row = tf.cast(term.divisor, tf.float32) / padded_rows
        return tf.math.divide_no_nan(total, per_row * real_rows)
    # the micro-batch's own weighted mean (exact per step: DataDivisor.report)
    return tf.math.divide_no_nan(total, tf.cast(term.divisor, tf.float32))


def pad_to_multiple(
    structures: tuple, sample_weight, multiple: int, minimum=0, whole_copies: bool = False
):
    """Pads axis 0 of every tensor to a multiple of `multiple`, and to at least `minimum`
    rows, by repeating the batch's rows (copies, not zeros, so that layers computing
    batch statistics see real data); the added rows get weight 0.

    Args:
      whole_copies: fill each of the `multiple` parts with whole copies of its own real
        rows (`fill_rows`), as auxiliary losses computed from the data need.

    Returns:
      (padded structures, weights [rows] float32: the given sample weights, or 1, on real
      rows and 0 on added ones, real row count as int32).
    """
    flat = tree.flatten(structures)
    batch = tf.shape(flat[0])[0]
    rows = fill_rows(batch, multiple, minimum, whole_copies)
    padded = tree.map_structure(lambda x: tf.gather(x, rows), structures)
    real = tf.cast(tf.range(tf.shape(rows)[0]) < batch, tf.float32)
    if sample_weight is None:
        weights = real
    else:
        weight = tf.cast(sample_weight, tf.float32)
        weights = tf.gather(weight, rows) * per_row(real, weight)
    return padded, weights, batch


def fill_rows(batch, multiple: int, minimum=0, whole_copies: bool = False):
    """Which row of a batch of `batch` rows each row of the filled batch is: the real rows
    first, in order, then copies, up to a multiple of `multiple` rows and at least
    `minimum`.

    Plain filling repeats the batch from its start. An auxiliary loss computed from the
    data (an `activity_regularizer`, an `add_loss` of activations) is Keras's mean over
    the batch's rows, and a part holding copies of rows of other parts would count those
    rows twice in it. With `whole_copies`, every part holds its real rows an equal number
    of times (or none: a part without real rows, whose share is 0), so its auxiliary
    losses are its real rows' mean, weighed by its real rows (pipeline/executor.py): the
    part size grows to the smallest one the remainder divides (9 rows in 2 parts: 6 and
    3 + 3 copies). With a fixed shape (`minimum`), the part size cannot grow: each part
    then repeats its own rows as far as they go.
    """
    target = tf.maximum(batch, minimum)
    size = target + (multiple - target % multiple) % multiple
    if not whole_copies or (multiple == 1 and isinstance(minimum, int) and minimum == 0):
        return tf.range(size) % batch
    part = size // multiple
    if isinstance(minimum, int) and minimum == 0:
        candidates = tf.range(part, tf.maximum(batch, part) + 1)
        remainder = batch % candidates
        divides = tf.equal(candidates % tf.maximum(remainder, 1), 0)
        fits = (batch + candidates - 1) // candidates <= multiple
        part = tf.reduce_min(tf.boolean_mask(candidates, divides & fits))
    index = tf.range(multiple * part)
    start = index // part * part
    real = tf.clip_by_value(batch - start, 0, part)
    return tf.where(real > 0, start + index % part % tf.maximum(real, 1), index % batch)


def per_row(row_values, like):
    """`row_values` ([rows]) shaped to multiply `like` row by row: sample weights may be
    one per row ([rows]) or one per loss element ([rows, tokens], a causal LM's)."""
    return tf.reshape(row_values, [-1] + [1] * (like.shape.rank - 1))
