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

import numpy as np
import tensorflow as tf

_GROUP_KEY_BASE = 0x2000_0000
_INSTANCE_KEY_BASE = 0x1000_0000
_instance_counter = itertools.count(_INSTANCE_KEY_BASE)
# Gathers of a dynamic length (an Embedding's gradient rows under a dynamic sequence
# length) take their instance key from the length: TF resolves a collective instance's
# shape once per key, so a key reused with another length fails ("Shape mismatch in the
# collective instance"). Each such gather owns a block of keys, one per length; the
# blocks are reused round-robin (only long-dead traces could still hold an old block).
_DYNAMIC_KEY_BASE = 0x4000_0000
_DYNAMIC_BLOCK = 1 << 20  # lengths (in units) per block
_DYNAMIC_BLOCKS = (0x7FFF_FFFF - _DYNAMIC_KEY_BASE) // _DYNAMIC_BLOCK
_dynamic_counter = itertools.count()
_ordering_tokens: dict[tuple[str, int], tf.Variable] = {}
_measured_ranks: dict[tuple[str, ...], dict[str, int]] = {}


def next_instance_key() -> int:
    """A fresh instance key; programs are built in the same order on every worker."""
    return next(_instance_counter)


def length_keyed_instance(length: tf.Tensor, unit: int = 1) -> tf.Tensor:
    """An int32 instance key for a collective whose length changes from step to step.

    `length // unit` (e.g. rows, with `unit` elements per row) must be below 2**20 and
    equal on every member, as the lengths of a gather are.
    """
    base = _DYNAMIC_KEY_BASE + (next(_dynamic_counter) % _DYNAMIC_BLOCKS) * _DYNAMIC_BLOCK
    units = tf.cast(length, tf.int32) // unit
    check = tf.debugging.assert_less(
        units, _DYNAMIC_BLOCK, message="A dynamic-length collective exceeds 2**20 units"
    )
    with tf.control_dependencies([check]):
        return tf.constant(base, tf.int32) + units


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


def collective_rank_order(devices: Sequence[str]) -> list[str]:
    """The members of a V2 collective group in the rank order TensorFlow gives them.

    TF ranks a group once, when it first forms (`CollectiveParamResolverLocal::
    CompleteDefaultRanking` in TF 2.21), whatever order the members were listed or
    joined in:

    1. members are grouped by task, and the tasks are ordered by their task name
       `/job:J/replica:R/task:T` compared **as strings** (a `std::set<string>`), so
       task 10 comes between tasks 1 and 2;
    2. inside a task, devices are ordered by their parsed name (`DeviceNameUtils::
       CompareFullNames`): device type as a string, then the device index **as a
       number**, so CPU:10 comes after CPU:9;
    3. GPUs are the exception to step 2: starting from the lowest-numbered GPU, TF
       follows the strongest interconnect links (NVLink / PCIe peer links), or the
       ConfigProto's `gpu_options.experimental.collective_ring_order`, which this rule
       cannot see. Call `CollectiveGroup.measure_ranks()` once for GPU groups.

    Evidence (tests/test_comm.py and a one-off 11-worker run): a gather of each
    member's index, with the members listed in a scrambled order, comes back in the
    order CPU:0, 1, ..., 9, 10, 11 on 12 logical devices, and task:0, 1, 10, 2, ..., 9
    for 11 workers with one device each.
    """
    return sorted(devices, key=_rank_sort_key)


def _rank_sort_key(device: str):
    spec = tf.DeviceSpec.from_string(device)
    # Names without a job/task are expanded by TF to the local task before grouping.
    task = f"/job:{spec.job or 'localhost'}/replica:{spec.replica or 0}/task:{spec.task or 0}"
    return task, spec.device_type or "", spec.device_index or 0


