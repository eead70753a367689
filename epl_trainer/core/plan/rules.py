"""Which settings combine: the one home of every such rule.

Each combination the engine refuses is a `Refusal` in `REFUSALS`: the features involved
(`FEATURES`), why they do not combine, and what to do instead. The checks below raise
them, once, before anything is built: `check_config` on the config alone (when the
trainer is created), `check_plan` on the plan it makes, and the checks the engine calls
with what only it can see (tied weights, synchronized BatchNorm layers, ZeRO v2 stage
groups across workers). The features x modes table of the docs
(`tools/features_table.py`) is generated from `REFUSALS`. Rules about one setting on one
model (a split Dense that is not an output, a loss that is not a cross-entropy) stay with
the code that inspects the model (`core/engine/split/layers.py`).

Plain Python: the config is read through its sections' attributes, so this module, like
the rest of `core/plan`, imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from epl_trainer.core.plan.ir import Plan, PlanError, SplitError

# The features and modes a refusal may name, and how the docs' table calls them.
FEATURES = {
    "one_device": "one device",
    "data_parallel": "data parallel",
    "pipeline": "pipeline",
    "split": "tensor split",
    "multi_worker": "multi-worker",
    "stages_across_workers": "stages across workers",
    "zero_v0": "ZeRO v0",
    "zero_v1": "ZeRO v1",
    "zero_v2": "ZeRO v2",
    "offload": "CPU offload",
    "amp": "AMP",
    "gradient_checkpoint": "gradient checkpointing",
    "checkpoint": "checkpoint and resume",
    "jit_compile": "jit_compile (XLA)",
    "steps_per_execution": "steps_per_execution",
    "sync_batch_norm": "synchronized BatchNorm",
    "ema": "optimizer EMA",
    "tied_weights": "tied weights across stages",
    "apply_groups": "optimizer.num_apply_group",
    "clip_global_norm": "global_clipnorm before the reduction",
    "interleaved": "interleaved 1F1B (pipeline.virtual_stages)",
    "user_steps": "a model's own train_step / compute_loss",
    "micro_batches": "gradient accumulation (pipeline.num_micro_batch)",
    "constraints": "weight constraints (kernel_constraint, ...)",
}
ZERO = ("zero_v0", "zero_v1", "zero_v2")


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Settings that do not combine.

    Attributes:
      when: groups of `FEATURES`; the refusal applies when one feature of every group
        is on (`(("split",), ("offload", "gradient_checkpoint"))`: split with either).
      why: why they do not combine.
      instead: what to do instead.
      error: the exception raised.
    """

    when: tuple[tuple[str, ...], ...]
    why: str
    instead: str
    error: type = ValueError

    def __post_init__(self):
        unknown = {f for group in self.when for f in group} - set(FEATURES)
        if unknown:
            raise ValueError(f"Refusal names unknown features {sorted(unknown)}")

    def raise_for(self, received: str):
        raise self.error(f"{self.why} {self.instead} Received: {received}")


