"""Engine checkpoints: one shard per worker, one manifest, published atomically.

Layout of `directory` (any `tf.io.gfile` path: local, gs://, ...):
  ckpt-<step>/              one complete checkpoint:
    shard-<w>.bin           worker w's entries: raw bytes at aligned offsets (shard_file.py;
                            format 2 wrote TF tensor bundles, shard-<w>.index/.data-*)
    shard-<w>.json          what worker w wrote: entries (offset, size, hash), file sizes
    manifest.json           written last: every entry, its shard, shape and dtype, the
                            file sizes, and where training stood (epoch, input position)
  latest                    the name of the newest complete checkpoint (replaced atomically)

A checkpoint's tag (DeepSpeed's word) is its folder name: `ckpt-<step>`, or the tag a
save was given (`publish(tag=...)`: kept by `keep_max`, which deletes only `ckpt-<step>`
folders); `tagged` also takes the step number.

A save writes into a hidden temporary folder `.tmp-ckpt-<step>-<chief pid>` that every
worker agrees on: each worker writes its shard there (`write_shard`); once every worker
has written (the trainer's barrier), the chief checks every shard, writes the manifest
(`publish`), moves the folder into place and only then replaces `latest`. A process
killed at any point, or a worker that could not write, leaves `latest` naming the
previous checkpoint (`before_publish` lets tests stop the chief between the manifest and
publishing). Entries are keyed by the user's model (core/engine/checkpoint_content.py),
so a checkpoint restores into any layout; each worker reads only the entries it needs
(`read_entries`). Nothing is unpickled: tensors are bytes at offsets (format 2:
read by TensorFlow's bundle reader) and the rest is JSON.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import tensorflow as tf

from epl_trainer.core.engine.checkpoint_content import PIECE_MARK, SLAB_MARK, entry_of
from epl_trainer.training import shard_file

FORMAT_VERSION = 3  # 3: raw shard files (shard_file.py); 2: TF tensor bundles, still read
_READABLE_VERSIONS = (2, 3)
_DATA = ".bin"
_SHARD_DATA = re.compile(r"shard-(\d+)\.bin")
MANIFEST = "manifest.json"
_OLD_METADATA = "metadata.json"  # format 1: one layout's positional keys
_LATEST = "latest"
_NAME = re.compile(r"ckpt-(\d+)")
# A tag a save may name its folder with (DeepSpeed's `save_checkpoint(save_dir, tag)`):
# not hidden (temporaries are), not a number (it would read as a step), not `latest`.
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_TEMP = re.compile(r"\.(tmp-ckpt-\d+|old-.+)-(\d+)")  # .old-<tag>-<pid>: a re-save's
gfile = tf.io.gfile
logger = logging.getLogger(__name__)

# Fault injection for tests: called with the temporary folder once every shard and the
# manifest are written and before it is published (a test kills the process here).
before_publish: Callable[[str], None] | None = None


class CheckpointError(ValueError):
    """A missing, incomplete, corrupted or incompatible checkpoint."""


def temporary_folder(directory: str, step: int, token: int) -> str:
    """The folder every worker writes step `step`'s shards into (`token`: the chief's pid)."""
    return _join(directory, f".tmp-ckpt-{step}-{token}")


def prepare(directory: str) -> None:
    """The chief, before a save: creates `directory`, removes dead saves' temporaries
    (named in a warning)."""
    gfile.makedirs(directory)
    for name in torn_saves(directory):
        logger.warning(
            "Removing %r from %r: a save that never finished (its process is gone); "
            "'latest' never named it.",
            name,
            directory,
        )
        gfile.rmtree(_join(directory, name))


def torn_saves(directory: str) -> list[str]:
    """The hidden temporaries of saves whose process is gone (killed mid-save): never a
    checkpoint, ignored by every restore."""
    if not gfile.isdir(directory):
        return []
    names = [name.rstrip("/") for name in gfile.listdir(directory)]
    return [
        name
        for name in names
        if (match := _TEMP.fullmatch(name)) and not _process_alive(int(match.group(2)))
    ]


def write_shard(
    folder: str,
    worker: int,
    entries: Iterable[tuple[str, str, tf.Tensor]],
    staging: shard_file.StagingBuffer | None = None,
    inputs: dict | None = None,
) -> None:
    """Writes worker `worker`'s entries [(key, readable name, value)] into its shard file
    (assembled in `staging`, a fresh buffer if None) and its record. `inputs`: the record
    of its input iterator's state (input_state.py); its "state" bytes go into the shard
    file after the entries, and the record says where."""
    gfile.makedirs(folder)
    entries = list(entries)
    inputs = dict(inputs) if inputs is not None else None
    arrays = [_as_array(value) for _, _, value in entries]
    if inputs is not None and "state" in inputs:
        arrays.append(inputs["state"])
    files, placed = {}, []
    if arrays:  # a worker may own nothing (data parallelism: lane 0's worker owns all)
        data = _join(folder, f"shard-{worker}{_DATA}")
        _take_spare(folder, worker, data)
        placed = shard_file.write(data, arrays, staging or shard_file.StagingBuffer())
        files[f"shard-{worker}{_DATA}"] = gfile.stat(data).length
    if inputs is not None and "state" in inputs:
        inputs["state"] = placed.pop()  # {"offset", "nbytes", "xxh3"} in the shard file
    record = {
        "worker": worker,
        "input": inputs,
        "files": files,
        "entries": {
            key: {"shape": list(value.shape), "dtype": _dtype_name(value), "name": name, **where}
            for (key, name, value), where in zip(entries, placed)
        },
    }
    _write_atomically(_join(folder, f"shard-{worker}.json"), json.dumps(record, indent=1))


def _as_array(value) -> np.ndarray:
    # A read-only view of a CPU tensor's buffer (`.numpy()` copies: 4.5 ms per 16 MB here);
    # shard_file copies it once, into the staging buffer.
    return np.asarray(value)


def _dtype_name(value) -> str:
    return tf.as_dtype(value.dtype).name


def publish(
    directory: str,
    folder: str,
    step: int,
    num_shards: int,
    metadata: dict,
    required: Iterable[str] = (),
    keep_max: int | None = None,
    tag: str | None = None,
) -> str:
    """The chief, once every worker wrote its shard: checks them, writes the manifest,
    moves `folder` to `tag` (default `ckpt-<step>`) and points `latest` at it. Returns
    its path.

    Raises CheckpointError (nothing published) when a shard is missing or incomplete, an
    entry was written twice, or a `required` entry is in no shard.
    """
    if keep_max is not None and keep_max < 1:
        raise ValueError(f"keep_max must be >= 1 or None. Received: keep_max={keep_max}")
    entries, shards = {}, {}
    for worker in range(num_shards):
        file = _join(folder, f"shard-{worker}.json")
        record = _read_json(file, f"Shard {worker} of {folder!r}", "shard record")
        _check_files(folder, record["files"])
        shards[f"shard-{worker}"] = {"files": record["files"]}
        if record.get("input") is not None:  # its input iterator's state (input_state.py)
            shards[f"shard-{worker}"]["input"] = record["input"]
        for key, entry in record["entries"].items():
            if key in entries:
                raise CheckpointError(
                    f"Entry {key!r} was written by two workers ({entries[key]['shard']} and "
                    f"shard-{worker}) into {folder!r}; not published."
                )
            entries[key] = {**entry, "shard": f"shard-{worker}"}
    held = {entry_of(key) for key in entries}  # whole, or in pieces or slabs
    missing = [key for key in required if key not in held]
    if missing:
        raise CheckpointError(
            f"No shard of {folder!r} holds {missing[:5]}; not published (an ownership bug)."
        )
    manifest = {
        "format": "epl_trainer",
        "format_version": FORMAT_VERSION,
        "step": step,
        "shards": shards,
        "entries": entries,
        **metadata,
    }
    _write_atomically(_join(folder, MANIFEST), json.dumps(manifest, indent=1))
    if before_publish is not None:
        before_publish(folder)
    name = check_tag(tag, step)
    final = _join(directory, name)
    _move_into_place(directory, folder, final, name)
    _sync_files(directory, ["."])  # the folder's new name, before `latest` names it
    _write_atomically(_join(directory, _LATEST), name)
    if keep_max is not None:
        _delete_old(directory, step, keep_max)
    return final


def _move_into_place(directory: str, folder: str, final: str, name: str) -> None:
    """Local folders are renamed at once (re-saving a step moves the old one aside first,
    so the rename is atomic); object stores have no folder rename, so files move one by
    one with the manifest last: a folder without a manifest is never a checkpoint."""
    if "://" not in directory:
        old = None
        if gfile.exists(final):
            old = _join(directory, f".old-{name}-{os.getpid()}")
            gfile.rename(final, old)
        gfile.rename(folder, final)
        if old is not None:
            gfile.rmtree(old)
        return
    if gfile.exists(final):
        gfile.rmtree(final)
    gfile.makedirs(final)
    names = [n for n in gfile.listdir(folder) if n != MANIFEST] + [MANIFEST]
    for n in names:
        gfile.rename(_join(folder, n), _join(final, n), overwrite=True)
    gfile.rmtree(folder)


def join_path(directory: str, name: str) -> str:
    """`directory`/`name`, for local folders and object stores alike."""
    return _join(directory, name)


def final_path(directory: str, step: int, tag: str | None = None) -> str:
    """Where a save of `step` tagged `tag` is published."""
    return _join(directory, check_tag(tag, step))


def check_tag(tag: str | None, step: int) -> str:
    """The folder name of a save of `step` tagged `tag` (None: `ckpt-<step>`)."""
    if tag is None:
        return f"ckpt-{step}"
    if not isinstance(tag, str) or not _TAG.fullmatch(tag) or tag == _LATEST or tag.isdigit():
        raise ValueError(
            "A checkpoint tag is a folder name of letters, digits, '_', '.' and '-' (not "
            f"starting with '.' or '-', not a number, not {_LATEST!r}). Received: tag={tag!r}"
        )
    match = _NAME.fullmatch(tag)
    if match and int(match.group(1)) != step:
        raise ValueError(
            f"Tag {tag!r} names step {match.group(1)}'s checkpoint; this save is of step "
            f"{step}. Received: tag={tag!r}"
        )
    return tag


def list_tags(directory: str) -> list[str]:
    """The tags of `directory`'s checkpoints: `ckpt-<step>` oldest first, then the folders
    a save was tagged with (those holding a manifest), by name."""
    if not gfile.isdir(directory):
        return []
    names = sorted(n.rstrip("/") for n in gfile.listdir(directory))
    other = [
        n
        for n in names
        if not _NAME.fullmatch(n)
        and _TAG.fullmatch(n)
        and n != _LATEST
        and gfile.exists(_join(directory, f"{n}/{MANIFEST}"))
    ]
    return [f"ckpt-{step}" for step in list_checkpoints(directory)] + other


def list_checkpoints(directory: str) -> list[int]:
    """Steps of the `ckpt-<step>` folders in `directory`, oldest first."""
    if not gfile.isdir(directory):
        return []
    steps = [_NAME.fullmatch(n.rstrip("/")) for n in gfile.listdir(directory)]
    return sorted(int(m.group(1)) for m in steps if m)


def exists(directory: str) -> bool:
    """Whether `directory` has a published checkpoint (its `latest` pointer exists)."""
    return gfile.exists(_join(directory, _LATEST))


def latest(directory: str) -> str:
    """Path of the newest complete checkpoint in `directory`."""
    pointer = _join(directory, _LATEST)
    if not gfile.exists(pointer):
        raise CheckpointError(f"No checkpoint in {directory!r}: {pointer!r} does not exist.")
    try:
        with gfile.GFile(pointer, "rb") as f:
            name = f.read().decode("utf-8").strip()
    except (tf.errors.OpError, UnicodeDecodeError) as e:
        raise CheckpointError(f"Checkpoint pointer {pointer!r} is unreadable: {e}") from e
    if not _TAG.fullmatch(name) or name == _LATEST or name.isdigit():
        raise CheckpointError(
            f"Checkpoint pointer {pointer!r} is corrupted: it should name a 'ckpt-<step>' "
            f"or tagged folder. Received: {name[:80]!r}"
        )
    path = _join(directory, name)
    if not gfile.isdir(path):
        raise CheckpointError(f"{pointer!r} names {name!r}, which does not exist in {directory!r}.")
    return path


def tagged(directory: str, tag: str | int) -> str:
    """Path of the checkpoint `tag` names in `directory`, as DeepSpeed's
    `load_checkpoint(load_dir, tag)`: a folder name of the listing (`"ckpt-100"`, or the
    tag a save was given) or the step a `ckpt-<step>` folder is named after (`100`).

    Raises CheckpointError listing the directory's tags when none is named `tag`.
    """
    if isinstance(tag, bool) or not isinstance(tag, (str, int)):
        raise TypeError(
            "A checkpoint tag is a folder name ('ckpt-<step>') or a step number. "
            f"Received: tag={tag!r} of type {type(tag).__name__}"
        )
    text = str(tag).strip()
    name = f"ckpt-{int(text)}" if text.isdigit() else text.rstrip("/")
    found = list_tags(directory)
    if name not in found:
        raise CheckpointError(
            f"No checkpoint tagged {tag!r} in {directory!r}. Its checkpoints: {found} "
            "(tag=<folder name> or its step number)."
        )
    return _join(directory, name)


def read_manifest(path: str) -> dict:
    """The manifest of checkpoint `path`; a clear CheckpointError for anything else."""
    manifest_path = _join(path, MANIFEST)
    if not gfile.exists(manifest_path) and gfile.exists(_join(path, _OLD_METADATA)):
        raise CheckpointError(
            f"Checkpoint {path!r} is in epl_trainer's checkpoint format 1 ({_OLD_METADATA}: "
            "lane 0's state under positional keys of the layout that wrote it). This "
            f"version reads formats 2 and 3 ({MANIFEST}: entries keyed by model "
            "variable, restorable into any layout); restore it with the version that "
            "wrote it."
        )
    manifest = _read_json(manifest_path, f"Checkpoint {path!r}", "manifest")
    version = manifest.get("format_version")
    if version not in _READABLE_VERSIONS or not isinstance(manifest.get("entries"), dict):
        raise CheckpointError(
            f"{manifest_path!r} has format_version {version!r}; this version of epl_trainer "
            f"reads formats {' and '.join(map(str, _READABLE_VERSIONS))}."
        )
    return manifest


def read_entries(path: str, manifest: dict, expected: Mapping, unexpected=()) -> dict:
    """Reads the `expected` entries {key: Expected (name, shape, dtype, optional)}.

    Only the shards holding them are opened (and size-checked). Raises CheckpointError
    naming the file or the variable when the checkpoint does not fit.
    """
    saved = manifest["entries"]
    pieces = _row_pieces(saved)  # key -> [(first row, end row, piece key)] of ZeRO pieces
    slabs = _slabs(saved)  # key -> (dimension, [(start, stop, slab key)]) of batch-axis slabs
    missing = [
        e.name
        for k, e in expected.items()
        if k not in saved and k not in pieces and k not in slabs and not e.optional
    ]
    if missing or unexpected:
        raise CheckpointError(
            f"Checkpoint {path!r} was written for a different model or optimizer: it holds "
            f"{len(saved)} entries. Not in the checkpoint: {missing[:5]}; only in the "
            f"checkpoint: {[saved[k]['name'] for k in unexpected][:5]}"
        )
    by_shard: dict[str, list[str]] = {}
    for key, entry in expected.items():
        if key in saved:
            _check_entry(path, saved[key], entry, entry.shape)
            by_shard.setdefault(saved[key]["shard"], []).append(key)
        elif key in pieces:
            _check_pieces_cover(path, pieces[key], entry)
            for start, stop, piece_key in pieces[key]:
                found = saved[piece_key]
                if int(np.prod(found["shape"])) != stop - start:
                    raise CheckpointError(
                        f"Checkpoint {path!r} holds {found['name']!r} with shape "
                        f"{found['shape']}, not the {stop - start} elements its key names."
                    )
                _check_entry(path, found, entry, found["shape"])
                by_shard.setdefault(found["shard"], []).append(piece_key)
        elif key in slabs:
            dim, found_slabs = slabs[key]
            _check_slabs_cover(path, dim, found_slabs, entry)
            for start, stop, slab in found_slabs:
                shape = list(entry.shape)
                shape[dim] = stop - start
                _check_entry(path, saved[slab], entry, shape)
                by_shard.setdefault(saved[slab]["shard"], []).append(slab)
    values = {}
    for shard, keys in sorted(by_shard.items()):
        files = manifest["shards"][shard]["files"]
        _check_files(path, files)
        if manifest["format_version"] >= 3:
            values.update(_read_shard_file(path, shard, {k: saved[k] for k in keys}))
            continue
        try:  # format 2: a TF tensor bundle
            with tf.device("/CPU:0"):
                read = tf.raw_ops.RestoreV2(
                    prefix=_join(path, shard),
                    tensor_names=keys,
                    shape_and_slices=[""] * len(keys),
                    dtypes=[tf.as_dtype(saved[key]["dtype"]) for key in keys],
                )
            values.update({key: value.numpy() for key, value in zip(keys, read)})
        except (tf.errors.OpError, ValueError, IndexError, OSError) as e:
            names = [_join(path, f) for f in sorted(files)]
            raise CheckpointError(
                f"Checkpoint data {names} is unreadable (truncated or corrupted): "
                f"{str(e).strip().splitlines()[0]}"
            ) from e
    for key, entry in expected.items():
        if key not in saved and key in pieces:  # elements joined, in order
            flat = [np.reshape(values.pop(k), [-1]) for _, _, k in pieces[key]]
            values[key] = np.reshape(np.concatenate(flat), entry.shape)
        elif key not in saved and key in slabs:  # slabs joined along their dimension
            dim, found_slabs = slabs[key]
            values[key] = np.concatenate([values.pop(k) for _, _, k in found_slabs], axis=dim)
    return values


@dataclasses.dataclass(frozen=True)
class _Saved:
    """An entry as the manifest records it (read_all wants every entry as saved)."""

    name: str
    shape: list
    dtype: str
    optional: bool = False


def read_all(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(manifest, {key: value}) of every entry of checkpoint `path` as it was saved (a
    ZeRO piece as its piece): for tools and tests that read a checkpoint without building
    a model. Every value is checked against its hash."""
    manifest = read_manifest(path)
    saved = {
        key: _Saved(entry["name"], entry["shape"], entry["dtype"])
        for key, entry in manifest["entries"].items()
    }
    return manifest, read_entries(path, manifest, saved)