@dataclasses.dataclass(frozen=True)
class CollectiveGroup:
    """A set of devices (possibly on several workers) that reduce together.

    Attributes:
      devices: every member of the group, in a globally agreed order.
      local_devices: the members that live in this process.

    Collectives wait for their peers without a per-op timeout: a `timeout_seconds` on
    the op leaves a timer thread alive for the whole timeout after every launch (~20 per
    data-parallel step; a few minutes of training reached 30,000 threads). A dead peer is
    detected by the process's one `CollectiveWatchdog` instead (watchdog.py).
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
                    )
                )
        return results

    def rank_of(self, device: str) -> int:
        """The rank TensorFlow gives `device` in this group (see `collective_rank_order`).

        Gathers and reduce-scatters lay out chunks by this rank: chunk r of a
        reduce-scatter goes to the member of rank r, and an all-gather concatenates the
        members' inputs by rank. Uses the ranks `measure_ranks()` observed, when it ran
        for this group, and the documented rule otherwise.
        """
        if device not in self.devices:
            raise ValueError(
                f"{device!r} is not a member of the group. Received members: {self.devices}"
            )
        measured = _measured_ranks.get(tuple(self.devices))
        if measured is not None:
            return measured[device]
        return collective_rank_order(self.devices).index(device)

    def measure_ranks(self) -> list[int]:
        """Runs one gather of each member's position to learn TF's ranks; remembers them.

        Needed on GPUs, whose order inside a worker follows interconnect links. Runs
        eagerly (also when called while a function is traced); in a multi-worker job every
        worker must call it at the same point of the program build, like any collective.

        Returns:
          The rank of each local member.
        """
        if not self.local_devices:
            raise ValueError(f"measure_ranks needs a local member. Received: {self}")
        if self.size == 1:
            return [0]
        instance_key = next_instance_key()

        @tf.function
        def gather_positions():
            results = []
            for device in self.local_devices:
                with tf.device(device):
                    results.append(
                        tf.raw_ops.CollectiveGatherV2(
                            input=tf.constant([self.devices.index(device)], tf.int32),
                            group_size=self.size,
                            group_key=self.key,
                            instance_key=instance_key,
                            ordering_token=[ordering_token(device, 0)],
                            communication_hint="auto",
                        )
                    )
            return results[0]

        with tf.init_scope():
            positions = [int(p) for p in gather_positions().numpy()]
        _measured_ranks[tuple(self.devices)] = {self.devices[p]: r for r, p in enumerate(positions)}
        return [self.rank_of(device) for device in self.local_devices]

    def reduce_scatter(
        self,
        values: Sequence[tf.Tensor],
        reduction: str = "mean",
        instance_key: int | None = None,
        chain: int = 0,
    ) -> list[tf.Tensor]:
        """Reduces flat buffers over the group; each member keeps the chunk of its rank.

        Args:
          values: `values[i]`, on `local_devices[i]`, is a 1-D tensor of length
            `size * B` (the same on every member).
          reduction: "mean" or "sum".
          instance_key: a key from `next_instance_key()`; allocated here if None.
          chain: which ordering-token chain (communicator) to use.

        Returns:
          For each local member, elements `[r*B, (r+1)*B)` of the reduced buffer, where
          r = `rank_of(member)`. A group of one returns its input whole.
        """
        self._check_flat("reduce_scatter", values, divisible=True)
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum'. Received: {reduction!r}")
        if self.size == 1:
            return list(values)
        instance_key = next_instance_key() if instance_key is None else instance_key
        results = []
        for device, value in zip(self.local_devices, values):
            with tf.device(device):
                token = [ordering_token(device, chain)]
                if tf.DeviceSpec.from_string(device).device_type == "GPU":
                    # TF implements reduce-scatter only with NCCL ("undef" otherwise).
                    chunk = tf.raw_ops.CollectiveReduceScatterV2(
                        input=value,
                        group_size=self.size,
                        group_key=self.key,
                        instance_key=instance_key,
                        ordering_token=token,
                        merge_op="Add",
                        final_op="Div" if reduction == "mean" else "Id",
                        communication_hint="nccl",
                    )
                else:
                    # No CPU kernel exists for CollectiveReduceScatterV2. An all-to-all
                    # moves the same bytes as a ring reduce-scatter ((N-1)/N of the
                    # buffer per member); the member then sums the N chunks it received.
                    received = tf.raw_ops.CollectiveAllToAllV2(
                        input=tf.reshape(value, [self.size, -1]),
                        group_size=self.size,
                        group_key=self.key,
                        instance_key=instance_key,
                        ordering_token=token,
                        communication_hint="auto",
                    )
                    chunk = tf.reduce_sum(received, axis=0)
                    if reduction == "mean":
                        chunk = chunk / tf.cast(self.size, chunk.dtype)
                length = value.shape[0]
                if length is not None:
                    chunk = tf.ensure_shape(chunk, [length // self.size])
                results.append(chunk)
        return results

    def all_gather(
        self,
        values: Sequence[tf.Tensor],
        instance_key: int | None = None,
        chain: int = 0,
        length_unit: int = 1,
    ) -> list[tf.Tensor]:
        """Concatenates every member's 1-D tensor, in rank order, on every local member.

        Args:
          values: `values[i]`, on `local_devices[i]`, is a 1-D tensor of length B (the
            same on every member).
          instance_key: a key from `next_instance_key()`; allocated here if None (from
            `length_keyed_instance` when B is not static).
          chain: which ordering-token chain (communicator) to use.
          length_unit: B is a multiple of it (elements per row); see
            `length_keyed_instance`.

        Returns:
          For each local member a tensor of length `size * B`; elements `[r*B, (r+1)*B)`
          come from the member of rank r. A group of one returns its input.
        """
        self._check_flat("all_gather", values, divisible=False)
        if self.size == 1:
            return list(values)
        if instance_key is None and values[0].shape[0] is None:
            with tf.device(self.local_devices[0]):
                instance_key = length_keyed_instance(tf.size(values[0]), length_unit)
        instance_key = next_instance_key() if instance_key is None else instance_key
        results = []
        for device, value in zip(self.local_devices, values):
            with tf.device(device):
                # CollectiveGatherV2 has no bfloat16 kernel; a gather only copies bits, so
                # bfloat16 travels bit-cast as float16 (same width) and is cast back.
                wire = value if value.dtype != tf.bfloat16 else tf.bitcast(value, tf.float16)
                gathered = tf.raw_ops.CollectiveGatherV2(
                    input=wire,
                    group_size=self.size,
                    group_key=self.key,
                    instance_key=instance_key,
                    ordering_token=[ordering_token(device, chain)],
                    communication_hint="auto",
                )
                if value.dtype == tf.bfloat16:
                    gathered = tf.bitcast(gathered, tf.bfloat16)
                length = value.shape[0]
                if length is not None:
                    gathered = tf.ensure_shape(gathered, [length * self.size])
                results.append(gathered)
        return results

    def _check_flat(self, name: str, values: Sequence[tf.Tensor], divisible: bool) -> None:
        if len(values) != len(self.local_devices):
            raise ValueError(
                f"{name} needs one value per local member ({len(self.local_devices)}). "
                f"Received: {len(values)} values"
            )
        ranks = {v.shape.rank for v in values}
        if ranks != {1}:
            raise ValueError(
                f"{name} takes flat (1-D) tensors. Received shapes: {[v.shape for v in values]}"
            )
        lengths = {v.shape[0] for v in values}
        if len(lengths) > 1:
            raise ValueError(
                f"{name} needs the same length on every member. Received lengths: {lengths}"
            )
        length = lengths.pop()
        if divisible and length is not None and length % self.size:
            raise ValueError(
                f"{name} needs a length divisible by the group size. Received: "
                f"length={length}, group_size={self.size}"
            )


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
        # remaining run; close it anyway when only one item per remaining run is left
        # (otherwise every later item lands in this run).
        reached = filled >= total * (len(runs) + 1) / parts
        if runs_left > 0 and items_left >= runs_left and (reached or items_left == runs_left):
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
    wire_fp16_scale: float | None = None,
) -> list[list[tf.Tensor]]:
    """All-reduces lists of tensors, one collective per bucket of flattened tensors.

    Args:
      group: the collective group.
      per_member: `per_member[i]` is the list of tensors of local member i (same
        shapes and dtypes on every member).
      buckets: index lists from `plan_buckets`.
      reduction: "mean" or "sum".
      num_chains: buckets are spread round-robin over this many ordering chains.
      wire_fp16_scale: `communication.fp16`: float32 buckets travel as float16 after
        being multiplied by this scale (so small gradients do not underflow), and are
        divided by it again after the reduction. None sends buckets as they are.

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
        dtype = flats[0].dtype
        compress = wire_fp16_scale is not None and dtype == tf.float32
        if compress:
            flats = [_to_fp16_wire(flat, wire_fp16_scale) for flat in flats]
        reduced = group.all_reduce(flats, reduction, chain=bucket_index % num_chains)
        if compress:
            reduced = [_from_fp16_wire(flat, wire_fp16_scale, dtype) for flat in reduced]
        for member, (device, flat) in enumerate(zip(group.local_devices, reduced)):
            template = per_member[member]
            with tf.device(device):
                pieces = tf.split(flat, _split_sizes([template[i] for i in bucket]))
                for i, piece in zip(bucket, pieces):
                    results[member][i] = tf.reshape(piece, tf.shape(template[i]))
    return results


