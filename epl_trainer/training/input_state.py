"""The input pipeline's state in a checkpoint (`checkpoint.input_state`).

A resumed run used to skip the batches already taken, which resumes on the same samples
only when the pipeline gives the same batches in a fresh process: a `shuffle` with
`reshuffle_each_iteration` draws each pass's order from a seed generator that a fresh
process starts over, so it resumed on other samples. TensorFlow can save a tf.data
iterator's state (its position, shuffle buffers, and the dataset's seed generators,
which the next passes draw from: measured here, a pass restored mid-way and the pass
after it both come out in the uninterrupted run's order).

Each worker takes its iterator's state as bytes when a save is taken (`capture`) and
stores them in its shard file, hashed like every entry (checkpoint.write_shard); the
resumed run's first iterator gets them back (`restore`). The bytes are TensorFlow's
serialized iterator state, one serialized tensor per element of its state vector (as
`OwnedIterator._save` serializes it, so no element meets protobuf's 2 GB limit), each
preceded by its length. Through a TensorFlow checkpoint of the iterator, as saves did
before (`input-<w>.index` / `.data-*` beside the shard, still restored by
`restore_checkpoint`), the state cost 3.5 ms per save on the training thread in
bench/checkpoint.py (its files written one by one), against 0.7 ms taken as bytes; with a
shuffle buffer of 256 rows of 512 floats, 18.1 against 10.3 ms (a busy machine).

A pipeline TensorFlow cannot save (a Python generator, a PyDataset, a map with stateful
random ops such as `tf.random.uniform`: use `tf.random.stateless_*` with seeds from
`tf.data.Dataset.random`) gets the record of why; its resume skips batches and says so.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

_ERRORS = (tf.errors.OpError, ValueError, TypeError, AttributeError, NotImplementedError)
_LENGTH = np.dtype("<u8")  # each part's byte count, before it


def capture(iterator) -> np.ndarray | str:
    """The state of `iterator` (a tf.data iterator) as bytes (a uint8 array), or why it
    cannot be saved. The dataset's `experimental_external_state_policy` applies, as in a
    TensorFlow checkpoint of the iterator."""
    try:
        state = iterator._serialize_to_tensors()["_STATE"]  # the Trackable save of it
        parts = [tf.io.serialize_tensor(part).numpy() for part in tf.unstack(state)]
    except _ERRORS as error:
        return _first_line(error)
    framed = bytearray()
    for part in parts:
        framed += np.array(len(part), dtype=_LENGTH).tobytes() + part
    return np.frombuffer(bytes(framed), dtype=np.uint8)


def restore(iterator, state: np.ndarray) -> str | None:
    """Restores `iterator` (fresh, of the same pipeline) from `capture`'s bytes; None, or
    why not."""
    try:
        parts = [tf.io.parse_tensor(part, tf.variant) for part in _split(state.tobytes())]
        iterator._restore_from_tensors({"_STATE": tf.stack(parts)})
    except _ERRORS as error:
        return _first_line(error)
    return None


def restore_checkpoint(iterator, prefix: str) -> str | None:
    """Restores `iterator` from a TensorFlow checkpoint of it at `prefix`, which saves
    wrote before the state went into the shard; None, or why not."""
    try:
        tf.train.Checkpoint(iterator=iterator).read(prefix).assert_consumed()
    except (*_ERRORS, AssertionError) as error:
        return _first_line(error)
    return None


def _split(data: bytes) -> list[bytes]:
    parts, at = [], 0
    while at < len(data):
        if at + _LENGTH.itemsize > len(data):
            raise ValueError(f"the saved input state ends inside a length ({len(data)} bytes)")
        length = int(np.frombuffer(data, dtype=_LENGTH, count=1, offset=at)[0])
        at += _LENGTH.itemsize
        if at + length > len(data):
            raise ValueError(
                f"the saved input state ends inside a part ({length} bytes at {at} of {len(data)})"
            )
        parts.append(data[at : at + length])
        at += length
    if not parts:
        raise ValueError("the saved input state is empty")
    return parts


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
