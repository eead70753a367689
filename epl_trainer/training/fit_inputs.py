"""The arguments of `fit` / `evaluate` / `predict` with Keras's meaning.

What `keras.Model`'s trainer and data adapters do with `validation_split`,
`validation_data`, `class_weight`, `validation_freq`, `initial_epoch`, `verbose`,
callbacks and `evaluate`'s return value, for `EPLTrainer`: pure functions of the
arguments, so the trainer's loops stay short. Sample and class weights become one
float32 weight per sample, on the host, in tf.data (the form the engine takes).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import keras
import numpy as np
import tensorflow as tf
from keras import tree

logger = logging.getLogger(__name__)

# ---- unpacking and splitting the data -----------------------------------------------


def unpack_x_y_sample_weight(data):
    """`(x, y, sample_weight)` of `validation_data`: a Dataset (or other single object)
    is `(data, None, None)`; a tuple or list has 1 to 3 parts (Keras's
    `keras.utils.unpack_x_y_sample_weight`)."""
    if isinstance(data, list):
        data = tuple(data)
    if not isinstance(data, tuple):
        return data, None, None
    if 1 <= len(data) <= 3:
        return (*data, *([None] * (3 - len(data))))
    raise ValueError(
        "validation_data must be a tf.data.Dataset or a tuple (x, y) or (x, y, "
        f"sample_weight). Received: a tuple of {len(data)} parts"
    )


def train_validation_split(x, y, sample_weight, validation_split):
    """The first `1 - validation_split` of the samples for training and the rest for
    validation, before any shuffling (Keras's `train_validation_split`): returns
    `((x, y, sample_weight), (x, y, sample_weight))`."""
    if not isinstance(validation_split, (int, float)) or not 0 < validation_split < 1:
        raise ValueError(
            f"validation_split must be a float in (0, 1). Received: {validation_split!r}"
        )
    arrays = (x, y, sample_weight)
    flat = [a for a in tree.flatten(arrays) if a is not None]
    unsplittable = sorted({type(a).__name__ for a in flat if not hasattr(a, "shape")})
    if isinstance(x, tf.data.Dataset) or unsplittable or not flat:
        kind = type(x).__name__ if isinstance(x, tf.data.Dataset) else unsplittable
        raise ValueError(
            "validation_split is only supported for NumPy arrays (and tensors); split a "
            f"Dataset yourself and pass validation_data. Received: x of type {kind}"
        )
    total = int(flat[0].shape[0])
    split_at = math.floor(total * (1.0 - validation_split))
    if split_at in (0, total):
        raise ValueError(
            f"Training data contains {total} samples, which is not sufficient to split it "
            f"into a validation and training set as specified by validation_split="
            f"{validation_split}. Either provide more data, or a different value for "
            "validation_split."
        )

    def cut(start, end):
        return tuple(
            None if a is None else tree.map_structure(lambda t: np.asarray(t)[start:end], a)
            for a in arrays
        )

    return cut(0, split_at), cut(split_at, total)


# ---- class weights --------------------------------------------------------------------


def _checked_class_weight(class_weight, y, sample_weight) -> None:
    if not isinstance(class_weight, Mapping):
        raise TypeError(
            "class_weight must be a dict {class index: weight}. Received: "
            f"{type(class_weight).__name__}"
        )
    if sample_weight is not None:
        raise ValueError("You cannot `class_weight` and `sample_weight` at the same time.")
    if tree.is_nested(y):
        raise ValueError("`class_weight` is only supported for Models with a single output.")


def class_weight_to_sample_weights(y, class_weight: Mapping) -> np.ndarray:
    """One weight per sample from its class: the argmax of one-hot labels, else the
    rounded label (Keras's `class_weight_to_sample_weights`); unlisted classes weigh 1."""
    labels = np.asarray(y)
    if labels.ndim > 1:
        labels = np.argmax(labels, axis=-1) if labels.shape[-1] != 1 else labels[..., 0]
    labels = np.round(labels).astype("int32")
    return np.array([class_weight.get(int(c), 1.0) for c in labels], dtype=np.float32)


def class_weight_map_fn(class_weight: Mapping):
    """The `Dataset.map` function that adds each sample's class weight to `(x, y)`
    batches (Keras's `make_class_weight_map_fn`): classes above the largest key are
    an error, as in Keras."""
    table = tf.constant(
        [float(class_weight.get(c, 1.0)) for c in range(max(class_weight) + 1)], tf.float32
    )

    def add_weights(*element):
        if len(element) != 2 or tree.is_nested(element[1]):
            raise ValueError(
                "class_weight needs a dataset of (features, labels) with one label tensor "
                "(you cannot `class_weight` and `sample_weight` at the same time). "
                f"Received: an element of {len(element)} parts"
            )
        x, y = element
        if y.shape.rank >= 2:
            classes = tf.cond(
                tf.shape(y)[-1] > 1,
                lambda: tf.argmax(y, axis=-1, output_type=tf.int32),
                lambda: tf.cast(tf.round(tf.squeeze(y, axis=-1)), tf.int32),
            )
        else:
            classes = tf.cast(tf.round(y), tf.int32)
        return x, y, tf.gather(table, classes)

    return add_weights


def with_class_weight(x, y, sample_weight, class_weight):
    """`(x, sample_weight)` with the class weights as the sample weights: computed from
    the labels for arrays, mapped onto the batches of a Dataset."""
    if class_weight is None:
        return x, sample_weight
    if isinstance(x, tf.data.Dataset):
        _checked_class_weight(class_weight, None, None)
        return x.map(class_weight_map_fn(class_weight)), None
    _checked_class_weight(class_weight, y, sample_weight)
    return x, class_weight_to_sample_weights(y, class_weight)


# ---- epochs, validation, verbosity ---------------------------------------------------


def check_epochs(epochs, initial_epoch) -> None:
    """`epochs` and `initial_epoch` are ints >= 0 (checked before any callback runs)."""
    for name, value in (("epochs", epochs), ("initial_epoch", initial_epoch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0. Received: {name}={value!r}")


def epoch_range(epochs: int, initial_epoch: int, epochs_done: int, start: str) -> range:
    """The epochs `fit` runs, numbered as callbacks see them.

    `start` says where the count comes from:
    - "given": as Keras, epochs `initial_epoch .. epochs - 1` (a second `fit(epochs=2)`
      runs epochs 0 and 1 again);
    - "resumed" (from `checkpoint.dir`) or "restored" (`restore_checkpoint(...)`, then
      fit): the checkpoint's count is the initial epoch and `epochs` the final one, as
      Keras documents `epochs` with `initial_epoch` and as its BackupAndRestore resumes:
      the run finishes the interrupted epoch and goes on to epoch `epochs`, ending where
      the uninterrupted run ends. To train further, pass a larger `epochs`.
    """
    if start in ("resumed", "restored"):
        return range(epochs_done, epochs)
    return range(initial_epoch, epochs)


def should_validate(epoch: int, validation_freq) -> bool:
    """Keras's `validation_freq`: every n-th epoch (an int) or the listed epochs,
    counted from 1."""
    epoch += 1
    if isinstance(validation_freq, int) and not isinstance(validation_freq, bool):
        if validation_freq < 1:
            raise ValueError(
                f"validation_freq must be an int >= 1 or a list of epochs. Received: "
                f"validation_freq={validation_freq}"
            )
        return epoch % validation_freq == 0
    if isinstance(validation_freq, (list, tuple)):
        return epoch in validation_freq
    raise ValueError(
        "Expected `validation_freq` to be a list or int. Received: "
        f"validation_freq={validation_freq!r} of the type {type(validation_freq)}."
    )


def verbosity(verbose) -> int:
    """Keras's "auto" is 1 (a progress bar) for a trainer like this one."""
    return 1 if verbose == "auto" else verbose


# ---- callbacks and logs ---------------------------------------------------------------


def callback_list(callbacks, model, verbose, *, epochs=1, steps=None, add_history=False):
    """A `keras.callbacks.CallbackList` with the params Keras gives (verbose, epochs,
    steps), or the list given (fit's, when it runs the validation)."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    return keras.callbacks.CallbackList(
        callbacks,
        add_history=add_history,
        add_progbar=verbose != 0,
        model=model,
        verbose=verbose,
        epochs=epochs,
        steps=steps,
    )


def has_batch_hooks(callbacks: keras.callbacks.CallbackList, mode: str) -> bool:
    """Whether a callback other than the progress bar and history implements
    `on_<mode>_batch_begin/end`: then every batch gets its calls, as in Keras; without one
    the trainer runs many batches per call and calls them once per call."""
    quiet = (keras.callbacks.ProgbarLogger, keras.callbacks.History)
    return any(
        implements_batch_hooks(callback, mode)
        for callback in callbacks.callbacks
        if not isinstance(callback, quiet)
    )


def implements_batch_hooks(callback: keras.callbacks.Callback, mode: str) -> bool:
    """Whether `callback` overrides Keras's empty `on_<mode>_batch_begin/end`."""
    names = [f"on_{mode}_batch_begin", f"on_{mode}_batch_end"]
    if mode == "train":  # Keras's defaults call the older aliases
        names += ["on_batch_begin", "on_batch_end"]
    return any(not getattr(getattr(callback, name), "_is_default", False) for name in names)


def may_set_weights(callbacks: keras.callbacks.CallbackList, hook: str) -> bool:
    """Whether a callback may set the model's weights in `hook` (e.g. "on_epoch_end"):
    one that sets weights (`_SETS_WEIGHTS`), or any other callback implementing the hook
    that is not known to leave them alone."""
    for callback in callbacks.callbacks:
        if getattr(getattr(callback, hook), "_is_default", False):
            continue
        if isinstance(callback, _SETS_WEIGHTS) or not _leaves_weights_alone(callback):
            return True
    return False


def at_most(dataset: tf.data.Dataset, steps) -> tf.data.Dataset:
    """The dataset's first `steps` batches (all of them for None)."""
    if steps is None:
        return dataset
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int or None. Received: steps={steps!r}")
    return dataset.take(steps)


def num_batches(dataset: tf.data.Dataset) -> int | None:
    """Batches in one pass of the dataset, None if unknown or infinite (Keras's count
    for the progress bar and callbacks' `params["steps"]`)."""
    count = int(dataset.cardinality())
    return count if count >= 0 else None


def log_value(value):
    """A log entry as Keras gives it to callbacks (`pythonify_logs`): a float for a
    scalar, the numpy array otherwise (e.g. `F1Score`'s per-class scores)."""
    array = np.asarray(value)
    return float(array) if array.ndim == 0 else array


def flatten_logs_in_order(logs: dict, metric_names: Sequence[str]):
    """`evaluate`'s value without `return_dict`, as Keras's `_flatten_metrics_in_order`:
    the loss and metrics in the model's order, then any other logs by name; a single
    value on its own."""
    results = [logs[name] for name in metric_names if name in logs]
    results += [logs[key] for key in sorted(logs) if key not in metric_names]
    return results[0] if len(results) == 1 else results


# Keras's callbacks by what they do with the model's weights. The engine holds the
# weights: it writes them to the Keras model only where a callback may read them, and
# reloads them from it only where one may set them. A callback of its own that only reads
# logs says so with `reads_logs_only = True` (as the DeepSpeed monitors do).
_LOGS_ONLY = (
    keras.callbacks.ProgbarLogger,
    keras.callbacks.History,
    keras.callbacks.CSVLogger,
    keras.callbacks.TerminateOnNaN,
    keras.callbacks.ReduceLROnPlateau,
    keras.callbacks.LearningRateScheduler,
    keras.callbacks.RemoteMonitor,
    keras.callbacks.TensorBoard,  # batch summaries of the logs; weights at epoch end
)
# Read them at epoch end (restore_best_weights), set them at train end, after the
# engine's last write-back.
_READS_AT_EPOCH_END = (keras.callbacks.EarlyStopping,)
# Read them when they save (`save_freq`); BackupAndRestore sets them at train begin,
# after which the engine always reloads them.
_SAVERS = (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore)
_SETS_WEIGHTS = (keras.callbacks.SwapEMAWeights, keras.callbacks.LambdaCallback)


def _leaves_weights_alone(callback) -> bool:
    """Known to set no weights after train begin (it may read them)."""
    known = _LOGS_ONLY + _READS_AT_EPOCH_END + _SAVERS
    return isinstance(callback, known) or getattr(callback, "reads_logs_only", False)


def needs_fresh_weights_per_step(callback_list, mode: str = "train") -> bool:
    """Whether a callback may read (or set) the Keras model's variables in a batch hook
    of `mode` ("train", "test"): the engine then writes them back for those hooks, as
    Keras's model holds them (one copy of the weights per step), and takes back what
    the hooks set; else only at epoch ends. Says once per callback class which one
    asked, and how a callback that reads only its logs says so."""
    for callback in callback_list.callbacks:
        if isinstance(callback, _SAVERS) and mode == "train":
            if callback.save_freq != "epoch":
                return True
            continue
        if not _reads_no_weights_per_batch(callback) and implements_batch_hooks(callback, mode):
            _say_why_weights_go_back_per_step(type(callback))
            return True
    return False


def may_set_weights_at_batch_begin(callback_list) -> bool:
    """Whether a callback may set the Keras model's variables in `on_train_batch_begin`
    (or its alias `on_batch_begin`): the step then computes on what it set, as Keras's
    does, so the engine takes them back before the step."""
    names = ("on_train_batch_begin", "on_batch_begin")
    return any(
        not (isinstance(callback, _SAVERS) or _reads_no_weights_per_batch(callback))
        and any(not getattr(getattr(callback, name), "_is_default", False) for name in names)
        for callback in callback_list.callbacks
    )


def _reads_no_weights_per_batch(callback) -> bool:
    """Keras's log-only callbacks, those that read the model at epoch ends only, and a
    callback that says its batch hooks read only their logs."""
    return isinstance(callback, _LOGS_ONLY + _READS_AT_EPOCH_END) or getattr(
        callback, "reads_logs_only", False
    )


_ANNOUNCED_PER_STEP_WRITE_BACK: set = set()


def _say_why_weights_go_back_per_step(callback_class) -> None:
    # A write-back per step exchanges the weights when a replica's stages live on
    # several workers, which costs each step much (docs/benchmarks.md#write-back-per-step).
    if callback_class in _ANNOUNCED_PER_STEP_WRITE_BACK:
        return
    _ANNOUNCED_PER_STEP_WRITE_BACK.add(callback_class)
    logger.info(
        "EPLTrainer writes the weights back into the Keras model after every step: "
        "callback %s has batch hooks and may read them. If its batch hooks read only "
        "their logs, give the class `reads_logs_only = True` to write back at epoch "
        "ends only (a copy of every weight per step; with stages on several workers, a "
        "sum of the whole model over them).",
        callback_class.__name__,
    )
