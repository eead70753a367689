"""The update half of a step: reduce gradients across lanes, clip, apply the optimizer.

`ReplicatedUpdate` is plain data parallelism: every lane all-reduces its stage
gradients (fused buckets) and applies its own optimizer copy. Its options are the
memory features that do not change where gradients go:

* `num_apply_group` (grouped apply): each (lane, stage) update runs as N size-balanced
  groups, each with its own optimizer copy built on that group's variables, chained by
  control dependencies so one group's temporaries are freed before the next starts;
* `shared_variables` (offload): the local lanes share one copy of the variables on the
  host; it is updated once per worker, on the host, after the reduction.

Every update has the same phases, so the finiteness check (finite.py) can sit between
them with no collective inside its conditional: `reduce` (all collectives, run every
step), `apply` (the optimizers only, skipped on a non-finite step) and `finish` (what
follows the apply everywhere; ZeRO gathers the updated shards there). `reduced_agree`
says whether every lane holds the same reduced gradients, so that each can decide
finiteness alone. Each optimizer runs as an `OptimizerStep` (apply.py): XLA-compiled
with `optimizer.jit_compile`.

ZeRO (zero.py) replaces the reduction and the apply with sharded versions.
"""

from __future__ import annotations

import tensorflow as tf

from epl_trainer.core import comm
from epl_trainer.core.engine.state import variable_bytes
from epl_trainer.core.engine.update.apply import OptimizerStep


def balanced_groups(sizes: list[int], num_groups: int) -> list[list[int]]:
    """Contiguous runs of indices with about equal total size (at most num_groups)."""
    buckets = comm.plan_buckets(sizes, ["same"] * len(sizes), max(1, num_groups))
    return [sorted(b) for b in buckets]


def written(variables) -> list:
    """Markers that exist once `variables` have been written (ops on a resource run in
    program order). One element of each is kept: holding whole reads would force copies
    when later groups write."""
    return [tf.reshape(v.value.read_value(), [-1])[:1] for v in variables]