def read_input_state(path: str, worker: int, where: Mapping) -> np.ndarray:
    """Worker `worker`'s input iterator state saved in checkpoint `path`'s shard (`where`:
    its {"offset", "nbytes", "xxh3"}), checked against its hash."""
    entry = {**where, "shape": [where["nbytes"]], "dtype": "uint8", "name": "input state"}
    return _read_shard_file(path, f"shard-{worker}", {"input": entry})["input"]


def _read_shard_file(path: str, shard: str, entries: dict) -> dict:
    file = _join(path, f"{shard}{_DATA}")
    try:
        return shard_file.read(file, entries)
    except (shard_file.ShardFileError, tf.errors.OpError, ValueError, OSError) as e:
        raise CheckpointError(
            f"Checkpoint data {file!r} is corrupted: {str(e).strip().splitlines()[0]}"
        ) from e


def _row_pieces(saved: Mapping) -> dict[str, list[tuple[int, int, str]]]:
    pieces: dict[str, list[tuple[int, int, str]]] = {}
    for key in saved:
        base, mark, rows = key.partition(PIECE_MARK)
        if mark:
            start, _, stop = rows.partition(":")
            pieces.setdefault(base, []).append((int(start), int(stop), key))
    return {base: sorted(found) for base, found in pieces.items()}


