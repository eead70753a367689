"""Engine checkpoints: weights, optimizer slots and counters, published atomically.

Layout of `directory`:
  ckpt-<step>/            one complete checkpoint (TF checkpoint files + metadata.json)
  latest                  the name of the newest complete checkpoint (replaced atomically)

A checkpoint is written into a hidden temporary folder and renamed into place only when
complete, so a process killed while saving leaves the previous checkpoint usable. Only
worker 0 writes; every worker restores (they share the folder).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence

import tensorflow as tf

FORMAT_VERSION = 1
_LATEST = "latest"
_METADATA = "metadata.json"
_PREFIX = "state"


class CheckpointError(ValueError):
    """A missing, incomplete, corrupted or incompatible checkpoint."""


def save(
    directory: str,
    variables: Mapping[str, tf.Variable],
    metadata: dict,
    step: int,
    descriptions: Mapping[str, str] | None = None,
) -> str:
    """Writes `variables` and `metadata` as checkpoint `ckpt-<step>`; returns its path.

    Keys should be positional and stable ("trainable/3"); `descriptions` (e.g. the
    variable paths) are stored beside them only to make error messages readable.
    """
    descriptions = descriptions or {}
    os.makedirs(directory, exist_ok=True)
    name = f"ckpt-{step}"
    final = os.path.join(directory, name)
    tmp = os.path.join(directory, f".tmp-{name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tf.train.Checkpoint(**_trackable_names(variables)).write(os.path.join(tmp, _PREFIX))
    shapes = {
        key: [list(v.shape), v.dtype.name, descriptions.get(key, key)]
        for key, v in variables.items()
    }
    with open(os.path.join(tmp, _METADATA), "w") as f:
        json.dump(
            {"format_version": FORMAT_VERSION, "step": step, "variables": shapes, **metadata},
            f,
            indent=1,
        )
    if os.path.exists(final):  # re-saving the same step: replace it as a whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_atomically(os.path.join(directory, _LATEST), name)
    return final


def latest(directory: str) -> str:
    """Path of the newest complete checkpoint in `directory`."""
    pointer = os.path.join(directory, _LATEST)
    if not os.path.isfile(pointer):
        raise CheckpointError(f"No checkpoint in {directory!r}: {pointer!r} does not exist.")
    with open(pointer) as f:
        name = f.read().strip()
    path = os.path.join(directory, name)
    if not os.path.isdir(path):
        raise CheckpointError(f"{pointer!r} names {name!r}, which does not exist in {directory!r}.")
    return path


def load(
    path: str, expected: Mapping[str, tf.Variable], descriptions: Mapping[str, str] | None = None
) -> tuple[dict, dict]:
    """Reads a checkpoint and checks it against the variables it must fill.

    Returns:
      (values by key, metadata). Raises CheckpointError naming the file or variable.
    """
    metadata_path = os.path.join(path, _METADATA)
    try:
        with open(metadata_path) as f:
            metadata = json.load(f)
    except FileNotFoundError as e:
        raise CheckpointError(
            f"Checkpoint {path!r} is incomplete: {metadata_path!r} is missing."
        ) from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"Checkpoint metadata {metadata_path!r} is corrupted: {e}") from e
    if metadata.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{metadata_path!r} has format_version {metadata.get('format_version')!r}; this "
            f"version of epl_trainer reads {FORMAT_VERSION}."
        )
    _check_compatible(path, metadata.get("variables", {}), expected, descriptions or {})
    try:
        reader = tf.train.load_checkpoint(os.path.join(path, _PREFIX))
        names = _trackable_names(expected)
        values = {
            key: reader.get_tensor(f"{names_key}/.ATTRIBUTES/VARIABLE_VALUE")
            for names_key, key in zip(names, expected)
        }
    except (tf.errors.OpError, ValueError, IndexError, OSError) as e:
        raise CheckpointError(
            f"Checkpoint data in {path!r} is unreadable (truncated or corrupted): "
            f"{str(e).splitlines()[0]}"
        ) from e
    return values, metadata


def _check_compatible(path: str, saved: Mapping[str, Sequence], expected, descriptions) -> None:
    missing = [descriptions.get(k, k) for k in expected if k not in saved]
    extra = [saved[k][2] for k in saved if k not in expected]
    if missing or extra:
        raise CheckpointError(
            f"Checkpoint {path!r} was written for a different model or optimizer: it holds "
            f"{len(saved)} variables, this trainer has {len(expected)}. "
            f"Not in the checkpoint: {missing[:5]}; only in the checkpoint: {extra[:5]}"
        )
    for key, variable in expected.items():
        shape, dtype, saved_name = saved[key]
        if list(variable.shape) != list(shape) or variable.dtype.name != dtype:
            raise CheckpointError(
                f"Checkpoint {path!r} was written for a different model: it holds {saved_name!r} "
                f"with shape {shape} {dtype}, where this model has "
                f"{descriptions.get(key, key)!r} with shape {list(variable.shape)} "
                f"{variable.dtype.name}."
            )


def _trackable_names(variables: Mapping[str, tf.Variable]) -> dict[str, tf.Variable]:
    # tf.train.Checkpoint attribute names must be identifiers; keys map in order.
    return {f"v{i}": v for i, v in enumerate(variables.values())}


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
