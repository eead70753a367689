"""The input pipeline's state in a checkpoint (`checkpoint.input_state`).

A resumed run used to skip the batches already taken, which resumes on the same samples
only when the pipeline gives the same batches in a fresh process: a `shuffle` with
`reshuffle_each_iteration` draws each pass's order from a seed generator that a fresh
process starts over, so it resumed on other samples. TensorFlow can save a tf.data
iterator's state (its position, shuffle buffers, and the dataset's seed generators,
which the next passes draw from: measured here, a pass restored mid-way and the pass
after it both come out in the uninterrupted run's order). Each worker writes its
iterator's state beside its shard (`input-<w>.index` / `.data-*`, a TF checkpoint) and
restores it into the first iterator of the resumed run.

A pipeline TensorFlow cannot save (a Python generator, a PyDataset, a map with stateful
random ops such as `tf.random.uniform`: use `tf.random.stateless_*` with seeds from
`tf.data.Dataset.random`) gets the record of why; its resume skips batches and says so.
"""

from __future__ import annotations

import tensorflow as tf

PREFIX = "input-{worker}"  # inside the checkpoint folder

_ERRORS = (tf.errors.OpError, ValueError, TypeError, AttributeError, NotImplementedError)


def save(saver: tf.train.Checkpoint, prefix: str) -> str | None:
    """Writes the state of the iterator `saver` tracks (`EpochBatches.input_saver`) at
    `prefix`; None, or why it cannot be saved."""
    try:
        saver.write(prefix)
    except _ERRORS as error:
        return _first_line(error)
    return None


def restore(iterator, prefix: str) -> str | None:
    """Restores `iterator` (fresh, of the same pipeline) from `prefix`; None, or why not."""
    try:
        tf.train.Checkpoint(iterator=iterator).read(prefix).assert_consumed()
    except (*_ERRORS, AssertionError) as error:
        return _first_line(error)
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
