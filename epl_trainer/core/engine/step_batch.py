"""One step's batch: unpacked from a dataset element, split into lanes x micro-batches,
and filled up with weight-0 rows when it does not split evenly (objective.py)."""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import tree
from keras.src.backend.common import global_state

from epl_trainer.core.engine import objective
from epl_trainer.core.engine.pipeline import MicroBatchInput


def unpack_element(element):
    """(features, labels, sample_weight or None) from a training or evaluation element:
    `(x, y)` or `(x, y, sample_weight)`, as Keras takes them."""
    if not isinstance(element, tuple) or len(element) not in (2, 3):
        raise ValueError(
            "Training and evaluation datasets must yield (features, labels) pairs or "
            "(features, labels, sample_weight) triples. Received an element with structure "
            f"{tree.map_structure(lambda x: getattr(x, 'shape', x), element)}"
        )
    return element if len(element) == 3 else (*element, None)


def open_batch_spec(element_spec):
    """`element_spec` (a dataset's) with the batch dimension of every tensor left open, as
    a dataset batched without drop_remainder has it: one trace serves every batch size."""

    def open_batch(spec):
        if isinstance(spec, tf.TensorSpec) and spec.shape.rank:
            return tf.TensorSpec([None, *spec.shape[1:]], spec.dtype, spec.name)
        if isinstance(spec, tf.RaggedTensorSpec) and spec.shape.rank:
            return tf.RaggedTensorSpec(
                [None, *spec.shape[1:]], spec.dtype, spec.ragged_rank, spec.row_splits_dtype
            )
        return spec

    return tf.nest.map_structure(open_batch, element_spec)


class StepBatch:
    """One step's batch cut into lanes x micro-batches, padded to split evenly.

    A batch that does not divide into lanes x micro-batches (an odd batch, an epoch's
    short last batch) is filled up by repeating its rows with weight 0, so the step is
    the single-device step on exactly the real rows (objective.py).
    """

    def __init__(self, parts: list, rows):
        self.parts, self.rows = parts, rows

    @staticmethod
    def split(
        features,
        labels,
        sample_weight,
        num_lanes: int,
        num_micro: int,
        widest=None,
        whole_copies: bool = False,
    ) -> StepBatch:
        """Args:
        widest: None, or a variable holding the most rows a step has had; a shorter
          batch is filled up to it (`StepHooks.fixed_batch_shape`).
        whole_copies: each micro-batch holds whole copies of its own real rows
          (`objective.fill_rows`): the model has auxiliary losses.
        """
        parts = num_lanes * num_micro
        static = tree.flatten(features)[0].shape[0]
        fits = static is not None and static % parts == 0
        if sample_weight is None and fits and widest is None:
            pieces = split_batch((features, labels), parts)  # nothing to fill or weigh
            inputs = [MicroBatchInput(f, y, None, None, None) for f, y in pieces]
            return StepBatch(inputs, tf.constant(static, tf.int32))
        minimum = 0
        if widest is not None:
            widest.assign(tf.maximum(widest, tf.shape(tree.flatten(features)[0])[0]))
            minimum = widest.read_value()
        (features, labels), weights, rows = objective.pad_to_multiple(
            (features, labels), sample_weight, parts, minimum, whole_copies
        )
        real = tf.cast(tf.range(tf.shape(weights)[0]) < rows, tf.float32)
        pieces = split_batch((features, labels, weights, real), parts)
        # Real rows per micro-batch in one op (the step's ops do not grow with the count).
        part_rows = tf.unstack(tf.cast(tf.reduce_sum(tf.reshape(real, [parts, -1]), 1), tf.int32))
        inputs = [MicroBatchInput(f, y, w, m, r) for (f, y, w, m), r in zip(pieces, part_rows)]
        return StepBatch(inputs, rows)

    def lane_parts(self, li: int, num_micro: int) -> list:
        return self.parts[li * num_micro : (li + 1) * num_micro]


def split_batch(structure, parts: int) -> list:
    """Splits every tensor of a nested structure into `parts` equal slices on axis 0."""
    if parts == 1:
        return [structure]
    flat = tree.flatten(structure)
    sliced = [tf.split(x, parts, axis=0) for x in flat]
    return [tree.pack_sequence_as(structure, [s[p] for s in sliced]) for p in range(parts)]


def pad_batch(structures: tuple, multiple: int, minimum: int = 0, whole_copies: bool = False):
    """Pads axis 0 to a multiple of `multiple`, and to at least `minimum` rows; returns the
    padded structures and a mask of the real rows (`objective.fill_rows`: with
    `whole_copies`, each part holds whole copies of its own real rows)."""
    flat = tree.flatten(structures)
    batch = tf.shape(flat[0])[0]
    if not whole_copies:
        target = tf.maximum(batch, minimum)
        pad = target - batch + (multiple - target % multiple) % multiple
        padded = tree.map_structure(
            lambda x: tf.pad(x, [[0, pad]] + [[0, 0]] * (len(x.shape) - 1)), structures
        )
        mask = tf.cast(tf.sequence_mask(batch, batch + pad), keras.backend.floatx())
        return (*padded, mask)
    rows = objective.fill_rows(batch, multiple, minimum, whole_copies=True)
    padded = tree.map_structure(lambda x: tf.gather(x, rows), structures)
    mask = tf.cast(tf.range(tf.shape(rows)[0]) < batch, keras.backend.floatx())
    return (*padded, mask)


def adds_losses(model, features) -> bool:
    """Whether `model` adds losses of its own in training (`add_loss`, regularizers): a
    batch it trains on is then filled with whole copies (`objective.fill_rows`). Keras's
    own layers add losses of the data only through `activity_regularizer`; a model with
    other layers is traced symbolically (once) to see. Undecidable: True."""
    layers = list(model._flatten_layers(include_self=True))
    if any(getattr(layer, "activity_regularizer", None) is not None for layer in layers):
        return True
    if all(type(layer).__module__.startswith("keras.") for layer in layers):
        return False

    def losses(trainable, non_trainable, inputs):
        # Inside a scope: the scratch graph's root scope refuses layer names starting
        # with "_", which a scope of the engine's own traces accepts.
        with tf.name_scope("adds_losses"):
            return model.stateless_call(
                trainable, non_trainable, inputs, training=True, return_losses=True
            )[2]

    def spec(x):
        return keras.KerasTensor(x.shape, x.dtype)

    scopes = list(global_state.get_global_attribute("name_scope_stack", default=[]))
    try:
        found = keras.src.backend.compute_output_spec(
            losses,
            [spec(v) for v in model.trainable_variables],
            [spec(v) for v in model.non_trainable_variables],
            tree.map_structure(spec, features),
        )
    except Exception:  # e.g. ragged inputs, which a KerasTensor cannot stand for: assume so
        # Keras leaves the scope of a layer whose call raised on its stack.
        global_state.set_global_attribute("name_scope_stack", scopes)
        return True
    return bool(found)
