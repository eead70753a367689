"""Keys and ordering for TF's V2 collectives: instance keys, group keys, ordering tokens,
and the rank order TensorFlow gives a group's members.

Two details make the V2 ops usable inside one `tf.function` (both measured, see
docs/architecture.md):

* Every collective on a device takes that device's **ordering token** (the handle of a
  small resource variable). Ops sharing a resource run in program order, so every
  device issues its collectives in the same order and none deadlock. With
  `num_communicators` > 1 a device has that many tokens: independent chains that the
  runtime may overlap.
* Group and instance keys are deterministic and large, so they never collide with keys
  `tf.distribute` allocates from 1 upwards. A group key is derived from the member
  device names; instance keys count per group, in program-build order. TensorFlow scopes
  an instance key to its group (the collective's key is "group:instance:frame:iter"), so
  only the members of a group need to agree on its keys: a worker that is not in a group
  (a pipeline stage on another worker) builds none of its collectives and shifts no one
  else's keys.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Sequence

import tensorflow as tf

_GROUP_KEY_BASE = 0x2000_0000


# Instance keys are int32 and scoped to their group; the three allocators below may serve
# one group (a split replica that is also the data-parallel group of a replicated
# Embedding: its split collectives take local keys, its sparse rows dynamic ones), so each
# owns a range, laid end to end here and never overlapping:
#   counted  [0x1000_0000, 0x4000_0000)  next_instance_key, agreed by every member
#   dynamic  [0x4000_0000, 0x6000_0000)  length_keyed_instance, a block per gather
#   local    [0x6000_0000, 0x7FFF_F000)  reserve_local_instance_keys, split lanes
def _end_to_end(start: int, sizes: dict[str, int]) -> dict[str, tuple[int, int]]:
    ranges = {}
    for name, size in sizes.items():
        ranges[name] = (start, start + size)
        start += size
    assert start < 2**31, "instance keys are int32"
    return ranges


INSTANCE_KEY_RANGES = _end_to_end(
    0x1000_0000, {"counted": 0x3000_0000, "dynamic": 0x2000_0000, "local": 0x1FFF_F000}
)
_instance_counters: dict[int, itertools.count] = {}
# Gathers of a dynamic length (an Embedding's gradient rows under a dynamic sequence
# length) take their instance key from the length: TF resolves a collective instance's
# shape once per key, so a key reused with another length fails ("Shape mismatch in the
# collective instance"). Each such gather owns a block of keys, one per length; the
# blocks are reused round-robin (only long-dead traces could still hold an old block).
DYNAMIC_BLOCK = 1 << 20  # lengths (in units) per block
_DYNAMIC_KEY_BASE, _dynamic_end = INSTANCE_KEY_RANGES["dynamic"]
_DYNAMIC_BLOCKS = (_dynamic_end - _DYNAMIC_KEY_BASE) // DYNAMIC_BLOCK
_dynamic_counters: dict[int, itertools.count] = {}
_ordering_tokens: dict[tuple[str, int | str], tf.Variable] = {}


def next_instance_key(group: int) -> int:
    """A fresh instance key for the group with key `group`: every member builds the
    group's collectives in the same order, so the t-th one gets the same key everywhere."""
    start, end = INSTANCE_KEY_RANGES["counted"]
    key = next(_instance_counters.setdefault(group, itertools.count(start)))
    if key >= end:
        raise RuntimeError(
            f"Group {group} used up its {end - start} counted instance keys (one per "
            "collective built); rebuild the job in a fresh process."
        )
    return key


def reserve_instance_keys(group: int, count: int) -> int:
    """The first of `count` consecutive counted instance keys for the group with key
    `group` (`next_instance_key`'s, so every member reserving in the same order gets the
    same block)."""
    first = next_instance_key(group)
    for _ in range(count - 1):
        next_instance_key(group)
    return first


def length_keyed_instance(length: tf.Tensor, group: int, unit: int = 1) -> tf.Tensor:
    """An int32 instance key for a collective of the group with key `group` whose length
    changes from step to step.

    `length // unit` (e.g. rows, with `unit` elements per row) must be below 2**20 and
    equal on every member, as the lengths of a gather are.
    """
    counter = _dynamic_counters.setdefault(group, itertools.count())
    base = _DYNAMIC_KEY_BASE + (next(counter) % _DYNAMIC_BLOCKS) * DYNAMIC_BLOCK
    units = tf.cast(length, tf.int32) // unit
    check = tf.debugging.assert_less(
        units, DYNAMIC_BLOCK, message="A dynamic-length collective exceeds 2**20 units"
    )
    with tf.control_dependencies([check]):
        return tf.constant(base, tf.int32) + units


def group_key(devices: Sequence[str]) -> int:
    """A stable key for a set of member devices (same on every worker)."""
    digest = zlib.crc32("|".join(sorted(devices)).encode())
    return _GROUP_KEY_BASE + digest % 0x1000_0000


# The chains of point-to-point transfers (comm/transfer.py), apart from the communicator
# chains 0.. of the group collectives: what a device sends, and what it receives.
TRANSFER_CHAINS = ("sends", "receives")


def ordering_token(device: str, chain: int | str = 0):
    """The resource handle that orders collectives of `chain` on `device`: a communicator
    index, or one of `TRANSFER_CHAINS`."""
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


KEYS_PER_LANE_GROUP = 1 << 12
_LOCAL_KEY_BASE = INSTANCE_KEY_RANGES["local"][0]
_LOCAL_KEY_SPAN = INSTANCE_KEY_RANGES["local"][1] - _LOCAL_KEY_BASE
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
