"""Assembles the engine for one plan: state, program, and the passes applied to it.

The passes run in this order, each a small function that takes the program under
construction and changes how part of the step is built (never a flag tested inside the
step):

1. state placement: per-lane copies on the stage devices, or one shared copy on the
   host (`offload.level="v0"`);
2. the update: ZeRO's sharded reduce / apply / gather (`zero.level` "v0" or "v1",
   zero.py), or plain all-reduce + apply (`ReplicatedUpdate`, with grouped apply when
   `optimizer.num_apply_group` > 1 and a single host-side apply under offload).
"""

from __future__ import annotations

from epl_trainer.config import Config
from epl_trainer.core.partition import StagedModel
from epl_trainer.core.program import Program, ProgramOptions
from epl_trainer.core.state import EngineState
from epl_trainer.core.update import ReplicatedUpdate
from epl_trainer.core.zero import ZeroUpdate


def build_engine(
    staged: StagedModel,
    lanes,
    lanes_in_job,
    config: Config,
    host_device: str,
    loss_fn,
    metrics,
    loss_tracker,
    make_optimizer,
    clip_global_norm=None,
    step_counter=None,
) -> tuple[EngineState, Program]:
    """Creates the engine state and the program for this worker's lanes."""
    offload = config.offload.level == "v0"
    state = EngineState(staged, lanes, host_device=host_device if offload else None)
    options = ProgramOptions(
        num_micro_batch=config.pipeline.num_micro_batch,
        gradients_reduce_method=config.communication.gradients_reduce_method,
        max_splits=config.communication.max_splits,
        num_communicators=config.communication.num_communicators,
        clip_after_allreduce=config.communication.clip_after_allreduce,
        pipeline_strategy=config.pipeline.strategy,
    )
    program = Program(
        staged,
        state,
        lanes_in_job,
        loss_fn,
        metrics,
        loss_tracker,
        options,
        host_device,
        clip_global_norm=clip_global_norm,
        step_counter=step_counter,
    )
    if config.zero.level:
        if offload or config.optimizer.num_apply_group > 1:
            raise ValueError(
                "zero.level shards the optimizer across replicas and cannot be combined with "
                f"offload.level or optimizer.num_apply_group yet. Received: zero.level="
                f"{config.zero.level!r}, offload.level={config.offload.level!r}, "
                f"optimizer.num_apply_group={config.optimizer.num_apply_group}"
            )
        program.update = ZeroUpdate(program, make_optimizer, level=config.zero.level)
        return state, program
    program.update = ReplicatedUpdate(
        program,
        make_optimizer,
        num_apply_group=config.optimizer.num_apply_group,
        shared_variables=offload,
        apply_device=host_device if offload else None,
    )
    return state, program