REFUSALS = {
    "jit_gradient_checkpoint": Refusal(
        (("jit_compile",), ("gradient_checkpoint",)),
        "jit_compile=True compiles each stage whole, and XLA plans its memory itself: "
        "gradient checkpointing's recomputed segments would not stay separate.",
        "Use one of them.",
    ),
    "stages_across_workers_split": Refusal(
        (("stages_across_workers",), ("split",)),
        "A model replica spanning workers cannot also split its micro-batch or layers over "
        "several devices per stage; only pipeline stages (one device each) can live on "
        "different workers.",
        "Use fewer devices per replica, or cluster.device_place_prefer_intra_node=True.",
        PlanError,
    ),
    "stages_across_workers_host_update": Refusal(
        (("stages_across_workers",), ("offload", "apply_groups")),
        "Stages on different workers cannot be combined with offload.level or "
        "optimizer.num_apply_group yet (ZeRO and gradient checkpointing are fine).",
        "Keep each replica in one worker (cluster.device_place_prefer_intra_node=True, fewer "
        "devices per replica) or remove those settings.",
        PlanError,
    ),
    "split_offload_recompute": Refusal(
        (("split",), ("offload", "gradient_checkpoint")),
        "split layers cannot be combined with offload.level or gradient_checkpoint.type yet.",
        "Remove those settings or the split annotation.",
        SplitError,
    ),
    "split_jit": Refusal(
        (("split",), ("jit_compile",)),
        "split layers exchange rows with collectives inside the stage, which XLA cannot "
        "compile on every device.",
        "Use jit_compile=False.",
        SplitError,
    ),
    "split_steps_per_execution": Refusal(
        # A split layer's collectives fix their shapes by key; a loop of steps in the graph
        # would run them with the shorter last batch of the data under the same keys.
        (("split",), ("steps_per_execution",)),
        "split layers run one training step per call for now.",
        "Use steps_per_execution=1.",
        SplitError,
    ),
    "split_clip_before_reduction": Refusal(
        (("split",), ("clip_global_norm",)),
        "global_clipnorm with split layers needs communication.clip_after_allreduce=True: a "
        "lane's local gradient holds only its shard, so the norm is taken after the reduction.",
        "Set communication.clip_after_allreduce=True.",
        SplitError,
    ),
    "sync_batch_norm_jit": Refusal(
        (("sync_batch_norm",), ("jit_compile",)),
        "Synchronized BatchNorm reduces its batch statistics over the replicas inside each "
        "stage's forward, which jit_compile=True compiles whole with XLA.",
        "Use jit_compile=False or unsynchronized BatchNorm.",
    ),
    "sync_batch_norm_split": Refusal(
        (("sync_batch_norm",), ("split",)),
        "Synchronized BatchNorm cannot be combined with split layers (epl.split) yet.",
        "Remove the split annotation or the synchronization.",
    ),
    "ema_zero": Refusal(
        (("ema",), ZERO),
        "The optimizer's use_ema=True is not supported with ZeRO: the moving averages would "
        "be sharded with the optimizer state.",
        "Use zero.stage=0 with use_ema, or use_ema=False.",
    ),
    "tied_weights": Refusal(
        (("tied_weights",), (*ZERO, "offload", "split", "stages_across_workers")),
        "Each pipeline stage using a tied weight holds a copy, summed and updated together in "
        "one process, which is not combined with ZeRO, offload, split layers or a replica's "
        "stages on several workers yet.",
        "Cut the model so one stage uses the weight (a manual stage map or "
        "pipeline.num_stages=1 with data parallelism), or train without those options.",
    ),
    "interleaved_split": Refusal(
        (("interleaved",), ("split",)),
        "Interleaved 1F1B runs several pipeline stages per device; split TaskGraphs make the "
        "replica one stage whose layers are sharded over its devices, so there is no "
        "pipeline to interleave.",
        "Use pipeline.strategy='PreferBackward' and pipeline.virtual_stages=1 with split layers.",
        SplitError,
    ),
    "zero_v2_recompute_across_workers": Refusal(
        (("zero_v2",), ("gradient_checkpoint",), ("stages_across_workers", "multi_worker")),
        "ZeRO v2 (zero.stage 3) with gradient checkpointing needs the stage groups of the "
        "recomputed stages on one worker: a segment's parameters are re-gathered inside its "
        "backward, which the cross-worker read does not do.",
        "Use zero.level 'v1' there, or turn gradient checkpointing off.",
    ),
    "constraints_sharded": Refusal(
        (("constraints",), ("zero_v0", "zero_v1", "zero_v2", "split")),
        "A weight constraint (kernel_constraint=MaxNorm(...), NonNeg(), ...) is applied to "
        "the whole variable after each update; ZeRO updates pieces of it and split layers "
        "shards of it, where a norm over an axis would be another constraint.",
        "Train the layer with the constraint data-parallel or in a pipeline (constraints "
        "apply there as in Keras), or leave the constraint out under ZeRO and split.",
    ),
    "user_steps_layout": Refusal(
        (
            ("user_steps",),
            (
                "pipeline", "split", "micro_batches", "zero_v0", "zero_v1", "zero_v2",
                "offload", "amp", "gradient_checkpoint", "sync_batch_norm",
                "steps_per_execution", "jit_compile", "checkpoint",
            ),
        ),
        "A model's own train_step (or compute_loss / compute_metrics / test_step / "
        "predict_step) runs whole on each data-parallel lane and applies its own updates: "
        "a layout that cuts the model, its batch into micro-batches or its update, or "
        "replaces its precision or its memory, would have to run a different step.",
        "Train it data-parallel (local devices and workers), with Keras's own "
        "LossScaleOptimizer, ModelCheckpoint or BackupAndRestore where you need them, or "
        "with a Keras layout map to hold its variables sharded (read gathered on use); or "
        "remove the override to use the engine's step (then every layout applies).",
    ),
}  # fmt: skip


