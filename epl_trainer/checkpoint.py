"""Engine checkpoints: weights, optimizer slots and counters, published atomically.

Layout of `directory`:
  ckpt-<step>/            one complete checkpoint (TF checkpoint files + metadata.json)
  latest                  the name of the newest complete checkpoint (replaced atomically)

A checkpoint is written into a hidden temporary folder, renamed into place only when
complete, and published by atomically replacing `latest`; a process killed at any point
of a save leaves the previous checkpoint usable (`before_publish` lets tests stop the
process between writing and publishing). `metadata.json` records the size of every data
file, so a truncated file is reported by name instead of being read as garbage. Only
worker 0 writes; every worker restores (they share the folder). Nothing is unpickled:
tensors are read by TensorFlow's checkpoint reader and metadata is JSON.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence

import tensorflow as tf

FORMAT_VERSION = 1
_LATEST = "latest"
_METADATA = "metadata.json"
_PREFIX = "state"
_NAME = re.compile(r"ckpt-(\d+)")
_TEMP = re.compile(r"\.(tmp|old)-ckpt-\d+-(\d+)")

# Fault injection for tests: called with the temporary folder once every file of a
# checkpoint is written and before it is published (a test kills the process here).
before_publish: Callable[[str], None] | None = None


class CheckpointError(ValueError):
    """A missing, incomplete, corrupted or incompatible checkpoint."""


def save(
    directory: str,
    variables: Mapping[str, tf.Variable],
    metadata: dict,
    step: int,
    descriptions: Mapping[str, str] | None = None,
    keep_max: int | None = None,
) -> str:
    """Writes `variables` and `metadata` as checkpoint `ckpt-<step>`; returns its path.

    Keys should be positional and stable ("trainable/3"); `descriptions` (e.g. the
    variable paths) are stored beside them only to make error messages readable. After
    publishing, only the `keep_max` newest published checkpoints are kept (all if None).
    """
    if keep_max is not None and keep_max < 1:
        raise ValueError(f"keep_max must be >= 1 or None. Received: keep_max={keep_max}")
    descriptions = descriptions or {}
    os.makedirs(directory, exist_ok=True)
    _remove_stale_temporaries(directory)
    name = f"ckpt-{step}"
    final = os.path.join(directory, name)
    tmp = os.path.join(directory, f".tmp-{name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tf.train.Checkpoint(**_trackable_names(variables)).write(os.path.join(tmp, _PREFIX))
    shapes = {
        key: [list(v.shape), v.dtype.name, descriptions.get(key, key)]
        for key, v in variables.items()
    }
    files = {f: os.path.getsize(os.path.join(tmp, f)) for f in sorted(os.listdir(tmp))}
    record = {"format_version": FORMAT_VERSION, "step": step, "variables": shapes, "files": files}
    _write_atomically(os.path.join(tmp, _METADATA), json.dumps({**record, **metadata}, indent=1))
    if before_publish is not None:
        before_publish(tmp)
    # Re-saving a step (e.g. an unpublished leftover of a killed run): move the old folder
    # aside first so that the rename below is atomic, and delete it once published.
    old = None
    if os.path.exists(final):
        old = os.path.join(directory, f".old-{name}-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    _write_atomically(os.path.join(directory, _LATEST), name)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if keep_max is not None:
        _delete_old(directory, step, keep_max)
    return final


def list_checkpoints(directory: str) -> list[int]:
    """Steps of the `ckpt-<step>` folders in `directory`, oldest first."""
    if not os.path.isdir(directory):
        return []
    steps = [_NAME.fullmatch(n) for n in os.listdir(directory)]
    return sorted(int(m.group(1)) for m in steps if m)


def exists(directory: str) -> bool:
    """Whether `directory` has a published checkpoint (its `latest` pointer exists)."""
    return os.path.isfile(os.path.join(directory, _LATEST))


def latest(directory: str) -> str:
    """Path of the newest complete checkpoint in `directory`."""
    pointer = os.path.join(directory, _LATEST)
    if not os.path.isfile(pointer):
        raise CheckpointError(f"No checkpoint in {directory!r}: {pointer!r} does not exist.")
    try:
        with open(pointer, encoding="utf-8") as f:
            name = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"Checkpoint pointer {pointer!r} is unreadable: {e}") from e
    if not _NAME.fullmatch(name):
        raise CheckpointError(
            f"Checkpoint pointer {pointer!r} is corrupted: it should name a 'ckpt-<step>' "
            f"folder. Received: {name[:80]!r}"
        )
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
        with open(metadata_path, encoding="utf-8") as f:
            metadata = json.load(f)
    except FileNotFoundError as e:
        raise CheckpointError(
            f"Checkpoint {path!r} is incomplete: {metadata_path!r} is missing."
        ) from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"Checkpoint metadata {metadata_path!r} is corrupted: {e}") from e
    if not isinstance(metadata, dict) or metadata.get("format_version") != FORMAT_VERSION:
        version = metadata.get("format_version") if isinstance(metadata, dict) else None
        raise CheckpointError(
            f"{metadata_path!r} has format_version {version!r}; this "
            f"version of epl_trainer reads {FORMAT_VERSION}."
        )
    _check_files(path, metadata.get("files", {}))
    _check_compatible(path, metadata.get("variables", {}), expected, descriptions or {})
    try:
        reader = tf.train.load_checkpoint(os.path.join(path, _PREFIX))
        names = _trackable_names(expected)
        values = {
            key: reader.get_tensor(f"{names_key}/.ATTRIBUTES/VARIABLE_VALUE")
            for names_key, key in zip(names, expected)
        }
    except (tf.errors.OpError, ValueError, IndexError, OSError) as e:
        data_files = [os.path.join(path, f) for f in sorted(os.listdir(path)) if _PREFIX in f]
        raise CheckpointError(
            f"Checkpoint data {data_files} is unreadable (truncated or corrupted): "
            f"{str(e).strip().splitlines()[0]}"
        ) from e
    return values, metadata


def _check_files(path: str, sizes: Mapping[str, int]) -> None:
    """Every data file the checkpoint was written with exists, with its written size."""
    for name, size in sizes.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"Checkpoint file {file!r} is missing.")
        actual = os.path.getsize(file)
        if actual != size:
            raise CheckpointError(
                f"Checkpoint file {file!r} is truncated or corrupted: it has {actual} bytes, "
                f"{size} were written."
            )


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


def _delete_old(directory: str, newest: int, keep_max: int) -> None:
    """Deletes published checkpoints older than the `keep_max` newest (up to `newest`)."""
    published = [s for s in list_checkpoints(directory) if s <= newest]
    for step in published[:-keep_max]:
        shutil.rmtree(os.path.join(directory, f"ckpt-{step}"), ignore_errors=True)


def _remove_stale_temporaries(directory: str) -> None:
    """Removes the temporary folders of saves whose process is gone (killed mid-save)."""
    for name in os.listdir(directory):
        match = _TEMP.fullmatch(name)
        if match and not _process_alive(int(match.group(2))):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _trackable_names(variables: Mapping[str, tf.Variable]) -> dict[str, tf.Variable]:
    # tf.train.Checkpoint attribute names must be identifiers; keys map in order.
    return {f"v{i}": v for i, v in enumerate(variables.values())}


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
