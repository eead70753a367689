"""Every worker starts from worker 0's state: weights, non-trainable state, optimizer.

Each worker process builds its own Keras model; without a seed each draws its own random
initialisation, and data-parallel workers then train different models
(docs/benchmarks.md#unseeded-workers). So worker 0 broadcasts its Keras
model's variables (trainable, non-trainable such as BatchNorm statistics, seed states)
and the user's optimizer's variables (iterations, learning rate, slots if it was built;
a LossScaleOptimizer's loss scale) to every worker, before the engine copies the model
into its state (`EngineState`) and its optimizers the optimizer's (master_state.py).
Done on the Keras model, which every worker holds whole, it serves every layout: data
parallel, ZeRO (whose shards are cut from those copies) and pipelines whose stages live
on other workers (each worker copies its own stages from the same values). Then one
all-gather of per-variable checksums (a fingerprint of the bytes, and a float64 sum for
the log) confirms that every worker holds the same values; a mismatch is a
`StartStateError` naming the workers and the first differing variable.

When: as the trainer takes the model (`EPLTrainer` construction, or the first data for
a model built from it), a point every worker passes, as PyTorch's DDP broadcasts when
it wraps the model. Not at the engine build: a worker that gets no evaluation data
builds no engine in `evaluate` (its metrics are still summed with the others'), so a
collective there would meet another collective on its peers. A model that only its
first batch builds (a subclassed model) is taken at the engine build. Weights changed
after that must change alike on every worker (or come from a checkpoint).

A checkpoint restored afterwards (`restore_checkpoint`, `checkpoint.dir`'s auto-resume)
replaces this state with the same checkpoint on every worker. Single-worker jobs run
none of this.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import zlib
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from epl_trainer.core import comm
from epl_trainer.core.comm.hosts import host_group, rows_by_worker
from epl_trainer.runtime.cluster import Cluster

logger = logging.getLogger(__name__)

_HASH_BUCKETS = 2**63 - 1


class StartStateError(RuntimeError):
    """Workers do not hold the same state at the start of training."""


class StartState:
    """Gives every worker worker 0's model and optimizer values, once.

    Args:
      cluster: the job.
      watch: `watch(what)` bounds the collectives run inside it (the trainer's lost-worker
        check), so a peer that never comes is an error, not a hang.
    """

    def __init__(self, cluster: Cluster, watch: Callable[[str], object] | None = None):
        self.cluster = cluster
        self._watch = watch or (lambda what: contextlib.nullcontext())
        self.taken = cluster.worker_num == 1  # nothing to agree on

    def take(self, model, optimizer) -> None:
        """Overwrites this worker's model and optimizer variables with worker 0's, then
        checks that every worker holds the same values (logs the checksum at INFO).

        A collective the first time: every worker must call it at the same point. Later
        calls, and calls before the model is built, do nothing.

        Raises:
          StartStateError: when the workers' models or optimizers have different variables
            (counts, shapes or dtypes), or hold different values after the broadcast.
        """
        if self.taken or not model.built:
            return
        cluster = self.cluster
        group = host_group(cluster.devices_by_worker, cluster.host_device)
        model_variables = _model_variables(model)
        optimizer_variables = _optimizer_variables(model, optimizer)
        variables = model_variables + optimizer_variables
        with self._watch("taking worker 0's start state"):
            _check_same_structure(cluster, group, model_variables, optimizer_variables)
            _broadcast(group, cluster.host_device, variables, cluster.is_chief)
            hashes, sums = _local_checksums([v.value for v in variables])
            rows = _gather_rows(group, cluster.host_device, np.concatenate([hashes, sums]))
        self.taken = True
        n = len(variables)
        names = [f"{v.path!r} (model)" for v in model_variables]
        names += [f"{v.path!r} (optimizer)" for v in optimizer_variables]
        compare_checksums(names, rows[:, :n], rows[:, n:].copy().view(np.float64))
        logger.info(
            "Start state identical on all %d workers: checksum %s, sum %.17g over %d model "
            "and optimizer variables.",
            cluster.worker_num,
            hashlib.sha256(hashes.tobytes()).hexdigest()[:16],
            float(sums.view(np.float64).sum()),
            n,
        )


def compare_checksums(names: Sequence[str], hashes: np.ndarray, sums: np.ndarray) -> None:
    """Raises if the workers hold different values of a variable.

    Args:
      names: one name per variable.
      hashes, sums: [workers, variables]: each worker's fingerprint of each variable's
        bytes, and its float64 sum (shown in the error).

    Raises:
      StartStateError: naming the first differing variable and the workers that differ
        from worker 0.
    """
    differing = [i for i in range(len(names)) if np.any(hashes[:, i] != hashes[0, i])]
    if not differing:
        return
    i = differing[0]
    odd = [w for w in range(hashes.shape[0]) if hashes[w, i] != hashes[0, i]]
    held = ", ".join(f"worker {w}: sum={float(sums[w, i])!r}" for w in range(hashes.shape[0]))
    raise StartStateError(
        f"Workers {odd} do not hold worker 0's value of {names[i]} after taking worker 0's "
        f"start state ({len(differing)} of {len(names)} variables differ, this is the "
        f"first). Training would diverge from the first step. Received: {held}"
    )


def _model_variables(model) -> list:
    # The variables EngineState copies; `model.variables` also counts metric state.
    return list(model.trainable_variables) + list(model.non_trainable_variables)


def _optimizer_variables(model, optimizer) -> list:
    """The optimizer's variables; with a LossScaleOptimizer around it as the model's
    optimizer (Keras's mixed_float16), that one's too: its loss scale."""
    holder = getattr(model, "optimizer", None)
    if getattr(holder, "inner_optimizer", None) is optimizer:
        return list(holder.variables)  # its own, then the inner optimizer's
    return list(optimizer.variables)


def _check_same_structure(cluster, group, model_variables, optimizer_variables) -> None:
    """One gather of (count, shape/dtype signature) per part, so that different models
    or optimizers stop with an error rather than a collective of mismatched shapes."""
    local = [
        value
        for variables in (model_variables, optimizer_variables)
        for value in (len(variables), _signature(variables))
    ]
    rows = _gather_rows(group, cluster.host_device, np.asarray(local, np.int64))
    for part, column in (("model", 0), ("optimizer", 2)):
        by_worker = [tuple(row[column : column + 2]) for row in rows]
        if len(set(by_worker)) > 1:
            counts = {w: int(row[0]) for w, row in enumerate(by_worker)}
            raise StartStateError(
                f"The workers' {part}s have different variables (counts, shapes or dtypes), "
                f"so worker 0's state cannot be given to every worker. Build the same "
                f"{part} on every worker (an optimizer already built on some workers only "
                f"differs too). Received: variables by worker {counts}"
            )


def _signature(variables) -> int:
    text = "|".join(f"{tuple(v.shape)}:{v.dtype}" for v in variables)
    return zlib.crc32(text.encode())


def _broadcast(group, host: str, variables, is_chief: bool) -> None:
    """Worker 0's values to every worker: a summing all-reduce in which the other
    workers contribute zeros, on integer bit patterns so that the copy is exact (and any
    dtype travels: TF's CPU collectives take 32- and 64-bit types only)."""
    wire_dtypes = [_wire_dtype(v.value.dtype) for v in variables]
    sizes = [int(np.prod(v.shape)) for v in variables]
    buckets = comm.plan_buckets(sizes, wire_dtypes, 1)

    @tf.function(autograph=False)
    def broadcast():
        with tf.device(host):
            values = [
                _to_wire(v.value) if is_chief else tf.zeros(v.shape, wire)
                for v, wire in zip(variables, wire_dtypes)
            ]
            summed = comm.fused_all_reduce(group, [values], buckets, "sum")[0]
            if not is_chief:
                for v, value in zip(variables, summed):
                    v.assign(_from_wire(value, v.value.dtype))

    broadcast()


def _wire_dtype(dtype: tf.DType) -> tf.DType:
    return tf.int64 if dtype.size == 8 else tf.int32


def _to_wire(value: tf.Tensor) -> tf.Tensor:
    dtype = value.dtype
    if dtype.size in (4, 8) and dtype != tf.bool:
        return value if dtype == _wire_dtype(dtype) else tf.bitcast(value, _wire_dtype(dtype))
    if dtype.size == 2:  # float16, bfloat16, (u)int16: sign-extended, so exactly reversible
        return tf.cast(tf.bitcast(value, tf.int16), tf.int32)
    return tf.cast(value, tf.int32)  # bool, (u)int8


def _from_wire(value: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    if dtype.size in (4, 8) and dtype != tf.bool:
        return value if dtype == value.dtype else tf.bitcast(value, dtype)
    if dtype.size == 2:
        return tf.bitcast(tf.cast(value, tf.int16), dtype)
    return tf.cast(value, dtype)


def _local_checksums(values) -> tuple[np.ndarray, np.ndarray]:
    """(fingerprint, float64 sum bit-cast to int64) of each value, as int64 arrays."""
    hashes = np.zeros(len(values), np.int64)
    sums = np.zeros(len(values), np.float64)
    for i, value in enumerate(values):
        with tf.device(value.device):
            sums[i] = float(tf.reduce_sum(tf.cast(value, tf.float64)))
        # A fingerprint of the bytes: a sum misses values that moved or cancel.
        serialized = tf.io.serialize_tensor(value)
        hashes[i] = int(tf.strings.to_hash_bucket_fast(serialized, _HASH_BUCKETS))
    return hashes, sums.view(np.int64)


def _gather_rows(group, host: str, local: np.ndarray) -> np.ndarray:
    """Every worker's int64 vector (same length everywhere), one row per worker."""

    @tf.function(autograph=False)
    def gather(values):
        with tf.device(host):
            return group.all_gather([tf.identity(values)])[0]

    return rows_by_worker(group, gather(tf.constant(local, tf.int64)).numpy())
