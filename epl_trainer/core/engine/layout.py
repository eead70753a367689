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
    trainable_idx[k], non_trainable_idx[k]: model-order indices of stage k's variables.
    reduced_idx[k]: stage k's trainable indices reduced over `stage_groups[k]` (split
      layers' sharded variables are reduced over their shard group instead).
    host: this worker's host device.
    """

    staged: StagedModel
    state: EngineState
    lanes: tuple[Lane, ...]
    stage_groups: tuple[comm.CollectiveGroup, ...]
    trainable_idx: tuple[list[int], ...]
    non_trainable_idx: tuple[list[int], ...]
    reduced_idx: tuple[list[int], ...]
    host: str

    @classmethod
    def create(
        cls, staged: StagedModel, state: EngineState, lanes_in_job: Sequence[Lane], host: str
    ) -> StepLayout:
        num_stages = len(staged.stages)
        lanes = tuple(state.lanes)
        groups = tuple(
            comm.CollectiveGroup(
                devices=tuple(lane.devices[k] for lane in lanes_in_job),
                local_devices=tuple(lane.devices[k] for lane in lanes),
            )
            for k in range(num_stages)
        )
        trainable = tuple(state.stage_indices(k) for k in range(num_stages))
        return cls(
            staged=staged,
            state=state,
            lanes=lanes,
            stage_groups=groups,
            trainable_idx=trainable,
            non_trainable_idx=tuple(
                state.stage_indices(k, trainable=False) for k in range(num_stages)
            ),
            reduced_idx=tuple([i for i in idx if i not in state.sharded] for idx in trainable),
            host=host,
        )

    @property
    def num_stages(self) -> int:
        return len(self.staged.stages)

    @property
    def everyone(self) -> comm.CollectiveGroup:
        """Every lane of the job (through its first stage's device)."""
        return self.stage_groups[0]