def _slabs(saved: Mapping) -> dict[str, tuple[int, list[tuple[int, int, str]]]]:
    """{entry: (dimension, [(start, stop, slab key)] in order)} of the slabs saved."""
    found: dict[str, tuple[int, list]] = {}
    for key in saved:
        entry, mark, rest = key.partition(SLAB_MARK)
        if not mark:
            continue
        dim, _, span = rest.partition("=")
        start, _, stop = span.partition(":")
        dims_and_slabs = found.setdefault(entry, (int(dim), []))
        if dims_and_slabs[0] != int(dim):
            raise CheckpointError(
                f"Checkpoint entry {entry!r} is saved in slabs along two dimensions: "
                f"{dims_and_slabs[0]} and {dim}."
            )
        dims_and_slabs[1].append((int(start), int(stop), key))
    return {entry: (dim, sorted(slabs)) for entry, (dim, slabs) in found.items()}


def _check_slabs_cover(path: str, dim: int, found: list, entry) -> None:
    """The slabs of an entry cover its dimension `dim` exactly once, in order."""
    size = int(entry.shape[dim])
    edges = [0] + [edge for start, stop, _ in found for edge in (start, stop)] + [size]
    if any(a != b for a, b in zip(edges[::2], edges[1::2])):
        raise CheckpointError(
            f"Checkpoint {path!r} holds slabs of {entry.name!r} that do not cover its "
            f"dimension {dim} ({size}) once: {[(a, b) for a, b, _ in found]}"
        )