def check_config(config) -> None:
    """Refuses config values that cannot apply together, or cannot apply at all."""
    if config.pipeline.num_stages is not None and not config.auto.auto_parallel:
        raise ValueError(
            "pipeline.num_stages only applies to the automatic pipeline "
            "(auto.auto_parallel=True); give stages with epl.replicate scopes or stages=. "
            f"Received: pipeline.num_stages={config.pipeline.num_stages}"
        )
    # The two keys below only tune gradient checkpointing: without a type nothing is
    # checkpointed, so they would be accepted and do nothing.
    checkpointing = config.gradient_checkpoint
    for key, is_set in (
        ("end_taskgraph", checkpointing.end_taskgraph != -1),
        ("check_gradients", checkpointing.check_gradients),
    ):
        if is_set and not checkpointing.type:
            raise ValueError(
                f"gradient_checkpoint.{key} only applies with gradient checkpointing on; "
                "set gradient_checkpoint.type to 'auto' or 'collection' too. Received: "
                f"gradient_checkpoint.{key}={getattr(checkpointing, key)!r}, "
                "gradient_checkpoint.type=''"
            )
    # AMP's other keys only tune AMP: given while it is off they would do nothing.
    if not config.amp.level:
        given = config.given_keys()
        tuned = {
            f"amp.{field.name}": getattr(config.amp, field.name)
            for field in dataclasses.fields(config.amp)
            if field.name != "level"
            and f"amp.{field.name}" in given
            and getattr(config.amp, field.name) != field.default
        }
        if tuned:
            raise ValueError(
                f"{', '.join(tuned)} only apply with AMP on; set amp.level='O1' too, or "
                "drop them. Received: "
                + ", ".join(f"{key}={value!r}" for key, value in tuned.items())
                + ", amp.level=''"
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
    gathered: Sequence[str] = (),
) -> None:
    """Refuses plans the engine cannot execute with these settings.

    Args:
      plan: the plan of the whole job.
      config: the config the plan was made with.
      clip_global_norm: the optimizer's `global_clipnorm`, or None.
      steps_per_execution: training steps per call of the compiled step.
      jit_compile: each stage's forward and backward compiled by XLA.
      gathered: variables held sharded over a replica's lanes and gathered on use (a
        Keras layout's, split/layers.py): their collectives run as split layers' do.
    """
    if jit_compile and config.gradient_checkpoint.type:
        REFUSALS["jit_gradient_checkpoint"].raise_for(
            f"jit_compile=True, gradient_checkpoint.type={config.gradient_checkpoint.type!r}"
        )
    counts = {tg.device_count for tg in plan.taskgraphs}
    if len(counts) != 1:
        raise PlanError(
            "All TaskGraphs of a replica must use the same device_count for now. Received: "
            + ", ".join(f"{tg.name}={tg.device_count}" for tg in plan.taskgraphs)
        )
    split = _split_parts(plan, gathered)
    for replica in range(plan.num_replicas):
        workers = {d.worker for tg in plan.placement[replica] for d in tg}
        if len(workers) == 1:
            continue
        # A replica spanning workers: its stages pass tensors across (boundaries.py).
        where = f"model replica {replica} spans workers {sorted(workers)}"
        if split or any(tg.device_count > 1 for tg in plan.taskgraphs):
            REFUSALS["stages_across_workers_split"].raise_for(
                f"{where}, TaskGraphs "
                + ", ".join(
                    f"{tg.name} ({tg.kind}, {tg.device_count} devices)" for tg in plan.taskgraphs
                )
            )
        combined = _settings_on(
            config,
            "offload.level",
            ("optimizer.num_apply_group", config.optimizer.num_apply_group > 1),
        )
        if combined:
            REFUSALS["stages_across_workers_host_update"].raise_for(f"{where}, {combined}")
    if not split:
        return
    if plan.virtual_stages > 1:
        REFUSALS["interleaved_split"].raise_for(
            f"split TaskGraphs {split}, pipeline.strategy={plan.pipeline_strategy!r}, "
            f"pipeline.virtual_stages={plan.virtual_stages}"
        )
    split_taskgraphs = any(tg.kind == "split" for tg in plan.taskgraphs)
    # A Keras layout's sharded variables under pipeline stages run on each stage's
    # devices: only split TaskGraphs need the replicated ones' devices.
    # Only split TaskGraphs next to others need the flag: a model split whole (EPL's
    # `with epl.split(8): model()`) has nothing to share devices with, and its devices
    # are the same either way (refused before, naming replicated TaskGraphs it had not).
    separate = split_taskgraphs and len(plan.taskgraphs) > 1
    if separate and not plan.colocate_split_and_replicate:
        raise SplitError(
            f"split TaskGraphs {split} need cluster.colocate_split_and_replicate=True (the "
            "split layers then share the devices of the replicated ones, EPL's documented "
            "recipe); split on separate devices is not supported."
        )
    combined = _settings_on(config, "offload.level", "gradient_checkpoint.type")
    if combined:
        REFUSALS["split_offload_recompute"].raise_for(f"split TaskGraphs {split}, {combined}")
    if jit_compile:
        REFUSALS["split_jit"].raise_for("jit_compile=True")
    if steps_per_execution > 1:
        REFUSALS["split_steps_per_execution"].raise_for(
            f"steps_per_execution={steps_per_execution}"
        )
    if clip_global_norm is not None and not config.communication.clip_after_allreduce:
        REFUSALS["split_clip_before_reduction"].raise_for(f"global_clipnorm={clip_global_norm}")


