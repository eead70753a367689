"""Collective communication between devices: the only package that touches collective ops.

* `keys`: instance and group keys, ordering tokens, the rank order of a group;
* `group`: `CollectiveGroup` (all-reduce, reduce-scatter, all-gather over member devices);
* `fusion`: gradient buckets fused into few collectives, the fp16 wire format, sparse rows;
* `lanes`: collectives issued lane by lane by split layers, and Megatron's tensor-parallel
  operators (`copy_to_group`, `reduce_from_group`, `scatter_to_group`, `gather_from_group`);
* `transfer`: point-to-point transfers between stages on different workers.

The names below are the package's interface; the engine uses them as `comm.<name>`.
"""

from epl_trainer.core.comm.fusion import (
    all_gather_slices,
    batch_independent,
    constant_value,
    fused_all_reduce,
    plan_buckets,
    reduce_scatter,
)
from epl_trainer.core.comm.group import CollectiveGroup
from epl_trainer.core.comm.keys import (
    KEYS_PER_LANE_GROUP,
    TRANSFER_CHAINS,
    collective_rank_order,
    group_key,
    length_keyed_instance,
    next_instance_key,
    ordering_token,
    reserve_instance_keys,
    reserve_local_instance_keys,
)
from epl_trainer.core.comm.lanes import LaneCollectives, rows_in_block
from epl_trainer.core.comm.transfer import PairTransfer

__all__ = [
    "KEYS_PER_LANE_GROUP",
    "TRANSFER_CHAINS",
    "CollectiveGroup",
    "LaneCollectives",
    "PairTransfer",
    "all_gather_slices",
    "batch_independent",
    "collective_rank_order",
    "constant_value",
    "fused_all_reduce",
    "group_key",
    "length_keyed_instance",
    "next_instance_key",
    "ordering_token",
    "plan_buckets",
    "reduce_scatter",
    "reserve_instance_keys",
    "reserve_local_instance_keys",
    "rows_in_block",
]
