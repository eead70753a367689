"""Collective communication between devices: the only module that touches collective ops.

Uses TF's collective runtime (`CollectiveReduceV2` and friends): NCCL on GPUs, rings
over gRPC between workers, in-process between logical CPU devices. Two details make
these V2 ops usable inside one `tf.function` (both measured, see DESIGN.md):

* Every collective on a device takes that device's **ordering token** (the handle of a
  small resource variable). Ops sharing a resource run in program order, so every
  device issues its collectives in the same order and none deadlock. With
  `num_communicators` > 1 a device has that many tokens: independent chains that the
  runtime may overlap.
* Group and instance keys are deterministic (derived from the member device names and
  a counter advanced in program-build order, identical on every worker) and large, so
  they never collide with keys `tf.distribute` allocates from 1 upwards.
"""

from __future__ import annotations

import dataclasses
import itertools
import zlib
from collections.abc import Sequence

import tensorflow as tf

_GROUP_KEY_BASE = 0x2000_0000
_INSTANCE_KEY_BASE = 0x1000_0000
_instance_counter = itertools.count(_INSTANCE_KEY_BASE)
_ordering_tokens: dict[tuple[str, int], tf.Variable] = {}


def next_instance_key() -> int:
    """A fresh instance key; programs are built in the same order on every worker."""
    return next(_instance_counter)


def group_key(devices: Sequence[str]) -> int:
    """A stable key for a set of member devices (same on every worker)."""
    digest = zlib.crc32("|".join(sorted(devices)).encode())
    return _GROUP_KEY_BASE + digest % 0x1000_0000


def ordering_token(device: str, chain: int = 0):
    """The resource handle that orders collectives of `chain` on `device`."""
    key = (device, chain)
    if key not in _ordering_tokens:
        with tf.init_scope(), tf.device(device):
            _ordering_tokens[key] = tf.Variable(
                0.0, trainable=False, name=f"epl_ordering_token_{chain}"
            )
    return _ordering_tokens[key].handle


@dataclasses.dataclass(frozen=True)
class CollectiveGroup:
    """A set of devices (possibly on several workers) that reduce together.

    Attributes:
      devices: every member of the group, in a globally agreed order.
      local_devices: the members that live in this process.
    """

    devices: tuple[str, ...]
    local_devices: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def key(self) -> int:
        return group_key(self.devices)

    def all_reduce(
        self,
        values: Sequence[tf.Tensor],
        reduction: str = "mean",
        instance_key: int | None = None,
        chain: int = 0,
    ) -> list[tf.Tensor]:
        """All-reduces one tensor per local member; returns one result per local member.

        Args:
          values: `values[i]` lives on `local_devices[i]`.
          reduction: "mean" or "sum".
          instance_key: a key from `next_instance_key()`; allocated here if None.
          chain: which ordering-token chain (communicator) to use.
        """
        if len(values) != len(self.local_devices):
            raise ValueError(
                f"all_reduce needs one value per local member ({len(self.local_devices)}). "
                f"Received: {len(values)} values"
            )
        if self.size == 1:
            return list(values)
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum'. Received: {reduction!r}")
        instance_key = next_instance_key() if instance_key is None else instance_key
        results = []
        for device, value in zip(self.local_devices, values):
            with tf.device(device):
                results.append(
                    tf.raw_ops.CollectiveReduceV2(
                        input=value,
                        group_size=self.size,
                        group_key=self.key,
                        instance_key=instance_key,
                        ordering_token=[ordering_token(device, chain)],
                        merge_op="Add",
                        final_op="Div" if reduction == "mean" else "Id",
                        communication_hint="auto",
                        timeout_seconds=0.0,
                    )
                )
        return results


def plan_buckets(sizes: Sequence[int], dtypes: Sequence, max_splits: int) -> list[list[int]]:
    """Groups tensors into at most `max_splits` buckets per dtype, balanced by size.

    Buckets are contiguous runs in the given order (so the first gradients ready in
    backward can be sent first) with cut points chosen to even out the byte counts.

    Returns:
      Lists of indices into `sizes`, one list per bucket.
    """
    if max_splits < 1:
        raise ValueError(f"max_splits must be >= 1. Received: {max_splits}")
    by_dtype: dict[str, list[int]] = {}
    for i, dtype in enumerate(dtypes):
        by_dtype.setdefault(str(dtype), []).append(i)
    buckets = []
    for indices in by_dtype.values():
        buckets.extend(_balanced_runs(indices, [sizes[i] for i in indices], max_splits))
    return buckets


def _balanced_runs(indices: list[int], sizes: list[int], parts: int) -> list[list[int]]:
    parts = min(parts, len(indices))
    total = sum(sizes)
    runs, current, filled = [], [], 0
    for index, size in zip(indices, sizes):
        current.append(index)
        filled += size
        runs_left = parts - len(runs) - 1
        items_left = len(indices) - sum(len(r) for r in runs) - len(current)
        # Close the run once it holds its share of the bytes, keeping one item per
        # remaining run.
        if runs_left > 0 and items_left >= runs_left and filled >= total * (len(runs) + 1) / parts:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def fused_all_reduce(
    group: CollectiveGroup,
    per_member: Sequence[Sequence[tf.Tensor]],
    buckets: Sequence[Sequence[int]],
    reduction: str,
    num_chains: int = 1,
) -> list[list[tf.Tensor]]:
    """All-reduces lists of tensors, one collective per bucket of flattened tensors.

    Args:
      group: the collective group.
      per_member: `per_member[i]` is the list of tensors of local member i (same
        shapes and dtypes on every member).
      buckets: index lists from `plan_buckets`.
      reduction: "mean" or "sum".
      num_chains: buckets are spread round-robin over this many ordering chains.

    Returns:
      The reduced tensors, same structure as `per_member`.
    """
    if group.size == 1:
        return [list(tensors) for tensors in per_member]
    results = [list(tensors) for tensors in per_member]
    for bucket_index, bucket in enumerate(buckets):
        flats = []
        for device, tensors in zip(group.local_devices, per_member):
            with tf.device(device):
                flats.append(tf.concat([tf.reshape(tensors[i], [-1]) for i in bucket], axis=0))
        reduced = group.all_reduce(flats, reduction, chain=bucket_index % num_chains)
        for member, (device, flat) in enumerate(zip(group.local_devices, reduced)):
            template = per_member[member]
            with tf.device(device):
                pieces = tf.split(flat, [_num_elements(template[i]) for i in bucket])
                for i, piece in zip(bucket, pieces):
                    results[member][i] = tf.reshape(piece, tf.shape(template[i]))
    return results


def _num_elements(tensor) -> int:
    return int(tensor.shape.num_elements())
