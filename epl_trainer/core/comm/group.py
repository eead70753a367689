"""`CollectiveGroup`: a set of devices that reduce, gather and reduce-scatter together.

Uses TF's collective runtime (`CollectiveReduceV2` and friends): NCCL on GPUs, rings
over gRPC between workers, in-process between logical CPU devices. Every op takes its
device's ordering token and deterministic keys (keys.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import tensorflow as tf

from epl_trainer.core.comm.keys import (
    collective_rank_order,
    group_key,
    length_keyed_instance,
    next_instance_key,
    ordering_token,
)

# Ranks observed by `CollectiveGroup.measure_ranks`, by member tuple.
_measured_ranks: dict[tuple[str, ...], dict[str, int]] = {}


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
          instance_key: a key from `next_instance_key(group.key)`; allocated here if None.
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
        instance_key = next_instance_key(self.key) if instance_key is None else instance_key
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
        instance_key = next_instance_key(self.key)

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
          instance_key: a key from `next_instance_key(group.key)`; allocated here if None.
            With None and every member a CPU device of this process, no collective runs
            (`_reduce_scatter_in_process`).
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
        local = tuple(self.local_devices) == tuple(self.devices)
        on_cpu = all(tf.DeviceSpec.from_string(d).device_type == "CPU" for d in self.devices)
        if local and on_cpu and instance_key is None:
            return self._reduce_scatter_in_process(values, reduction)
        instance_key = next_instance_key(self.key) if instance_key is None else instance_key
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

    def _reduce_scatter_in_process(self, values, reduction: str) -> list[tf.Tensor]:
        """`reduce_scatter` when every member is a CPU device of this process.

        TF has no CPU kernel for a reduce-scatter, and its all-to-all hands each member a
        [size, B] buffer, one more copy of the whole input, before the member sums it. Here
        member r sums block r of the members' buffers one at a time (each addition waits
        for the previous), so it never holds more than two blocks besides the inputs.
        """
        rank = {device: self.rank_of(device) for device in self.devices}
        by_rank = {rank[d]: (d, v) for d, v in zip(self.local_devices, values)}
        length = values[0].shape[0]
        results = []
        for device in self.local_devices:
            r = rank[device]
            total = None
            for m in range(self.size):
                source, flat = by_rank[m]
                # Sliced where the buffer lives (only the block travels), once the running
                # sum has taken the previous block. A static length slices by constants
                # (one op; a ZeRO step has size**2 of these per bucket).
                with tf.device(source), tf.control_dependencies([] if total is None else [total]):
                    if length is not None:
                        block = length // self.size
                        part = tf.slice(flat, [r * block], [block])
                    else:
                        block = tf.shape(flat)[0] // self.size
                        part = flat[r * block : (r + 1) * block]
                with tf.device(device):
                    total = tf.identity(part) if total is None else total + part
            with tf.device(device):
                if reduction == "mean":
                    total = total / tf.cast(self.size, total.dtype)
                if length is not None:
                    total = tf.ensure_shape(total, [length // self.size])
                results.append(total)
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
          instance_key: a key from `next_instance_key(group.key)`; allocated here if None (from
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
                instance_key = length_keyed_instance(tf.size(values[0]), self.key, length_unit)
        instance_key = next_instance_key(self.key) if instance_key is None else instance_key
        return [
            self.all_gather_member(value, member, instance_key, chain)
            for member, value in enumerate(values)
        ]

    def all_gather_member(
        self, value: tf.Tensor, member: int, instance_key: int, chain: int = 0
    ) -> tf.Tensor:
        """Local member `member`'s half of an all-gather whose other local members issue
        theirs elsewhere in the same function with the same `instance_key` (ZeRO v2 across
        workers: each lane gathers its stage's parameters where its forward reads them)."""
        device = self.local_devices[member]
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
            return gathered

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
