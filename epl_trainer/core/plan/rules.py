"""Which settings combine: the one home of every such rule.

Checked once, before anything is built: `check_config` on the config alone (when the
trainer is created), `check_plan` on the plan it makes. Each refusal names the
settings involved and what to do instead. Rules that depend on the model itself (a
split Dense that is not an output, a loss that is not a cross-entropy) stay with the
code that inspects the model (`core/engine/split/layers.py`).

Plain Python: the config is read through its sections' attributes, so this module, like
the rest of `core/plan`, imports no TensorFlow.
"""

from __future__ import annotations

from epl_trainer.core.plan.ir import Plan, PlanError, SplitError


def check_config(config) -> None:
    """Refuses config values that cannot apply together, or cannot apply at all."""
    if config.pipeline.num_stages is not None and not config.auto.auto_parallel:
        raise ValueError(
            "pipeline.num_stages only applies to the automatic pipeline "
            "(auto.auto_parallel=True); give stages with epl.replicate scopes or stages=. "
            f"Received: pipeline.num_stages={config.pipeline.num_stages}"
        )
    if config.auto.auto_parallel and config.pipeline.num_stages is None:
        raise ValueError(
            "auto.auto_parallel=True needs pipeline.num_stages (how many stages to cut). "
            "Received: pipeline.num_stages=None"
        )


def check_plan(
    plan: Plan,
    config,
    clip_global_norm: float | None = None,
    steps_per_execution: int = 1,
    jit_compile: bool = False,
) -> None:
    """Refuses plans the engine cannot execute with these settings.

    Args:
      plan: the plan of the whole job.
      config: the config the plan was made with.
      clip_global_norm: the optimizer's `global_clipnorm`, or None.
      steps_per_execution: training steps per call of the compiled step.
      jit_compile: each stage's forward and backward compiled by XLA.
    """
    if jit_compile and config.gradient_checkpoint.type:
        raise ValueError(
            "jit_compile=True compiles each stage whole, and XLA plans its memory itself: "
            "gradient checkpointing's recomputed segments would not stay separate. Use "
            "one of them. Received: jit_compile=True, gradient_checkpoint.type="
            f"{config.gradient_checkpoint.type!r}"
        )
    counts = {tg.device_count for tg in plan.taskgraphs}
    if len(counts) != 1:
        raise PlanError(
            "All TaskGraphs of a replica must use the same device_count for now. Received: "
            + ", ".join(f"{tg.name}={tg.device_count}" for tg in plan.taskgraphs)
        )
    split = [tg.name for tg in plan.taskgraphs if tg.kind == "split"]
    for replica in range(plan.num_replicas):
        workers = {d.worker for tg in plan.placement[replica] for d in tg}
        if len(workers) == 1:
            continue
        # A replica spanning workers: its stages pass tensors across (boundaries.py).
        if split or any(tg.device_count > 1 for tg in plan.taskgraphs):
            raise PlanError(
                f"Model replica {replica} spans workers {sorted(workers)} and splits its "
                "micro-batch or layers over several devices per stage; only pipeline stages "
                "(one device each) can live on different workers. Use fewer devices per "
                "replica, or cluster.device_place_prefer_intra_node=True."
            )
        combined = {
            "offload.level": config.offload.level,
            "optimizer.num_apply_group": config.optimizer.num_apply_group
            if config.optimizer.num_apply_group > 1
            else None,
        }
        combined = {k: v for k, v in combined.items() if v}
        if combined:
            raise PlanError(
                f"Model replica {replica} spans workers {sorted(workers)}; stages on "
                "different workers cannot be combined with "
                + ", ".join(f"{k}={v!r}" for k, v in combined.items())
                + " yet (ZeRO and gradient checkpointing are fine). Keep each replica in one "
                "worker (cluster.device_place_prefer_intra_node=True, fewer devices per replica) "
                "or remove those settings."
            )
    if not split:
        return
    if not plan.colocate_split_and_replicate:
        raise SplitError(
            f"split TaskGraphs {split} need cluster.colocate_split_and_replicate=True (the "
            "split layers then share the devices of the replicated ones, EPL's documented "
            "recipe); split on separate devices is not supported."
        )
    combined = {
        "offload.level": config.offload.level,
        "gradient_checkpoint.type": config.gradient_checkpoint.type,
    }
    combined = {k: v for k, v in combined.items() if v}
    if combined:
        raise SplitError(
            "split layers cannot be combined with "
            + ", ".join(f"{k}={v!r}" for k, v in combined.items())
            + " yet; remove those settings or the split annotation."
        )
    if jit_compile:
        raise SplitError(
            "split layers exchange rows with collectives inside the stage, which XLA cannot "
            "compile on every device; use jit_compile=False. Received: jit_compile=True"
        )
    if steps_per_execution > 1:
        # A split layer's collectives fix their shapes by key; a loop of steps in the graph
        # would run them with the shorter last batch of the data under the same keys.
        raise SplitError(
            "split layers run one training step per call for now; use "
            f"steps_per_execution=1. Received: steps_per_execution={steps_per_execution}"
        )
    if clip_global_norm is not None and not config.communication.clip_after_allreduce:
        raise SplitError(
            "global_clipnorm with split layers needs communication.clip_after_allreduce=True: "
            "a lane's local gradient holds only its shard, so the norm is taken after the "
            f"reduction. Received: global_clipnorm={clip_global_norm}"
        )
