"""Where the pieces of a step live: lanes, stage groups, and the variables of each stage.

Computed once from the cut model, the engine state and the job's lanes; the program,
the gradient reduction and the updates all read this one description instead of each
other's attributes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from epl_trainer.core import comm
from epl_trainer.core.engine.state import EngineState, Lane
from epl_trainer.core.graph.partition import StagedModel


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """Attributes:
    staged: the model cut into stages.
    state: the engine-owned variables (per lane, per shard, or shared on the host).
    lanes: this worker's lanes.
    stage_groups[k]: the collective group of stage k over every lane of the job.
    trainable_idx[k]: model-order indices of the trainable variables stage k owns, in
      the model's order.
    read_idx[k]: the trainable indices stage k's sub-model reads, in its own variable
      order (the same set as `trainable_idx[k]`, plus a tied weight another stage owns
      (state.py), whose copy it then reads: `stage_variables`).
    non_trainable_idx[k]: stage k's non-trainable indices, in its sub-model's order.
    reduced_idx[k]: stage k's trainable indices reduced over `stage_groups[k]` (split
      layers' sharded variables are reduced over their shard group instead).
    host: this worker's host device.
    stage_lanes[k]: positions (in `lanes`) of the local lanes that compute stage k here;
      `stage_groups[k].local_devices` lists their stage-k devices in this order. Every
      local lane computes every stage unless a replica spans workers.
    hosts: every worker's host device, in worker order.
    """

    staged: StagedModel
    state: EngineState
    lanes: tuple[Lane, ...]
    stage_groups: tuple[comm.CollectiveGroup, ...]
    trainable_idx: tuple[list[int], ...]
    non_trainable_idx: tuple[list[int], ...]
    reduced_idx: tuple[list[int], ...]
    host: str
    read_idx: tuple[list[int], ...] = ()
    stage_lanes: tuple[tuple[int, ...], ...] = ()
    hosts: tuple[str, ...] = ()
    spans_workers: bool = False  # some replica of the job has stages on several workers

    @classmethod
    def create(
        cls,
        staged: StagedModel,
        state: EngineState,
        lanes_in_job: Sequence[Lane],
        host: str,
        hosts: Sequence[str] = (),
    ) -> StepLayout:
        num_stages = len(staged.stages)
        lanes = tuple(state.lanes)
        stage_lanes = tuple(
            tuple(li for li, lane in enumerate(lanes) if lane.is_local(k))
            for k in range(num_stages)
        )
        groups = tuple(
            comm.CollectiveGroup(
                devices=tuple(lane.devices[k] for lane in lanes_in_job),
                local_devices=tuple(lanes[li].devices[k] for li in stage_lanes[k]),
            )
            for k in range(num_stages)
        )
        trainable = tuple(state.stage_indices(k) for k in range(num_stages))
        non_trainable = tuple(state.stage_indices(k, trainable=False) for k in range(num_stages))
        # A stage's sub-model takes its variables in its own order, which is not the
        # model's where the model lists layers in another order than the stage's graph
        # (two output heads: the model's order is its layers', the stage's its nodes').
        read = tuple(
            _in_sub_model_order(stage.model.trainable_variables, state.model_trainable, owned)
            for stage, owned in zip(staged.stages, trainable)
        )
        non_trainable = tuple(
            _in_sub_model_order(stage.model.non_trainable_variables, state.model_non_trainable, o)
            for stage, o in zip(staged.stages, non_trainable)
        )
        return cls(
            staged=staged,
            state=state,
            lanes=lanes,
            stage_groups=groups,
            trainable_idx=trainable,
            non_trainable_idx=non_trainable,
            reduced_idx=tuple([i for i in idx if i not in state.sharded] for idx in trainable),
            host=host,
            read_idx=read,
            stage_lanes=stage_lanes,
            hosts=tuple(hosts) if hosts else (host,),
            spans_workers=any(lane.spans_workers for lane in lanes_in_job),
        )

    def unread_idx(self, k: int) -> frozenset[int]:
        """The trainable indices stage k's sub-model takes but its forward does not read
        (a variable of a layer several stages call, which another stage reads: state.py
        `_stages_of_variables`): their gradient there is no gradient, not a zero."""
        state = self.state
        return frozenset(
            i
            for i in self.read_idx[k]
            if state.trainable_stage[i] != k and k not in state.tied.get(i, ())
        )

    def stage_variables(self, li: int, k: int) -> list:
        """The variables local lane li's stage k reads, in `read_idx[k]` order."""
        return self.state.stage_variables(li, k, self.read_idx[k])

    @property
    def num_stages(self) -> int:
        return len(self.staged.stages)

    def local_stages(self, li: int) -> list[int]:
        """The stages local lane li computes here (all of them unless it spans workers).

        A lane lists one device per TaskGraph; colocated split TaskGraphs make one stage,
        so only the first `num_stages` entries are stages."""
        return [k for k in range(self.num_stages) if self.lanes[li].is_local(k)]

    @property
    def everyone(self) -> comm.CollectiveGroup:
        """Every lane of the job (through its first stage's device); when replicas span
        workers, every stage device of every lane, so each worker has a member (a device
        hosting several stages, interleaved 1F1B, once)."""
        if not self.spans_workers:
            return self.stage_groups[0]
        devices = tuple(dict.fromkeys(d for group in self.stage_groups for d in group.devices))
        local = tuple(dict.fromkeys(d for group in self.stage_groups for d in group.local_devices))
        return comm.CollectiveGroup(devices, local)


def _in_sub_model_order(stage_variables, model_variables, owned: list[int]) -> list[int]:
    """The model-order indices of a stage's variables, in the order its sub-model takes
    them; `owned` (model order) where the engine holds the stage's variables in another
    form than the sub-model's (split layers)."""
    position = {id(v): i for i, v in enumerate(model_variables)}
    order = [position.get(id(v)) for v in stage_variables]
    return owned if None in order else order