def _check_entry(path: str, found: dict, entry, shape) -> None:
    dtype = tf.as_dtype(entry.dtype).name
    if list(found["shape"]) != list(shape) or found["dtype"] != dtype:
        raise CheckpointError(
            f"Checkpoint {path!r} was written for a different model: it holds "
            f"{found['name']!r} with shape {found['shape']} {found['dtype']}, where this "
            f"model has {entry.name!r} with shape {list(shape)} {dtype}."
        )


def _check_pieces_cover(path: str, found: list, entry) -> None:
    """The pieces of an entry cover its elements exactly once, in order."""
    size = int(np.prod(entry.shape))
    edges = [0] + [edge for start, stop, _ in found for edge in (start, stop)] + [size]
    if any(a != b for a, b in zip(edges[::2], edges[1::2])):
        raise CheckpointError(
            f"Checkpoint {path!r} holds pieces of {entry.name!r} that do not cover its "
            f"{size} elements once: {[(a, b) for a, b, _ in found]}"
        )


def _read_json(file: str, what: str, label: str) -> dict:
    try:
        with gfile.GFile(file, "rb") as f:
            record = json.loads(f.read().decode("utf-8"))
    except tf.errors.NotFoundError as e:
        raise CheckpointError(f"{what} is incomplete: {file!r} is missing.") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"Checkpoint {label} {file!r} is corrupted: {e}") from e
    if not isinstance(record, dict):
        raise CheckpointError(f"Checkpoint {label} {file!r} is corrupted: not a JSON object.")
    return record


