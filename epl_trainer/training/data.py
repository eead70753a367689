"""Turns the `x, y` given to fit / evaluate / predict into per-worker batches."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import tensorflow as tf
from keras import tree

from epl_trainer.core.engine import step_batch
from epl_trainer.training import model_inputs
from epl_trainer.training.iterators import release
from epl_trainer.training.pipeline_models import Preprocessing

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 32


def as_dataset(
    x,
    y=None,
    batch_size=None,
    *,
    sample_weight=None,
    worker_index: int = 0,
    worker_num: int = 1,
    drop_remainder: bool = False,
    preprocessing: Preprocessing | None = None,
    deal_rows: bool = False,
) -> tf.data.Dataset:
    """A dataset of per-worker batches: `(x, y)`, `(x, y, sample_weight)` or `x` alone.

    A `tf.data.Dataset` is used as given: its elements are this worker's batches
    (`(x, y)` or `(x, y, sample_weight)`; see `standardize_dataset`); `fit` shards it
    first (`shard_dataset`). Numpy arrays (or
    dicts/lists of them) are batched in order, and dealt round-robin across workers:
    global batch t is the concatenation of every worker's batch t, so `batch_size` is per
    worker. With `deal_rows` (io.global_batches) `batch_size` is the global batch, and
    each worker takes its rows of every batch (`rows_of_shard`). `ReshuffledArrays` deals
    them the same way in a new order every pass.

    With `preprocessing` (a KerasHub task's, `pipeline_models.py`) the inputs are raw
    samples: this worker's batches of them are mapped through it.
    """
    if isinstance(x, tf.data.Dataset):
        _check_dataset_arguments(y, batch_size, sample_weight)
        return standardize_dataset(_preprocessed(x, preprocessing))
    if preprocessing is not None:
        x, y = preprocessing.raw_arrays(x), preprocessing.raw_arrays(y)
    arrays, total = _array_inputs(x, y, sample_weight)
    batch_size = checked_batch_size(batch_size)
    dataset = tf.data.Dataset.from_tensor_slices(arrays)
    dataset = dataset.batch(batch_size, drop_remainder=drop_remainder)
    if deal_rows:
        dataset = rows_of_shard(dataset, worker_index, worker_num)
    else:
        usable = _usable_batches(total, batch_size, worker_num, drop_remainder)
        dataset = _deal(dataset, usable, worker_index, worker_num)
    dataset = _preprocessed(dataset, preprocessing)
    return standardize_dataset(dataset).prefetch(tf.data.AUTOTUNE)


def _preprocessed(dataset: tf.data.Dataset, preprocessing: Preprocessing | None):
    return dataset if preprocessing is None else preprocessing.apply(dataset)


class ReshuffledArrays:
    """Numpy inputs in a new order every pass, as Keras's `fit(shuffle=True)`.

    Pass k's order is a permutation drawn from `seed` and k alone, so every worker deals
    the same global batches (workers agree on `seed`) and a resumed run that knows its
    pass finds the same order again. `shuffle="batch"` permutes within each batch-sized
    chunk and keeps the chunks in order (Keras's option for data read in chunks).
    Batches are gathered from one host copy of the arrays; the dealing across workers,
    the dropped remainder and the preprocessing of raw samples are those of `as_dataset`.
    """

    def __init__(
        self,
        x,
        y=None,
        batch_size=None,
        *,
        sample_weight=None,
        seed: int = 0,
        mode="global",
        worker_index: int = 0,
        worker_num: int = 1,
        drop_remainder: bool = False,
        preprocessing: Preprocessing | None = None,
        deal_rows: bool = False,
    ):
        if preprocessing is not None:
            x, y = preprocessing.raw_arrays(x), preprocessing.raw_arrays(y)
        self.preprocessing = preprocessing
        arrays, self.total = _array_inputs(x, y, sample_weight)
        with tf.device("/CPU:0"):
            self._tensors = tree.map_structure(tf.convert_to_tensor, arrays)
        self.batch_size = checked_batch_size(batch_size)
        self.seed, self.mode = seed, mode
        self.drop_remainder, self.worker = drop_remainder, (worker_index, worker_num)
        self.deal_rows = deal_rows
        if not deal_rows:
            self._usable = _usable_batches(self.total, self.batch_size, worker_num, drop_remainder)

    def order(self, pass_index: int) -> np.ndarray:
        """The sample order of pass `pass_index`."""
        rng = np.random.default_rng([self.seed, pass_index])
        if self.mode != "batch":
            return rng.permutation(self.total)
        starts = range(0, self.total, self.batch_size)
        chunks = [np.arange(s, min(s + self.batch_size, self.total)) for s in starts]
        return np.concatenate([rng.permutation(chunk) for chunk in chunks])

    def dataset(self, pass_index: int) -> tf.data.Dataset:
        """Pass `pass_index`'s per-worker batches."""
        indices = tf.data.Dataset.from_tensor_slices(self.order(pass_index))
        indices = indices.batch(self.batch_size, drop_remainder=self.drop_remainder)
        if self.deal_rows:
            indices = rows_of_shard(indices, *self.worker)
        else:
            indices = _deal(indices, self._usable, *self.worker)
        tensors = self._tensors

        def gather(rows):
            return tree.map_structure(lambda t: tf.gather(t, rows), tensors)

        batches = _preprocessed(indices.map(gather), self.preprocessing)
        return standardize_dataset(batches).prefetch(tf.data.AUTOTUNE)


def _check_dataset_arguments(y, batch_size, sample_weight) -> None:
    if y is not None or sample_weight is not None:
        given = "y" if y is not None else "sample_weight"
        raise ValueError(
            f"When x is a tf.data.Dataset, {given} must be None (the dataset yields "
            "(features, labels) or (features, labels, sample_weight)). Received: "
            f"{given} of type {type(y if y is not None else sample_weight).__name__}"
        )
    if batch_size is not None:
        raise ValueError(
            "batch_size is only for numpy inputs: a tf.data.Dataset is already "
            f"batched. Received: batch_size={batch_size}"
        )


def checked_batch_size(batch_size) -> int:
    batch_size = DEFAULT_BATCH_SIZE if batch_size is None else batch_size
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int. Received: batch_size={batch_size!r}")
    return batch_size


def _array_inputs(x, y, sample_weight):
    """The arrays of one element, `x`, `(x, y)` or `(x, y, sample_weight)` (lists made
    tuples, as tf.data would stack a list), and their common length."""
    if sample_weight is not None and y is None:
        raise ValueError(
            "sample_weight needs labels: pass y as well. Received: y=None, sample_weight "
            f"of type {type(sample_weight).__name__}"
        )
    if sample_weight is not None:
        sample_weight = per_sample_weights(sample_weight)
    x = model_inputs.without_absent_inputs(x)
    arrays = tuple(a for a in (x, y, sample_weight) if a is not None)
    lengths = {len(a) for a in tree.flatten(arrays)}
    if len(lengths) != 1:
        raise ValueError(
            f"All input arrays must have the same length. Received lengths {sorted(lengths)}"
        )
    arrays = tree.lists_to_tuples(tree.map_structure(np.asarray, arrays))
    return (arrays if len(arrays) > 1 else arrays[0]), lengths.pop()


def per_sample_weights(sample_weight) -> np.ndarray:
    """`sample_weight` as the engine takes it: float32, one weight per sample."""
    flat = tree.flatten(sample_weight)
    if isinstance(sample_weight, (list, tuple, Mapping)) and flat and not np.isscalar(flat[0]):
        raise ValueError(
            "sample_weight must be one array of shape (num_samples,): per-output sample "
            f"weights are not supported. Received: a {type(sample_weight).__name__} of "
            f"{len(sample_weight)} arrays"
        )
    weights = np.asarray(sample_weight, dtype=np.float32)
    if weights.ndim == 2 and weights.shape[1] == 1:
        weights = weights[:, 0]
    if weights.ndim != 1:
        raise ValueError(
            "sample_weight must hold one weight per sample, of shape (num_samples,) or "
            f"(num_samples, 1); per-timestep weights are not supported. Received: shape "
            f"{weights.shape}"
        )
    return weights


def _usable_batches(
    total: int, batch_size: int, worker_num: int, drop_remainder: bool
) -> int | None:
    """The batches every worker can take an equal share of (None: all of them on one
    worker); logs what is left out."""
    dropped = total % batch_size if drop_remainder else 0
    if dropped:
        logger.warning(
            "%d of %d samples do not fill a batch of %d and are skipped.",
            dropped,
            total,
            batch_size,
        )
    if worker_num == 1:
        return None
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
    return usable


def _deal(dataset: tf.data.Dataset, usable: int | None, worker_index: int, worker_num: int):
    """This worker's batches: every `worker_num`-th of the `usable` first ones."""
    if usable is None:
        return dataset
    return dataset.take(usable).shard(worker_num, worker_index)


def rows_of_shard(dataset: tf.data.Dataset, shard: int, shards: int) -> tf.data.Dataset:
    """Input shard `shard`'s rows of each global batch of `dataset` (io.global_batches).

    Contiguous slices whose sizes differ by at most one row (the first `rows % shards`
    shards take one more), so every row of every batch, a short last one too, is dealt
    once whatever the number of shards: the global batch does not depend on how many
    workers share it, which is what lets an elastic job change its worker count.
    """
    if shards == 1:
        return dataset

    def take(*parts):
        element = parts[0] if len(parts) == 1 else parts
        rows = tf.shape(tree.flatten(element)[0], out_type=tf.int64)[0]
        base, extra = rows // shards, rows % shards
        start = shard * base + tf.minimum(tf.constant(shard, tf.int64), extra)
        size = base + tf.cast(shard < extra, tf.int64)
        return tree.map_structure(lambda t: t[start : start + size], element)

    return dataset.map(take)


_POLICY = tf.data.experimental.AutoShardPolicy
# io.auto_shard's choices, as tf.data (and so tf.distribute) names them.
AUTO_SHARD_POLICIES = {
    "auto": _POLICY.AUTO,
    "files": _POLICY.FILE,
    "data": _POLICY.DATA,
    "off": _POLICY.OFF,
}


def shard_dataset(
    dataset: tf.data.Dataset,
    shard: int,
    shards: int,
    *,
    auto_shard: str = "auto",
    global_batches: bool = False,
) -> tf.data.Dataset:
    """Input shard `shard`'s part of a user's Dataset, as tf.distribute auto-shards one.

    The policy is the dataset's own `options().experimental_distribute.auto_shard_policy`
    when it is anything but AUTO (its default), else `auto_shard` (io.auto_shard). An
    element stays the batch of the worker that reads it: FILE gives shard k the files
    k, k + shards, ... of the pipeline's reader (tf.data's rewrite, the one tf.distribute
    applies); DATA the elements k, k + shards, ...; AUTO files where the pipeline reads
    files, else data (tf.data's AUTO); OFF every element.

    With `global_batches` (io.global_batches) an element is a global batch and each shard
    takes its rows of every one (`rows_of_shard`): tf.distribute's data sharding after
    its rebatch. Only AUTO and DATA can mean that: the others are refused on any number
    of shards, so that a job does not fail only once it runs on several workers.
    """
    own = dataset.options().experimental_distribute.auto_shard_policy
    if own == _POLICY.AUTO:
        policy, source = AUTO_SHARD_POLICIES[auto_shard], f"io.auto_shard={auto_shard!r}"
    else:
        policy, source = own, f"the dataset's auto_shard_policy={own.name}"
    if global_batches and policy not in (_POLICY.AUTO, _POLICY.DATA):
        raise ValueError(
            "io.global_batches gives every input shard its rows of each global batch "
            f"(sharding by data), which {source} contradicts: set it to AUTO or DATA "
            "('auto' or 'data'), or io.global_batches=False for batches read per worker. "
            f"Received: {source}, io.global_batches=True"
        )
    if shards == 1:
        return dataset
    if global_batches:
        return rows_of_shard(dataset, shard, shards)
    logger.info("The Dataset is input shard %d of %d by %s.", shard, shards, source)
    if policy == _POLICY.OFF:
        return dataset
    if policy == _POLICY.DATA:
        # tf.data's DATA rewrite would also turn a rebatch of the user's into a legacy
        # one that undoes it; a shard at the end of the pipeline is DATA without that
        # (AUTO keeps the quirk: tf.data's own fallback from files to data is used, since
        # trying FILE first logs a C++ error for every pipeline that reads no files).
        return dataset.shard(shards, shard)
    return _rewritten_by_tf_data(dataset, policy, shard, shards, source)


def _rewritten_by_tf_data(dataset, policy, shard: int, shards: int, source: str):
    """tf.data's auto-shard rewrite of `dataset` with `policy` (AUTO, FILE or HINT)."""
    # The rewrite tf.distribute applies to a dataset it distributes; no public API runs it.
    from tensorflow.python.data.experimental.ops import distribute as tf_data_distribute

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy
    try:
        return tf_data_distribute._AutoShardDataset(
            dataset.with_options(options), shards, shard, num_replicas=1
        )
    except tf.errors.NotFoundError as error:  # FILE, and no reader in the pipeline
        raise ValueError(
            "Sharding a Dataset by files needs a pipeline that reads files "
            "(tf.data.TFRecordDataset, TextLineDataset, FixedLengthRecordDataset, or "
            "Dataset.list_files interleaved into them); this one reads none. Shard it by "
            "data (io.auto_shard='data', or 'auto': files where a pipeline reads them, else "
            "data), or 'off' if each worker's dataset is already its own. Received: "
            f"{source}, input shards={shards}"
        ) from error


def unpack_element(element, with_labels: bool = True):
    """(features, labels, sample_weight) of a dataset element, as Keras unpacks them.

    With labels (fit, evaluate) an element is `(x, y)` or `(x, y, sample_weight)`; the
    engine makes the same check while tracing. For prediction a tuple of 1-3 parts is
    `(x, ...)` and anything else is the features (Keras's `unpack_x_y_sample_weight`).
    """
    if with_labels or (isinstance(element, tuple) and len(element) in (2, 3)):
        return step_batch.unpack_element(element)  # the check the compiled step makes
    if isinstance(element, tuple) and len(element) == 1:
        return element[0], None, None
    return element, None, None


def split_element(element, with_labels: bool):
    """(features, labels) from a dataset element; labels None for prediction inputs."""
    features, labels, _ = unpack_element(element, with_labels)
    return features, labels


def standardize_dataset(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """A dataset whose sample weights (a third part) are float32, of shape [batch] for one
    weight per sample; other datasets are returned as they are.

    Weights of shape (batch, 1) become (batch,). Weights of rank >= 2 otherwise are one
    weight per loss element, as Keras takes them: a causal LM's preprocessor weighs each
    token by its padding mask (a bool [batch, sequence]).
    """
    spec = dataset.element_spec
    if not (isinstance(spec, tuple) and len(spec) == 3):
        return dataset
    weight = spec[2]
    shape = getattr(weight, "shape", None)
    if shape is None or shape.rank is None or shape.rank == 0:
        raise ValueError(
            "Sample weights must hold one weight per sample, of shape (batch,) or "
            "(batch, 1), or one per loss element, of shape (batch, ...); per-output "
            f"sample weights are not supported. Received: sample_weight spec {weight}"
        )
    if weight.dtype == tf.float32 and not (shape.rank == 2 and shape[1] == 1):
        return dataset
    if shape.rank == 2 and shape[1] == 1:
        return dataset.map(lambda x, y, w: (x, y, tf.reshape(tf.cast(w, tf.float32), [-1])))
    return dataset.map(lambda x, y, w: (x, y, tf.cast(w, tf.float32)))


def features_only(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """The features of a dataset that may also yield labels and weights (predict)."""
    spec = dataset.element_spec
    if isinstance(spec, tuple) and len(spec) in (1, 2, 3):
        return dataset.map(lambda *element: element[0])
    return dataset


class EpochBatches:
    """Per-epoch batches, with Keras's `steps_per_epoch` semantics.

    Without `steps_per_epoch` each epoch is one pass over the dataset. With it, one
    iterator continues across epochs; when the data runs out at an epoch boundary it
    starts a new pass, and when it runs out mid-epoch that epoch ends early (with a
    warning), as `Model.fit` does.

    `batches_per_pass`, when known (and every worker knows it), ends a pass without
    beginning a step that would find no data, as Keras does for data of known size.

    With `passes` (numpy inputs and `shuffle`), pass k (counted from `first_pass`) reads
    `passes.dataset(k)`: the same batches in a new order.

    `position` counts the batches taken from the current pass. A checkpoint records it,
    and a resumed run passes it back as `start_position`. With `restore_input`
    (`restore_input(iterator)` restores a saved iterator state into the first pass's
    iterator, returning None or why it could not: input_state.py), the first pass
    continues from that state; otherwise it skips `start_position` batches, so a
    deterministic dataset (the same batches in the same order in a fresh process)
    neither repeats nor skips a sample.
    """

    def __init__(
        self,
        dataset: tf.data.Dataset,
        steps_per_epoch: int | None,
        start_position: int = 0,
        passes: ReshuffledArrays | None = None,
        first_pass: int = 0,
        batches_per_pass: int | None = None,
        restore_input=None,
    ):
        if steps_per_epoch is not None and (
            isinstance(steps_per_epoch, bool)
            or not isinstance(steps_per_epoch, int)
            or steps_per_epoch < 1
        ):
            raise ValueError(
                f"steps_per_epoch must be a positive int or None. Received: {steps_per_epoch!r}"
            )
        self.dataset = dataset
        self.steps_per_epoch = steps_per_epoch
        self.position = start_position
        self._skip = start_position
        self._iterator = None
        self._passes = passes
        self.pass_index = first_pass
        self.batches_per_pass = batches_per_pass
        self._restore_input = restore_input
        self._unstarted = False  # the iterator was made before its pass (iterator_to_save)
        # Set by fit during its last epoch: no pass follows it, so none is made ahead.
        self.last_epoch = False

    def close(self) -> None:
        """Ends the current pass: its iterator is deleted off this thread
        (iterators.py: a deletion can wait seconds for tf.data's autotuning)."""
        release(self._iterator)
        self._iterator = None

    def iterator_to_save(self):
        """The iterator the next step reads from, whose state a checkpoint saves (None
        after fit's last pass: a pass made then would shift the seeds of the next fit's
        passes).

        Between passes the next pass's iterator is made now, and the next epoch reads from
        it: its state holds the dataset's seed generators as that pass draws from them (the
        state of an exhausted iterator restores them one pass ahead, measured)."""
        if self._iterator is None:
            if self.last_epoch:
                return None
            self._iterator = self._new_pass()
            self._unstarted = True
        return self._iterator

    def _new_pass(self):
        skip, self._skip = self._skip, 0
        self.position = skip
        dataset = self.dataset
        if self._passes is not None:  # shuffle: each pass in its own order
            dataset = self._passes.dataset(self.pass_index)
        self.pass_index += 1
        if self._restore_input is not None:  # a resumed pass: its iterator's saved state
            restore, self._restore_input = self._restore_input, None
            iterator = iter(dataset)
            why = restore(iterator)
            if why is None:
                return iterator
            logger.warning(
                "Could not restore the input pipeline's saved state (%s); skipping the %d "
                "batches already taken instead: a pipeline that reshuffles or draws random "
                "numbers resumes on other samples.",
                why,
                skip,
            )
            release(iterator)
        return iter(dataset.skip(skip) if skip else dataset)

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
        if self.steps_per_epoch is None and not self._unstarted:
            self.close()
        while self.steps_per_epoch is None or steps < self.steps_per_epoch:
            count = steps_per_call
            if self.steps_per_epoch is not None:
                count = min(count, self.steps_per_epoch - steps)
            fresh = self._iterator is None or self._unstarted
            self._unstarted = False
            if self._iterator is None:
                # A resumed pass that is already used up is not a fresh (empty) dataset.
                fresh = self._skip == 0
                self._iterator = self._new_pass()
            if self.batches_per_pass is not None:
                # As Keras: no step is begun (no batch callback) past a known end of data.
                count = min(count, self.batches_per_pass - self.position)
            ran, stop = 0, False
            if count > 0:
                try:
                    ran, stop = step_fn(steps, self._iterator, count)
                except (StopIteration, tf.errors.OutOfRangeError):
                    pass
            for _ in range(ran):
                steps += 1
                self.position += 1
                if after_step is not None:
                    after_step(steps - 1)
            if stop:
                return steps - first_step
            if ran == count > 0:
                continue
            # The data ran out.
            self.close()
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


def spec_probe(x, y, parse_fn, file_format, sample_weight=None) -> tf.data.Dataset:
    """A dataset with the element spec of fit's data, for building a model_fn's model or
    an unbuilt model: a Dataset as given, arrays cut to their first sample (not copied)."""
    if parse_fn is not None or file_format is not None:
        raise ValueError(
            "A model_fn or an unbuilt model is built from the data's element spec; with "
            "fit(files, parse_fn=...) call trainer.evaluate or fit on a tf.data.Dataset "
            "of the parsed records first."
        )
    if isinstance(x, tf.data.Dataset):
        return standardize_dataset(x)

    def first_sample(arrays):
        if arrays is None:
            return None
        return tree.map_structure(lambda a: np.asarray(a)[:1], arrays)

    return as_dataset(
        first_sample(x), first_sample(y), 1, sample_weight=first_sample(sample_weight)
    )
