"""Assembles the engine for one plan: state, step hooks, and the passes that fill them.

The passes run in this order, each a small function that fills slots of the step's
`StepHooks` (hooks.py), never a flag tested inside the step:

1. mixed precision (`amp.level="O1"`): the model's layers get mixed dtype policies
   before any state exists, so the engine's variables stay float32 and `stateless_call`
   casts on use (amp.py);
2. state placement: per-lane copies on the stage devices, or one shared copy on the host
   (`offload.level="v0"`); a stage copy of each tied weight (one several stages use),
   whose layouts tied.py checks;
3. split (split annotations): split layers run on each lane's shards, split outputs get
   the sharded loss, and the lane hooks reduce sharded gradients (split_lanes.py);
4. gradient checkpointing (`gradient_checkpoint.type`): the checkpointed stages run as
   segments whose insides are recomputed in backward (recompute.py); after split, so the
   recomputed stages are the ones whose forward is plain; then, when the step uses XLA
   (the trainer's `jit_compile`, jit_choice.py), each stage's forward (and so its
   backward) is compiled, or on one device the whole step (`Program`'s
   `compile_gradients`);
5. synchronized BatchNorm (`batch_norm.synchronized`, or layers built with
   `synchronized=True`): each lane's forward computes the batch statistics of its
   synchronized layers over every replica (sync_batch_norm.py); after the passes that
   choose the stage calls, which it runs inside, and before the update, whose
   collectives follow its own in every lane;
6. the update: ZeRO's sharded reduce / apply / gather (`zero.level`, zero.py; v2 holds
   the parameters only as pieces, zero_params.py), or plain
   all-reduce + apply (update.py, with grouped apply and offload), both on the gradient
   reduction of reduce.py (`communication.*`, global-norm clipping), each optimizer
   XLA-compiled where it compiles (`optimizer.jit_compile`, apply.py);
7. the finiteness check between the update's reduction and its apply (finite.py): AMP's
   loss scaling, or the non-finite guard; last, because it wraps whatever update the
   step has.
"""

from __future__ import annotations

import logging

import keras

from epl_trainer.core import comm
from epl_trainer.core.comm.hosts import host_group, host_of
from epl_trainer.core.engine.engine import Engine, EnginePlan
from epl_trainer.core.engine.hooks import StepHooks
from epl_trainer.core.engine.layout import StepLayout
from epl_trainer.core.engine.pipeline import (
    WeightExchange,
    compiled_stage_call,
    stateless_stage_call,
)
from epl_trainer.core.engine.precision import (
    apply_amp,
    apply_mixed_precision,
    apply_nonfinite_guard,
)
from epl_trainer.core.engine.program import Program
from epl_trainer.core.engine.recompute import apply_recompute
from epl_trainer.core.engine.split import apply_split
from epl_trainer.core.engine.state import EngineState
from epl_trainer.core.engine.sync_batch_norm import apply_sync_batch_norm
from epl_trainer.core.engine.tied import check_tied_weights
from epl_trainer.core.engine.update import GradientReduction, ReplicatedUpdate
from epl_trainer.core.engine.user_steps import UserSteps
from epl_trainer.core.engine.zero import (
    SegmentGathers,
    ZeroUpdate,
    splits_variables,
)
from epl_trainer.core.plan import rules

logger = logging.getLogger(__name__)