def all_gather_slices(
    group: CollectiveGroup, per_member: Sequence[tf.IndexedSlices], reduction: str
) -> list[tf.IndexedSlices]:
    """Reduces sparse (IndexedSlices) gradients by gathering every member's rows.

    The result holds every member's (index, row) pairs; repeated indices are summed by
    whoever applies it (Keras optimizers do), so it equals the dense all-reduce without
    moving a dense [vocabulary, dim] tensor. "mean" divides the rows by the group size.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum'. Received: {reduction!r}")
    if group.size == 1:
        return list(per_member)
    row_shape = per_member[0].values.shape[1:]
    flat_values = []
    for device, g in zip(group.local_devices, per_member):
        with tf.device(device):
            flat_values.append(tf.reshape(g.values, [-1]))
    row_size = int(np.prod(row_shape)) if row_shape.is_fully_defined() else 1
    values = group.all_gather(flat_values, length_unit=row_size)
    indices = group.all_gather([g.indices for g in per_member])
    results = []
    for device, v, i, g in zip(group.local_devices, values, indices, per_member):
        with tf.device(device):
            rows = tf.reshape(v, [-1, *row_shape])
            if reduction == "mean":
                rows = rows / tf.cast(group.size, rows.dtype)
            results.append(tf.IndexedSlices(rows, i, g.dense_shape))
    return results


def _to_fp16_wire(flat, scale: float):
    with tf.device(flat.device):
        return tf.cast(flat * scale, tf.float16)


def _from_fp16_wire(flat, scale: float, dtype):
    with tf.device(flat.device):
        return tf.cast(flat, dtype) * (1.0 / scale)


def _split_sizes(tensors):
    """Element counts for `tf.split`: Python ints when static, else a tensor."""
    static = [t.shape.num_elements() for t in tensors]
    if all(n is not None for n in static):
        return static
    return tf.stack([tf.size(t, out_type=tf.int64) for t in tensors])


# ---- collectives issued lane by lane (split layers) ------------------------------------
#
# Data-parallel reductions above see every local member at once. A split layer instead
# runs inside one lane's forward: each lane's ops are traced separately, so the members
# of one collective are created at different points of the program. They still meet
# because every lane of a group issues the same sequence of collectives: the t-th one
# of each lane uses instance key `first_key + t`.

KEYS_PER_LANE_GROUP = 1 << 12
_LOCAL_KEY_BASE, _LOCAL_KEY_SPAN = 0x5000_0000, 0x2000_0000
_local_key_offset = 0


def reserve_local_instance_keys(count: int) -> int:
    """Reserves `count` keys for collectives among devices of this process only.

    Split lanes of a replica never span workers, so their keys need not agree across
    workers; taking them from their own range keeps a function traced on one worker but
    not on another (evaluate on a worker that got data, its peer none) from shifting the
    job-wide keys of `next_instance_key` that every worker must agree on. The range wraps
    around: by then the keys belong to traces long gone.
    """
    global _local_key_offset
    if count > _LOCAL_KEY_SPAN:
        raise ValueError(f"count must be <= {_LOCAL_KEY_SPAN}. Received: {count}")
    if _local_key_offset + count > _LOCAL_KEY_SPAN:
        _local_key_offset = 0
    first = _LOCAL_KEY_BASE + _local_key_offset
    _local_key_offset += count
    return first


class LaneCollectives:
    """One lane's side of the collectives among a fixed group of lanes.

    Args:
      group: the member devices (each lane's device, one per lane); `local_devices` is
        this lane's device alone.
      first_key: the instance key of this lane's first collective (shared by the group).
      limit: how many collectives the group may issue from `first_key`.
      chain: the ordering-token chain to use.

    `gather_rows` and `all_to_all` are differentiable (an all-gather's adjoint is a
    reduce-scatter, an all-to-all's is the all-to-all back); `reduce` is not (it is used
    on statistics whose gradient the caller defines).
    """

    def __init__(self, group: CollectiveGroup, first_key: int, limit: int = KEYS_PER_LANE_GROUP):
        if len(group.local_devices) != 1:
            raise ValueError(
                f"LaneCollectives needs exactly one local member. Received: {group.local_devices}"
            )
        self.group = group
        self.device = group.local_devices[0]
        self.rank = group.rank_of(self.device)
        self._first_key, self._limit, self._issued = first_key, limit, 0

    @property
    def size(self) -> int:
        return self.group.size

    def _next_key(self) -> int:
        if self._issued >= self._limit:
            raise RuntimeError(
                f"A lane issued more than {self._limit} split collectives in one program."
            )
        self._issued += 1
        return self._first_key + self._issued - 1

    def _common(self) -> dict:
        return dict(
            group_size=self.size,
            group_key=self.group.key,
            instance_key=self._next_key(),
            ordering_token=[ordering_token(self.device, 0)],
            communication_hint="auto",
        )

    def _gather(self, x):
        wire = tf.bitcast(x, tf.float16) if x.dtype == tf.bfloat16 else x
        out = tf.raw_ops.CollectiveGatherV2(input=wire, **self._common())
        out = tf.bitcast(out, tf.bfloat16) if x.dtype == tf.bfloat16 else out
        if x.shape[0] is not None:
            out = tf.ensure_shape(out, [x.shape[0] * self.size, *x.shape[1:]])
        return out

    def _exchange(self, x):
        wire = tf.bitcast(x, tf.float16) if x.dtype == tf.bfloat16 else x
        # The op exchanges element r of axis 0 with member r: one flat row per member.
        rows = tf.reshape(wire, [self.size, -1])
        out = tf.raw_ops.CollectiveAllToAllV2(input=rows, **self._common())
        out = tf.reshape(out, tf.shape(wire))
        out = tf.bitcast(out, tf.bfloat16) if x.dtype == tf.bfloat16 else out
        return tf.ensure_shape(out, x.shape)

    def gather_rows(self, x):
        """Every member's `x` stacked on axis 0 in rank order (same shape on every member).

        Gradient: the upstream rows of this member, summed over the members
        (a reduce-scatter), which is exactly the all-gather's adjoint.
        """
        if self.size == 1:
            return x
        if not x.dtype.is_floating:
            with tf.device(self.device):
                return self._gather(x)

        @tf.custom_gradient
        def gather(value):
            with tf.device(self.device):
                out = self._gather(value)

            def grad(upstream):
                with tf.device(self.device):
                    received = self._exchange(upstream)  # chunk m: member m's upstream rows
                    chunks = tf.reshape(received, [self.size, -1, *upstream.shape[1:]])
                    return tf.reduce_sum(chunks, axis=0)

            return out, grad

        return gather(x)

    def all_to_all(self, x):
        """Chunk r of axis 0 goes to the member of rank r; received chunks are stacked by
        the sender's rank. Its own adjoint."""
        if self.size == 1:
            return x
        if x.shape[0] is not None and x.shape[0] % self.size:
            raise ValueError(
                f"all_to_all needs axis 0 divisible by the group size. Received: shape "
                f"{x.shape}, group_size={self.size}"
            )
        if not x.dtype.is_floating:
            with tf.device(self.device):
                return self._exchange(x)

        @tf.custom_gradient
        def exchange(value):
            with tf.device(self.device):
                out = self._exchange(value)

            def grad(upstream):
                with tf.device(self.device):
                    return self._exchange(upstream)

            return out, grad

        return exchange(x)

    def reduce(self, x, op: str = "sum"):
        """Element-wise "sum" or "max" over the members (no gradient)."""
        if op not in ("sum", "max"):
            raise ValueError(f"op must be 'sum' or 'max'. Received: {op!r}")
        if self.size == 1:
            return x
        with tf.device(self.device):
            return tf.raw_ops.CollectiveReduceV2(
                input=tf.stop_gradient(x),
                merge_op="Add" if op == "sum" else "Max",
                final_op="Id",
                **self._common(),
            )