def _check_files(path: str, sizes: Mapping[str, int]) -> None:
    """Every data file the checkpoint was written with exists, with its written size."""
    for name, size in sizes.items():
        file = _join(path, name)
        if not gfile.exists(file):
            raise CheckpointError(f"Checkpoint file {file!r} is missing.")
        actual = gfile.stat(file).length
        if actual != size:
            raise CheckpointError(
                f"Checkpoint file {file!r} is truncated or corrupted: it has {actual} bytes, "
                f"{size} were written."
            )


def _delete_old(directory: str, newest: int, keep_max: int) -> None:
    """Deletes published checkpoints older than the `keep_max` newest (up to `newest`).

    On a local disk each worker's shard data file of the first one deleted is kept as
    that worker's spare (`spare_path`), which its next save writes over in place
    (`write_shard`): deleting a file of a checkpoint's size and allocating the next one
    cost the step time on file systems that trim deleted blocks at once (mounted with
    `discard`: docs/reference/checkpoints.md). The folder itself, its manifest and
    records go; a spare is never a checkpoint, and the disk holds at most one spare per
    worker beside the `keep_max` checkpoints (what it holds while a save is written)."""
    published = [s for s in list_checkpoints(directory) if s <= newest]
    for step in published[:-keep_max]:
        folder = _join(directory, f"ckpt-{step}")
        if "://" not in directory:
            _keep_spares(directory, folder)
        gfile.rmtree(folder)


