"""IO slicing: each worker reads its own share of the input files (`io.*` config keys).

Workers are weighted by how many compute lanes (model-replica devices) they run, so a
worker with twice the replicas consumes twice the samples per step and gets twice the
files. With weights reduced by their greatest common divisor (2 and 4 lanes -> 1 and 2),
the job has `units = sum(weights)` file slots; file i goes to slot `i % units`, and
worker w owns `weights[w]` consecutive slots. When the file count is not a multiple of
`units`:

* `io.unbalanced_io_slicing=True`: the first `len(files) % units` slots get one extra
  file (a worker gets at most one extra file per slot it owns);
* `io.drop_last_files=True`: the last `len(files) % units` files are dropped;
* otherwise (and whenever there are fewer files than slots) slicing is turned off with
  a warning: every worker reads the whole list, `weights[w]` times, in its own shuffled
  order (seeded by the worker index) so that the workers do not read the same records in
  lock-step.

`slice_files` is the user-facing function (`epl.io.slice_files(files)`); `plan_slices`
is the same rule as plain data, for every worker at once; `files_dataset` builds the
per-worker `tf.data` pipeline that `EPLTrainer.fit(files, parse_fn=...)` trains on.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import warnings
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)

FILE_FORMATS = ("tfrecord", "text")


@dataclasses.dataclass(frozen=True)
class FileSlices:
    """How a file list is divided among the workers of a job.

    Attributes:
      per_worker: the files each worker reads, indexed by worker.
      sliced: False when slicing was turned off (every worker reads the whole list).
      dropped: files no worker reads (only with `drop_last_files`).
      reason: why slicing was turned off, or "" when it was not.
    """

    per_worker: tuple[tuple[str, ...], ...]
    sliced: bool
    dropped: tuple[str, ...] = ()
    reason: str = ""


def expand_files(files_or_glob) -> list[str]:
    """A list of file names from a list (kept in its order) or a glob pattern (sorted).

    Every worker must see the same list in the same order for the shares to partition
    it; a glob is therefore sorted (`tf.io.gfile.glob` also reads GCS/HDFS paths).
    """
    if isinstance(files_or_glob, str):
        import tensorflow as tf

        files = sorted(tf.io.gfile.glob(files_or_glob))
        if not files:
            raise ValueError(f"No file matches the pattern. Received: {files_or_glob!r}")
        return files
    if isinstance(files_or_glob, (bytes, dict)) or not isinstance(files_or_glob, Sequence):
        raise TypeError(
            "files must be a glob pattern (str) or a list of file names. "
            f"Received: {type(files_or_glob).__name__}"
        )
    files = list(files_or_glob)
    bad = [f for f in files if not isinstance(f, str)]
    if bad:
        raise TypeError(f"Every file name must be a str. Received: {bad[:3]!r}")
    if not files:
        raise ValueError("The file list is empty. Received: []")
    return files


def plan_slices(
    files: Sequence[str],
    replicas_per_worker: Sequence[int],
    *,
    unbalanced_io_slicing: bool = False,
    drop_last_files: bool = False,
    seed: int = 0,
) -> FileSlices:
    """Divides `files` among workers in proportion to `replicas_per_worker` (see module doc).

    Args:
      files: the job's file list, identical on every worker.
      replicas_per_worker: compute lanes of each worker (all >= 1).
      unbalanced_io_slicing: when the count does not divide, some slots get one extra file.
      drop_last_files: when the count does not divide, drop the last files.
      seed: with the worker index, seeds the shuffles when slicing is turned off.

    Raises:
      ValueError: a replica count below 1, or both remainder options at once.
    """
    counts = list(replicas_per_worker)
    if not counts or any(not isinstance(c, int) or c < 1 for c in counts):
        raise ValueError(
            "replicas_per_worker must list a positive int per worker. "
            f"Received: replicas_per_worker={counts!r}"
        )
    if unbalanced_io_slicing and drop_last_files:
        raise ValueError(
            "io.unbalanced_io_slicing and io.drop_last_files are alternatives for files "
            "that do not divide evenly; set at most one. Received: both True"
        )
    files = list(files)
    divisor = math.gcd(*counts)
    weights = [c // divisor for c in counts]
    units = sum(weights)
    remainder = len(files) % units
    dropped: list[str] = []
    if len(files) < units:
        reason = (
            f"{len(files)} file(s) cannot be shared by {len(counts)} worker(s) with "
            f"replica weights {weights} ({units} shares)"
        )
        return _whole_list_per_worker(files, weights, seed, reason)
    if remainder and drop_last_files:
        dropped = files[len(files) - remainder :]
        files = files[: len(files) - remainder]
    elif remainder and not unbalanced_io_slicing:
        reason = (
            f"{len(files)} files do not divide into {units} equal shares (worker replica "
            f"weights {weights}); set io.unbalanced_io_slicing=True to give some workers one "
            "more file, or io.drop_last_files=True to drop the last "
            f"{remainder} file(s)"
        )
        return _whole_list_per_worker(files, weights, seed, reason)
    first_unit = [sum(weights[:w]) for w in range(len(weights))]
    per_worker = tuple(
        tuple(f for i, f in enumerate(files) if start <= i % units < start + weight)
        for start, weight in zip(first_unit, weights)
    )
    return FileSlices(per_worker, sliced=True, dropped=tuple(dropped))


def _whole_list_per_worker(files, weights, seed, reason) -> FileSlices:
    """Slicing off: each worker reads every file, `weight` times, in its own order.

    Repeating the list `weight` times keeps a worker's epoch proportional to the samples
    it consumes per step, as the sliced shares are.
    """
    per_worker = []
    for worker, weight in enumerate(weights):
        rng = random.Random(seed * 1_000_003 + worker)
        order: list[str] = []
        for _ in range(weight):
            copy = list(files)
            rng.shuffle(copy)
            order.extend(copy)
        per_worker.append(tuple(order))
    return FileSlices(tuple(per_worker), sliced=False, reason=reason)


def slice_files(
    files_or_glob,
    *,
    worker_index: int | None = None,
    replicas_per_worker: Sequence[int] | None = None,
    unbalanced_io_slicing: bool | None = None,
    drop_last_files: bool | None = None,
    seed: int = 0,
) -> list[str]:
    """This worker's share of the input files (`epl.io.slice_files(files)`).

    Arguments left as None come from `epl.Env.get()`: the worker index, one replica per
    local device on each worker (proportional to the lanes of any uniform layout), and
    the `io.unbalanced_io_slicing` / `io.drop_last_files` config keys. The trainer passes
    its plan's real lane counts instead.

    Warns (UserWarning) when slicing has to be turned off and this worker reads the
    whole list.
    """
    files = expand_files(files_or_glob)
    if None in (worker_index, replicas_per_worker, unbalanced_io_slicing, drop_last_files):
        from epl_trainer.runtime.env import Env

        env = Env.get()
        if worker_index is None:
            worker_index = env.cluster.worker_index
        if replicas_per_worker is None:
            replicas_per_worker = [len(d) for d in env.cluster.devices_by_worker]
        if unbalanced_io_slicing is None:
            unbalanced_io_slicing = env.config.io.unbalanced_io_slicing
        if drop_last_files is None:
            drop_last_files = env.config.io.drop_last_files
    if not 0 <= worker_index < len(replicas_per_worker):
        raise ValueError(
            f"worker_index must be in [0, {len(replicas_per_worker)}). "
            f"Received: worker_index={worker_index}, replicas_per_worker={replicas_per_worker}"
        )
    slices = plan_slices(
        files,
        replicas_per_worker,
        unbalanced_io_slicing=unbalanced_io_slicing,
        drop_last_files=drop_last_files,
        seed=seed,
    )
    if not slices.sliced:
        warnings.warn(
            f"IO slicing is turned off: {slices.reason}. Worker {worker_index} reads all "
            "files in its own shuffled order.",
            UserWarning,
            stacklevel=2,
        )
    if slices.dropped:
        logger.info(
            "io.drop_last_files: %d file(s) are not read: %s", len(slices.dropped), slices.dropped
        )
    mine = list(slices.per_worker[worker_index])
    logger.info("Worker %d reads %d of %d file(s).", worker_index, len(mine), len(files))
    return mine


def files_dataset(
    files: Sequence[str],
    parse_fn: Callable,
    batch_size: int,
    *,
    file_format: str | Callable = "tfrecord",
    repeat: bool = False,
):
    """Batches of `parse_fn(record)` read from `files` in order (a `tf.data.Dataset`).

    Args:
      files: the file names this worker reads (already sliced).
      parse_fn: maps one record (a scalar string tensor) to `(features, labels)`.
      batch_size: records per batch on this worker; the last partial batch is dropped,
        since the compiled step splits a batch evenly across the local replicas.
      file_format: "tfrecord", "text" (one record per line) or a callable
        `files -> tf.data.Dataset` of records (e.g. a compressed TFRecord reader).
      repeat: repeat the records forever (multi-worker training fixes the steps per
        epoch instead, so that no worker runs out before its peers).
    """
    import tensorflow as tf

    if not callable(parse_fn):
        raise TypeError(f"parse_fn must be callable. Received: {type(parse_fn).__name__}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int. Received: batch_size={batch_size!r}")
    if callable(file_format):
        records = file_format(list(files))
    elif file_format == "tfrecord":
        records = tf.data.TFRecordDataset(list(files))
    elif file_format == "text":
        records = tf.data.TextLineDataset(list(files))
    else:
        raise ValueError(
            f"file_format must be one of {FILE_FORMATS} or a callable. "
            f"Received: file_format={file_format!r}"
        )
    dataset = records.map(parse_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    dataset = dataset.batch(batch_size, drop_remainder=True)
    if repeat:
        dataset = dataset.repeat()
    return dataset.prefetch(tf.data.AUTOTUNE)