def build_engine(
    engine_plan: EnginePlan,
    config,
    host_device: str,
    loss_fn,
    metrics,
    loss_tracker,
    make_optimizer,
    clip_global_norm: float | None = None,
    step_counter=None,
    checkpoint_marks=(),
    agree_on_batches=None,
) -> Engine:
    """Creates the engine state and the program for this worker's lanes.

    Args:
      engine_plan: from `plan_engine` (the plan, the cut model, the lanes).
      config: the job's `Config` (each pass reads its own section).
      host_device: this worker's host CPU.
      loss_fn: the trainer's `CompiledLoss`: `.terms(labels, y_pred, sample_weight)`,
        `.flat_labels(labels, y_pred)`, `.trackers` (Keras's mean per output loss).
      metrics: the trainer's `CompiledMetrics`: (flat output index, Keras metric) pairs,
        `.name(metric)`, `.weighted_ids` (the metrics given the data's sample weights).
      loss_tracker: the running mean of the loss.
      make_optimizer: `(device, variables, originals) -> built Keras optimizer`.
      clip_global_norm: the optimizer's `global_clipnorm`, applied over all stages.
      step_counter: the optimizer's `iterations`.
      checkpoint_marks: the user's `add_to_collection` marks.
      agree_on_batches: several workers: the end-of-data agreement in graph ops, which a
        loop of steps runs before each step (`Program`).
    """
    staged, plan = engine_plan.staged, engine_plan.plan
    if config.amp.level:
        changed = apply_mixed_precision(staged.model, config.amp.dtype)
        if config.amp.debug_log:
            logger.info(
                "AMP %s: %d layers compute in %s: %s",
                config.amp.level,
                len(changed),
                config.amp.dtype,
                changed,
            )
    offload = config.offload.level == "v0"
    split_layers = engine_plan.split_layers
    state = EngineState(
        staged,
        engine_plan.lanes,
        host_device=host_device if offload else None,
        sharded={sv.index: sv for layer in split_layers for sv in layer.variables},
        own_first_lane=bool(engine_plan.user_steps),
    )
    devices_by_worker = [[d.name for d in devices] for devices in _devices_by_worker(plan)]
    hosts = [host_of(devices[0]) for devices in devices_by_worker]
    layout = StepLayout.create(staged, state, engine_plan.lanes_in_job, host_device, hosts)
    check_tied_weights(state, config, split_layers, layout.spans_workers)
    rules.check_constraints(
        [v.path for v in state.model_trainable if v.constraint is not None],
        config,
        split=bool(split_layers),
    )
    partial = frozenset(state.blocks_elsewhere())
    if layout.spans_workers or partial:
        group = host_group(devices_by_worker, hosts[plan.worker_index])
        first_lane = engine_plan.lanes_in_job[0]
        state.exchange = WeightExchange(
            state, first_lane, group, plan.worker_index, layout.spans_workers, partial
        )
    calls = [stateless_stage_call(stage.model) for stage in staged.stages]
    hooks = StepHooks(stage_calls=calls, eval_stage_calls=list(calls), loss_fn=loss_fn)
    if split_layers:
        width = plan.taskgraphs[0].device_count
        apply_split(
            hooks, layout, split_layers, engine_plan.lanes_in_job, width, config.communication
        )
    if config.gradient_checkpoint.type:
        apply_recompute(hooks, staged, config.gradient_checkpoint, checkpoint_marks)
    # Before compiling: a compiled stage takes the rows its BatchNorm layers count.
    apply_sync_batch_norm(hooks, layout, config.batch_norm.synchronized)
    statistics = hooks.batch_statistics
    xla = engine_plan.jit
    if xla.per_stage:
        hooks.stage_calls = [
            compiled_stage_call(call, k, statistics) for k, call in enumerate(hooks.stage_calls)
        ]
    if xla.compile:
        hooks.eval_stage_calls = [
            compiled_stage_call(call, k, statistics)
            for k, call in enumerate(hooks.eval_stage_calls)
        ]
    reduction = GradientReduction(layout, config.communication, hooks.lanes, clip_global_norm)

    def make_state_optimizer(device, variables):
        # The user's optimizer decides per original variable (e.g. AdamW's exclusions).
        return make_optimizer(device, variables, [state.original_of(v) for v in variables])

    jit = config.optimizer.jit_compile
    tables = embedding_tables(staged.model, state.model_trainable)
    if config.zero.level:
        hooks.update = ZeroUpdate(
            layout,
            reduction,
            make_state_optimizer,
            level=config.zero.level,
            jit_compile=jit,
            # Cut variables into pieces only for an element-wise update (a probe replica
            # of the user's optimizer, on no variables, tells).
            split_variables=splits_variables(make_optimizer(host_device, [], [])),
            row_aligned=tables,
            apply_device=host_device if offload else None,
            num_apply_group=config.optimizer.num_apply_group,
        )
        hooks.gradient_sink = hooks.update.micro_batch_grads
        if config.zero.level == "v2" and not xla.compile:
            # Checkpointed stages gather per segment, again in backward (an XLA-compiled
            # stage takes values: it gathers once per step, as the other stages do).
            hooks.gather_per_segment = dict.fromkeys(hooks.recomputed, SegmentGathers)
            rules.check_zero_v2_recompute(hooks.update.spanning_stages, hooks.gather_per_segment)
    else:
        hooks.update = ReplicatedUpdate(
            layout,
            reduction,
            make_state_optimizer,
            num_apply_group=config.optimizer.num_apply_group,
            shared_variables=offload,
            apply_device=host_device if offload else None,
            jit_compile=jit,
        )
    _make_ordering_tokens(layout, config.communication.num_communicators)
    program_steps = None
    if engine_plan.user_steps:
        program_steps = _user_steps_factory(staged.model, state, layout)
    program = Program(
        layout,
        hooks,
        metrics,
        loss_tracker,
        num_micro_batch=plan.num_micro_batch,
        pipeline_strategy=plan.pipeline_strategy,
        virtual_stages=plan.virtual_stages,
        sparse_gradients=not config.communication.sparse_as_dense,
        step_counter=step_counter,
        embedding_tables=tables,
        data_shards=engine_plan.data_shards[0],
        weighted_metrics=metrics.weighted_ids,
        output_loss_trackers=loss_fn.trackers,
        agree_on_batches=agree_on_batches,
        compile_gradients=xla.whole_step,
        compile_lanes=xla.per_lane,
        user_steps=program_steps,
    )
    skip = config.optimizer.nonfinite_loss == "skip"
    if config.amp.level:
        apply_amp(hooks, layout, config.amp, stop_on_nonfinite=not skip)
    else:
        apply_nonfinite_guard(hooks, layout, skip_metrics=skip)
    return Engine(engine_plan, state, program)