class ReplicatedUpdate:
    """All-reduce, optional global-norm clip, then apply on every lane (or on the host).

    Args:
      layout: the step layout (lanes, stages, state).
      reduction: the gradient reduction and clipping (reduce.py).
      make_optimizer: `(device, variables) -> built Keras optimizer`.
      num_apply_group: optimizer.num_apply_group.
      shared_variables: lanes share one variable copy (offload): apply once, on `apply_device`.
      apply_device: where shared variables live (the host).
      jit_compile: compile each optimizer's update with XLA (`optimizer.jit_compile`:
        True, False or "auto", apply.py).
    """

    def __init__(
        self,
        layout,
        reduction,
        make_optimizer,
        num_apply_group: int = 1,
        shared_variables: bool = False,
        apply_device: str | None = None,
        jit_compile: bool | str = False,
    ):
        self.layout = layout
        self.reduction = reduction
        self.shared_variables = shared_variables
        state = layout.state
        lanes = layout.lanes[:1] if shared_variables else layout.lanes
        self.groups = []  # groups[stage] = list of index lists (model order)
        for k in range(layout.num_stages):
            idx = layout.trainable_idx[k]
            sizes = [int(state.model_trainable[i].value.shape.num_elements()) for i in idx]
            self.groups.append(
                [[idx[j] for j in g] for g in balanced_groups(sizes, num_apply_group)]
                if idx
                else []
            )
        # optimizers[lane][stage][group]; none for a stage on another worker
        self.optimizers = [
            [
                [
                    make_optimizer(
                        apply_device or lane.devices[k], [state.trainable[li][i] for i in group]
                    )
                    for group in self.groups[k]
                ]
                if lane.is_local(k)
                else []
                for k in range(layout.num_stages)
            ]
            for li, lane in enumerate(lanes)
        ]
        # steps[lane][stage][group]: the optimizers' updates, compiled where they compile.
        self.steps = [
            [
                [
                    OptimizerStep(
                        optimizer,
                        [state.trainable[li][i] for i in group],
                        self.optimizers_device(li, k),
                        jit_compile,
                    )
                    for group, optimizer in zip(self.groups[k], stage_optimizers)
                ]
                for k, stage_optimizers in enumerate(lane_optimizers)
            ]
            for li, lane_optimizers in enumerate(self.optimizers)
        ]
        # Split layers' sharded gradients differ from lane to lane.
        self.reduced_agree = not state.sharded

    def __call__(self, lane_grads: list[list]) -> None:
        self.apply(self.reduce(lane_grads))
        self.finish()

    def reduce(self, lane_grads: list[list]) -> list[list]:
        """Every lane's reduced (and clipped) gradients, in model order."""
        reduction = self.reduction
        if reduction.clip_before:
            lane_grads = reduction.clip_each(lane_grads)
        reduced = reduction.all_reduce(lane_grads)
        if reduction.clip_after:
            reduced = reduction.clip_each(reduced)
        return reduced

    def reduced_of_lane(self, reduced: list[list], li: int) -> list:
        return reduced[li]

    def apply(self, reduced: list[list]) -> None:
        state = self.layout.state
        for li, lane_steps in enumerate(self.steps):
            for k, stage_steps in enumerate(lane_steps):
                previous = []
                # Last layers first: backward produces their gradients first, so each
                # group can run (and free its gradients) while backward continues.
                pairs = list(zip(self.groups[k], stage_steps))[::-1]
                for position, (group, step) in enumerate(pairs):
                    with tf.control_dependencies(previous):
                        step([reduced[li][i] for i in group])
                        if position + 1 < len(pairs):  # the next group waits for this one
                            with tf.device(step.device):
                                previous = written(state.trainable[li][i] for i in group)

    def finish(self) -> None:
        """Every lane updated its own copy; the stage copies of tied weights (state.py)
        then take their owner's new value (on a skipped step, the value they have)."""
        self.layout.state.sync_stage_copies()

    def optimizers_device(self, li: int, stage: int) -> str:
        variables = self.optimizers[li][stage][0].variables if self.optimizers[li][stage] else []
        return variables[0].value.device if variables else self.layout.lanes[li].devices[stage]

    def local_optimizers(self) -> list[tuple[int, object, list]]:
        """[(local lane position, optimizer, the variables it updates)] on this worker."""
        return [
            (li, step.optimizer, step.variables)
            for li, lane_steps in enumerate(self.steps)
            for stage_steps in lane_steps
            for step in stage_steps
        ]

    def slot_owners(self) -> dict[int, str]:
        """{trainable index: device of the lane whose slots a checkpoint saves}: none here,
        every lane holds the slots of every variable (the lowest lane's are saved)."""
        return {}

    def piece_spans(self) -> dict:
        """ZeRO's pieces held here (zero/update.py): none, every lane holds whole slots."""
        return {}

    @property
    def state_spans_workers(self) -> bool:
        """Whether some optimizer state lives only on other workers: a stage's, when a
        replica's stages are on several workers, or a block's of a variable laid out
        over a batch axis whose replicas are on several workers (master_state.py
        exchanges it)."""
        return self.layout.spans_workers or bool(self.layout.state.blocks_elsewhere())

    def gradient_bytes(self) -> dict[str, int]:
        """Bytes of reduced gradients per compute device (every lane holds its full stage)."""
        layout, usage = self.layout, {}
        for li, lane in enumerate(layout.lanes):
            for k in layout.local_stages(li):
                device = lane.devices[k]
                count = sum(
                    variable_bytes(layout.state.trainable[li][i]) for i in layout.trainable_idx[k]
                )
                usage[device] = usage.get(device, 0) + count
        return usage

    def all_optimizer_variables(self) -> list:
        return [v for lane in self.optimizers for stage in lane for o in stage for v in o.variables]

    def parameter_pieces(self) -> list:
        """Parameters held outside the lanes' variables: none (ZeRO v2 has some)."""
        return []
