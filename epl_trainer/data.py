"""Turns the `x, y` given to fit / evaluate / predict into per-worker batches."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import tensorflow as tf
from keras import tree

from epl_trainer.core.engine import program

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 32


def as_dataset(
    x,
    y=None,
    batch_size=None,
    *,
    worker_index: int = 0,
    worker_num: int = 1,
    drop_remainder: bool = False,
) -> tf.data.Dataset:
    """A dataset of per-worker batches.

    A `tf.data.Dataset` is used as given: its elements are this worker's batches.
    Numpy arrays (or dicts/lists of them) are batched in order, without shuffling (pass a
    shuffled Dataset to shuffle), and dealt round-robin across workers: global batch t is
    the concatenation of every worker's batch t, so `batch_size` is per worker.
    """
    if isinstance(x, tf.data.Dataset):
        if y is not None:
            raise ValueError(
                "When x is a tf.data.Dataset, y must be None (the dataset yields "
                f"(features, labels)). Received: y of type {type(y).__name__}"
            )
        if batch_size is not None:
            raise ValueError(
                "batch_size is only for numpy inputs: a tf.data.Dataset is already "
                f"batched. Received: batch_size={batch_size}"
            )
        return x
    batch_size = DEFAULT_BATCH_SIZE if batch_size is None else batch_size
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int. Received: batch_size={batch_size!r}")
    arrays = (x,) if y is None else (x, y)
    lengths = {len(a) for a in tree.flatten(arrays)}
    if len(lengths) != 1:
        raise ValueError(
            f"All input arrays must have the same length. Received lengths {sorted(lengths)}"
        )
    arrays = tree.map_structure(np.asarray, arrays)
    dataset = tf.data.Dataset.from_tensor_slices(arrays if y is not None else arrays[0])
    total = lengths.pop()
    dropped = total % batch_size if drop_remainder else 0
    if dropped:
        logger.warning(
            "%d of %d samples do not fill a batch of %d and are skipped.",
            dropped,
            total,
            batch_size,
        )
    dataset = dataset.batch(batch_size, drop_remainder=drop_remainder)
    if worker_num > 1:
        # Every worker must run the same number of steps, or one would wait forever in
        # a collective its peers never join: batches that cannot be dealt evenly are left out.
        num_batches = total // batch_size if drop_remainder else -(-total // batch_size)
        usable = num_batches - num_batches % worker_num
        if usable < num_batches:
            logger.warning(
                "%d batch(es) of %d cannot be dealt evenly to %d workers and are skipped.",
                num_batches - usable,
                num_batches,
                worker_num,
            )
        dataset = dataset.take(usable).shard(worker_num, worker_index)
    return dataset.prefetch(tf.data.AUTOTUNE)


def split_element(element, with_labels: bool):
    """(features, labels) from a dataset element; labels None for prediction inputs."""
    if with_labels:
        return program.split_element(element)  # the check the compiled step also makes
    if isinstance(element, tuple) and len(element) == 2:
        return element[0], None
    return element, None


def check_element_spec(element_spec, model, with_labels: bool) -> None:
    """Checks a dataset's features against the model's inputs before anything is traced.

    Compares the structure (dict keys, number of inputs), the rank and every known
    non-batch dimension, so a mismatched dataset fails with one error that shows both
    sides instead of a shape error deep inside a compiled step. Models whose inputs are
    not known yet (subclassed, never called) are not checked.
    """
    features, _ = split_element(element_spec, with_labels)
    try:
        expected = model.input
    except (AttributeError, ValueError):
        return
    wanted = tree.map_structure(lambda t: tuple(t.shape), expected)
    given = tree.map_structure(lambda s: getattr(s, "shape", None), features)

    def fail(why: str):
        raise ValueError(
            f"The dataset's features do not match the model's inputs: {why}. "
            f"Model inputs: {wanted}; dataset features: {given}"
        )

    if isinstance(expected, Mapping):
        if not isinstance(features, Mapping):
            fail(f"the model takes a dict with keys {sorted(expected)}")
        missing = sorted(set(expected) - set(features))
        if missing:
            fail(f"missing key(s) {missing}")
        pairs = [(repr(key), expected[key], features[key]) for key in expected]
    else:
        inputs, specs = tree.flatten(expected), tree.flatten(features)
        if len(inputs) != len(specs):
            fail(f"the model has {len(inputs)} input(s), the dataset gives {len(specs)} tensor(s)")
        pairs = [(str(i), kt, spec) for i, (kt, spec) in enumerate(zip(inputs, specs))]
    for name, keras_tensor, spec in pairs:
        shape = getattr(spec, "shape", None)
        if shape is None or shape.rank is None:
            continue
        want = tuple(keras_tensor.shape)
        dims_differ = any(
            w is not None and g is not None and w != g
            for w, g in zip(want[1:], shape.as_list()[1:])
        )
        if shape.rank != len(want) or dims_differ:
            fail(f"input {name} expects shape {want}, the dataset gives {tuple(shape.as_list())}")


class EpochBatches:
    """Per-epoch batches, with Keras's `steps_per_epoch` semantics.

    Without `steps_per_epoch` each epoch is one pass over the dataset. With it, one
    iterator continues across epochs; when the data runs out at an epoch boundary it
    starts a new pass, and when it runs out mid-epoch that epoch ends early (with a
    warning), as `Model.fit` does.

    `position` counts the batches taken from the current pass. A checkpoint records it,
    and a resumed run passes it back as `start_position`: the first pass then skips that
    many batches, so a deterministic dataset (the same batches in the same order in a
    fresh process) neither repeats nor skips a sample.
    """

    def __init__(
        self, dataset: tf.data.Dataset, steps_per_epoch: int | None, start_position: int = 0
    ):
        if steps_per_epoch is not None and (
            not isinstance(steps_per_epoch, int) or steps_per_epoch < 1
        ):
            raise ValueError(
                f"steps_per_epoch must be a positive int or None. Received: {steps_per_epoch!r}"
            )
        self.dataset = dataset
        self.steps_per_epoch = steps_per_epoch
        self.position = start_position
        self._skip = start_position
        self._iterator = None

    def _new_pass(self):
        skip, self._skip = self._skip, 0
        self.position = skip
        return iter(self.dataset.skip(skip) if skip else self.dataset)

    def run_epoch(self, step_fn, first_step: int = 0, after_step=None, steps_per_call=1) -> int:
        """Runs the epoch's steps through `step_fn`; returns the steps run.

        `step_fn(step_index, iterator, count)` runs up to `count` steps (1, or up to
        `steps_per_call` with steps_per_execution), pulling its batches from the iterator
        inside a compiled function, and returns `(steps run, stop)`; fewer steps than
        `count`, or OutOfRangeError / StopIteration, mean the data ran out. Step indices
        start at `first_step` (a resumed epoch); `after_step(step_index)` runs once
        `position` counts that step's batch.
        """
        steps = first_step
        if self.steps_per_epoch is None:
            self._iterator = None
        while self.steps_per_epoch is None or steps < self.steps_per_epoch:
            count = steps_per_call
            if self.steps_per_epoch is not None:
                count = min(count, self.steps_per_epoch - steps)
            fresh = self._iterator is None
            if fresh:
                # A resumed pass that is already used up is not a fresh (empty) dataset.
                fresh = self._skip == 0
                self._iterator = self._new_pass()
            try:
                ran, stop = step_fn(steps, self._iterator, count)
            except (StopIteration, tf.errors.OutOfRangeError):
                ran, stop = 0, False
            for _ in range(ran):
                steps += 1
                self.position += 1
                if after_step is not None:
                    after_step(steps - 1)
            if stop:
                return steps - first_step
            if ran == count:
                continue
            # The data ran out.
            self._iterator = None
            self.position = 0  # the next epoch starts a new pass
            if self.steps_per_epoch is None:
                return steps - first_step
            if fresh and ran == 0:
                return steps - first_step  # an empty dataset
            if steps > first_step:
                logger.warning(
                    "The data ran out after %d of %d steps of this epoch; the next epoch "
                    "starts a new pass.",
                    steps,
                    self.steps_per_epoch,
                )
                return steps - first_step
        return steps - first_step


def spec_probe(x, y, parse_fn, file_format) -> tf.data.Dataset:
    """A dataset with the element spec of fit's data, for building a model_fn's model."""
    if parse_fn is not None or file_format is not None:
        raise ValueError(
            "An Estimator-style model_fn is built from the data's element spec; with "
            "fit(files, parse_fn=...) call trainer.evaluate or fit on a tf.data.Dataset "
            "of the parsed records first."
        )
    return x if isinstance(x, tf.data.Dataset) else as_dataset(x, y, batch_size=1)


def unpack_validation(validation_data):
    if isinstance(validation_data, tf.data.Dataset):
        return validation_data, None
    if isinstance(validation_data, (tuple, list)) and len(validation_data) == 2:
        return validation_data
    raise ValueError(
        "validation_data must be a tf.data.Dataset or an (x, y) tuple. "
        f"Received: {type(validation_data).__name__}"
    )
