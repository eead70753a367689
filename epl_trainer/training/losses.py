"""The loss of `compile(loss=..., loss_weights=...)`, resolved by Keras's own `CompileLoss`.

Which loss applies to which model output, with which weight, under which name, and which
errors a mismatched structure raises, is Keras's `CompileLoss` logic, built from the
data's shapes as Keras's first `fit` builds it (`Trainer._symbolic_build`). The engine
then takes, per loss, the flat output index it reads, the Keras `Loss` and its weight
(objective.py computes Keras's weighted sums and divisors from them), and Keras's `Mean`
per output loss, which reports `<output>_loss` next to `loss` for several losses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import keras
import tensorflow as tf
from keras import tree

# Keras's own resolver of compile()'s loss structure; not exported by keras.losses.
from keras.src.trainers.compile_utils import CompileLoss

from epl_trainer.core.engine.objective import NO_LOSS_MESSAGE, keras_loss_term


@dataclasses.dataclass(frozen=True)
class LossEntry:
    """One loss of the compiled structure: the flat model output it reads (the index in
    `keras.tree.flatten(y_pred)`; a structure of indices for a loss that takes a part of
    a nested output structure at once), the Keras loss, its weight and Keras's name."""

    index: object
    loss: keras.losses.Loss
    weight: float
    name: str


class CompiledLoss:
    """The losses of `Model.compile` (or of `EPLTrainer(loss=..., loss_weights=...)`),
    matched to the model's outputs by Keras's `CompileLoss`.

    `loss` may be anything `Model.compile` takes: a Keras `Loss`, a name, a function, or
    a list / dict / nested structure of those matching the outputs (None entries leave
    an output without a loss). `loss=None` is allowed: a model may have only
    `add_loss` losses, or only predict; a step with no loss at all raises Keras's error.

    `build(y_true, y_pred)` resolves the structure from symbolic tensors (the data's
    shapes); until then the losses are unknown.
    """

    def __init__(self, loss, output_names: Sequence[str] | None = None, loss_weights=None):
        self._loss = loss
        self._loss_weights = loss_weights
        self.output_names = list(output_names or [])
        self._new_keras_loss()  # Keras checks the arguments' types here
        self.entries: list[LossEntry] = []
        # Keras's Mean per loss, reporting `<name>_loss`; empty for a single loss. Updated
        # in place by `build`.
        self.trackers: list[keras.metrics.Metric] = []
        self.built = False

    def _new_keras_loss(self):
        if self._loss is None:
            return None
        return CompileLoss(self._loss, self._loss_weights, output_names=self.output_names or None)

    def build(self, y_true, y_pred, sample_weight=None) -> None:
        """Resolves the loss structure as Keras's first `fit` does: by calling Keras's
        `CompileLoss` on symbolic `y_true` / `y_pred` (KerasTensors with the data's
        shapes), which raises Keras's errors for structures that do not match.

        Can be called again (e.g. a first resolution from the outputs' shapes, then the
        data's): each call starts from a new `CompileLoss`.
        """
        keras_loss = self._new_keras_loss()
        if keras_loss is not None:
            keras.src.backend.compute_output_spec(keras_loss, y_true, y_pred, sample_weight)
        self._take(keras_loss, y_pred)

    def build_from_outputs(self, y_pred) -> None:
        """Resolves the structure from the model's outputs alone, before any data (labels
        assumed shaped like the outputs; the loss is not computed). `build` with the
        data's shapes replaces it."""
        keras_loss = self._new_keras_loss()
        if keras_loss is not None:
            keras_loss.build(y_pred, y_pred)
        self._take(keras_loss, y_pred)

    def _take(self, keras_loss, y_pred) -> None:
        """Takes the entries and trackers of a built Keras `CompileLoss` (or none)."""
        if keras_loss is None:
            self.entries, self.trackers[:], self.built = [], [], True
            return
        flat_count = len(tree.flatten(y_pred))
        markers = tree.pack_sequence_as(keras_loss._y_pred_build_structure, list(range(flat_count)))
        entries = []
        for path, loss, weight, name in keras_loss._flat_losses:
            index = markers
            for key in path:
                index = index[key]
            weight = 1.0 if weight is None else float(weight)
            entries.append(LossEntry(index, loss, weight, name))
        self.entries = entries
        self.trackers[:] = keras_loss.metrics  # in place: the engine holds the list
        self.built = True

    def build_from(self, y_true, y_pred) -> None:
        """Builds from tensors' static shapes (a loss used before the trainer built it
        from the data's element spec), outside any graph being traced."""
        if self.built:
            return
        with tf.init_scope():
            self.build(*tree.map_structure(_symbolic, (y_true, y_pred)))

    def flat_labels(self, y_true, y_pred) -> list:
        """The labels in the order of `keras.tree.flatten(y_pred)`, matched to the outputs
        as Keras's `CompileLoss` matches them (same structure; a single label for a single
        output; a dict keyed by output names; labels only for the outputs with a loss)."""
        flat_pred = tree.flatten(y_pred)
        names = self.output_names
        if isinstance(y_true, dict) and not isinstance(y_pred, dict) and set(y_true) == set(names):
            return [y_true[name] for name in names]
        flat_true = tree.flatten(y_true)
        if len(flat_true) == len(flat_pred):
            return flat_true
        with_loss = sorted({i for entry in self.entries for i in tree.flatten(entry.index)})
        if len(flat_true) == len(with_loss):
            aligned = [None] * len(flat_pred)
            for index, label in zip(with_loss, flat_true):
                aligned[index] = label
            return aligned
        raise ValueError(
            "y_true and y_pred have different structures.\n"
            f"y_true: {tree.map_structure(lambda _: '*', y_true)}\n"
            f"y_pred: {tree.map_structure(lambda _: '*', y_pred)}"
        )

    def terms(self, y_true, y_pred, sample_weight=None, real_rows=None) -> list:
        """Each loss's weighted sum and Keras's divisor (`objective.LossTerm`), kept
        apart so the step divides once for the global batch (objective.py); `real_rows`:
        the rows before any added to fill the batch (`objective.keras_loss_term`)."""
        self.build_from(y_true, y_pred)
        flat_pred = tree.flatten(y_pred)
        flat_true = self.flat_labels(y_true, y_pred)
        return [
            keras_loss_term(
                entry.loss, pick(flat_true, entry.index), pick(flat_pred, entry.index),
                sample_weight, entry.weight, real_rows,
            )
            for entry in self.entries
        ]  # fmt: skip

    def __call__(self, y_true, y_pred, sample_weight=None):
        """The total loss of a batch, as Keras's `CompileLoss` computes it."""
        terms = self.terms(y_true, y_pred, sample_weight)
        if not terms:
            raise ValueError(NO_LOSS_MESSAGE)
        return tf.add_n([tf.math.divide_no_nan(t.total, t.divisor) for t in terms])

    def losses_for(self, num_outputs: int) -> list:
        """Per flat output, its (first) Keras loss of its own, or None."""
        found = [None] * num_outputs
        for entry in self.entries:
            if isinstance(entry.index, int) and found[entry.index] is None:
                found[entry.index] = entry.loss
        return found


def pick(flat: list, index):
    """`flat[index]`, or for a structure of indices the same structure of items."""
    return tree.map_structure(lambda i: flat[i], index)


def _symbolic(x):
    if x is None:
        return None
    return keras.KerasTensor(tuple(x.shape), dtype=keras.backend.standardize_dtype(x.dtype))
