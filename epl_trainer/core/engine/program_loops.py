"""The engine's compiled loops over many evaluation or prediction batches (one host round
trip per call): `Program` inherits them; the per-batch steps are `Program._eval_step`
and `Program._predict_step`."""

from __future__ import annotations

import tensorflow as tf
from keras import tree

from epl_trainer.core.engine.step_batch import unpack_element


class InferenceLoops:
    """`eval_many_on_iterator` and `predict_many_on_iterator` (compiled by `Program`)."""

    def _eval_many_on_iterator(self, iterator, steps: int, batch_size: int):
        """Up to `steps` evaluation batches in one call (a loop in the graph); returns how
        many there were (fewer at the end of the data).

        Every batch is padded (and masked) to at least `batch_size` rows, the size of the
        full batches: a shorter last batch then has the same shape inside the loop, as
        the collectives of split layers require (TF fixes a collective's shape by key).
        """
        with tf.device(self.layout.host):
            ran = tf.constant(0, tf.int32)
        for _ in tf.range(steps):
            element = iterator.get_next_as_optional()
            if not element.has_value():
                break
            self._eval_step(*unpack_element(element.get_value()), pad_to=batch_size)
            ran += 1
        return ran

    def _predict_many_on_iterator(self, iterator, steps: int, batch_size: int, like):
        """Up to `steps` prediction batches in one call (a loop in the graph): the flat
        outputs of all of them concatenated, and how many batches there were.

        Args:
          like: the flat outputs of one batch (their dtypes and trailing shapes).
          batch_size: rows of a full batch; shorter ones are padded to it, as in
            `_eval_many_on_iterator`.
        """
        with tf.device(self.layout.host):
            ran = tf.constant(0, tf.int32)
            arrays = [
                tf.TensorArray(
                    t.dtype, size=0, dynamic_size=True, infer_shape=False,
                    element_shape=tf.TensorShape([None, *t.shape[1:]]),
                )
                for t in like
            ]  # fmt: skip
        for _ in tf.range(steps):
            element = iterator.get_next_as_optional()
            if not element.has_value():
                break
            outputs = tree.flatten(self._predict_step(element.get_value(), pad_to=batch_size))
            with tf.device(self.layout.host):
                arrays = [a.write(ran, o) for a, o in zip(arrays, outputs)]
                ran += 1
        with tf.device(self.layout.host):
            return [a.concat() for a in arrays], ran