_SPARES = ".spare"


def spare_path(directory: str, worker: int) -> str:
    """Where worker `worker`'s spare shard data file waits for its next save."""
    return _join(_join(directory, _SPARES), f"shard-{worker}{_DATA}")


def _keep_spares(directory: str, folder: str) -> None:
    """Moves `folder`'s shard data files to the spares a worker has none of (atomic
    renames: a crash leaves each file a spare or in the folder being deleted)."""
    os.makedirs(_join(directory, _SPARES), exist_ok=True)
    for name in os.listdir(folder):
        match = _SHARD_DATA.fullmatch(name)
        if match:
            spare = spare_path(directory, int(match.group(1)))
            if not os.path.exists(spare):
                os.replace(os.path.join(folder, name), spare)


def _take_spare(folder: str, worker: int, data: str) -> None:
    """Puts worker `worker`'s spare (if any) where its shard data file is written, to
    be written over in place (shard_file.write never truncates before writing)."""
    if "://" in folder:
        return
    spare = spare_path(os.path.dirname(folder.rstrip("/")), worker)
    try:
        os.replace(spare, data)
    except FileNotFoundError:
        pass


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


def _join(directory: str, name: str) -> str:
    return (
        directory.rstrip("/") + "/" + name if "://" in directory else os.path.join(directory, name)
    )


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    if "://" in path:
        with gfile.GFile(tmp, "wb") as f:
            f.write(text.encode("utf-8"))
        gfile.rename(tmp, path, overwrite=True)
        return
    with open(tmp, "w", encoding="utf-8") as f:  # local: on disk before the rename
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _sync_files(os.path.dirname(path) or ".", ["."])  # the rename itself


def _sync_files(folder: str, names: Iterable[str]) -> None:
    """Local files (and folders: ".") reach the disk before a checkpoint names them: a
    machine that loses power after `latest` moved must not find it naming data that was
    still in the page cache. Object stores hold a file durably once it is closed."""
    if "://" in folder:
        return
    for name in names:
        descriptor = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