def _user_steps_factory(model, state, layout):
    """`program -> UserSteps`: the model's own steps on this worker's lanes."""

    def make(program):
        return UserSteps(
            model,
            state,
            layout.lanes,
            layout.stage_groups[0],
            layout.host,
            store_non_trainable=program._store_non_trainable,
            # A Keras layout's blocks: read through the split pass's lane collectives.
            runtime=getattr(program.hooks.lanes, "runtime", None),
        )

    return make


def _make_ordering_tokens(layout, num_chains: int) -> None:
    """Creates the ordering-token variables the step's collectives use (comm.keys) on
    this worker's devices, one per communicator chain and the transfers' two, before the
    step is traced. A tf.function that creates a variable in its first trace traces
    again to run: made inside, they cost a second trace of the whole training step
    (docs/benchmarks.md#tracing-once)."""
    devices = {layout.host}
    for group in layout.stage_groups:
        devices.update(group.local_devices)
    for device in sorted(devices):
        for chain in (*range(num_chains), *comm.TRANSFER_CHAINS):
            comm.ordering_token(device, chain)


def embedding_tables(model, trainable) -> frozenset:
    """Indices in `trainable` of Embedding tables (their gradient is IndexedSlices of
    rows; ZeRO cuts them on row boundaries)."""
    tables = {
        id(layer.embeddings)
        for layer in model._flatten_layers()
        if isinstance(layer, keras.layers.Embedding)
    }
    return frozenset(i for i, v in enumerate(trainable) if id(v) in tables)


def _devices_by_worker(plan) -> list[list]:
    """Each worker's devices in the plan, in worker order."""
    by_worker: dict[int, list] = {}
    for replica in plan.placement:
        for devices in replica:
            for device in devices:
                by_worker.setdefault(device.worker, []).append(device)
    return [by_worker[w] for w in sorted(by_worker)]