def _split_parts(plan: Plan, gathered: Sequence[str]) -> list[str]:
    """The split TaskGraphs' names, and the gathered variables' as one more part."""
    split = [tg.name for tg in plan.taskgraphs if tg.kind == "split"]
    return split + ([f"variables gathered on use {list(gathered)[:4]}"] if gathered else [])


def check_user_steps(
    methods,
    plan: Plan,
    config,
    steps_per_execution: int = 1,
    jit_compile: bool = False,
) -> None:
    """A model overriding `methods` (user_steps.py) runs data parallelism, where a Keras
    layout map may hold variables sharded (its own steps read them gathered on use)."""
    if not methods:
        return
    refused = []
    if len(plan.taskgraphs) > 1:
        refused.append(f"{len(plan.taskgraphs)} pipeline stages")
    split = [tg.name for tg in plan.taskgraphs if tg.kind == "split"]
    if split:
        refused.append(f"split TaskGraphs {split}")
    if plan.num_micro_batch > 1:
        refused.append(f"pipeline.num_micro_batch={plan.num_micro_batch}")
    refused += [
        setting
        for setting in _settings_on(
            config,
            "zero.level",
            "offload.level",
            "amp.level",
            "gradient_checkpoint.type",
            "batch_norm.synchronized",
            "checkpoint.dir",
        ).split(", ")
        if setting
    ]
    if steps_per_execution > 1:
        refused.append(f"steps_per_execution={steps_per_execution}")
    if jit_compile is True:
        refused.append("jit_compile=True")
    if refused:
        REFUSALS["user_steps_layout"].raise_for(
            f"the model overrides {', '.join(methods)}; with {', '.join(refused)}"
        )


def check_constraints(constrained: list[str], config, split: bool) -> None:
    """`constrained`: the paths of the model's trainable variables with a constraint."""
    if not constrained:
        return
    sharded = [f"zero.level={config.zero.level!r}"] if config.zero.level else []
    sharded += ["split layers"] if split else []
    if sharded:
        REFUSALS["constraints_sharded"].raise_for(
            f"constrained variables {constrained} with {' and '.join(sharded)}"
        )


def check_sync_batch_norm(synchronized: str, jit_compile: bool, split: bool) -> None:
    """Synchronized BatchNorm reduces inside the forward; `synchronized` names what asks
    for it (the config key or the layers)."""
    if jit_compile:
        REFUSALS["sync_batch_norm_jit"].raise_for(f"{synchronized}, jit_compile=True")
    if split:
        REFUSALS["sync_batch_norm_split"].raise_for(f"{synchronized} with split layers")


def check_ema(zero) -> None:
    """`use_ema=True` where lanes update shards; `zero`: the config's zero section."""
    if zero.level:
        REFUSALS["ema_zero"].raise_for(
            f"use_ema=True, zero.stage={zero.stage} (zero.level={zero.level!r})"
        )


def check_tied_weights(tied: str, config, split: bool, spans_workers: bool) -> None:
    """`tied` names the weights several pipeline stages use (and those stages)."""
    refused = [
        *([f"zero.level={config.zero.level!r}"] if config.zero.level else []),
        *([f"offload.level={config.offload.level!r}"] if config.offload.level else []),
        *(["split layers"] if split else []),
        *(["a replica's stages on several workers"] if spans_workers else []),
    ]
    if refused:
        REFUSALS["tied_weights"].raise_for(f"tied weight(s) {tied} with {' and '.join(refused)}")


def check_zero_v2_recompute(spanning_stages, recomputed_stages) -> None:
    """ZeRO v2 stages whose group spans workers cannot also be recomputed."""
    both = sorted(set(spanning_stages) & set(recomputed_stages))
    if both:
        REFUSALS["zero_v2_recompute_across_workers"].raise_for(
            f"recomputed stage(s) {both} have replicas on other workers"
        )


def _settings_on(config, *keys) -> str:
    """`key=value` of the given settings that are on; a key may be `(name, is_on)`."""
    on = []
    for key in keys:
        name, is_on = key if isinstance(key, tuple) else (key, None)
        section, field = name.split(".")
        value = getattr(getattr(config, section), field)
        if is_on if is_on is not None else bool(value):
            on.append(f"{name}={value!r}")
    return ", ".join(on)
