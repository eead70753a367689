"""Assembles the engine for one plan: state, program, and the passes applied to it.

The passes run in this order, each a small function that takes the program under
construction and changes how part of the step is built (never a flag tested inside the
step):

1. state placement: per-lane copies on the stage devices, or one shared copy on the
   host (`offload.level="v0"`);
2. gradient checkpointing (`gradient_checkpoint.type`): the checkpointed stages run as
   segments whose insides are recomputed in backward (recompute.py);
3. the update (below);
4. AMP (`amp.level="O1"`): loss scaling around the update: the objective is scaled,
   local gradients unscaled, and the whole update skipped unless every lane's gradients
   are finite (the model itself was switched to a mixed dtype policy before the state
   was created, see `amp.apply_mixed_precision`).

The update: ZeRO's sharded reduce / apply / gather (`zero.level` "v0" or "v1",
   zero.py), or plain all-reduce + apply (`ReplicatedUpdate`, with grouped apply when
   `optimizer.num_apply_group` > 1 and a single host-side apply under offload).
"""

from __future__ import annotations

import tensorflow as tf
from keras import tree

from epl_trainer.config import Config
from epl_trainer.core.engine import amp, split
from epl_trainer.core.engine.pipeline import training_kwargs
from epl_trainer.core.engine.program import Program, ProgramOptions
from epl_trainer.core.engine.recompute import apply_recompute
from epl_trainer.core.engine.state import EngineState
from epl_trainer.core.engine.update import ReplicatedUpdate
from epl_trainer.core.engine.zero import ZeroUpdate
from epl_trainer.core.graph.partition import StagedModel


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
    split_layers=(),
    split_width: int = 1,
    checkpoint_marks=(),
) -> tuple[EngineState, Program]:
    """Creates the engine state and the program for this worker's lanes."""
    offload = config.offload.level == "v0"
    if split_layers:
        _check_split_compatible(config, clip_global_norm)
    sharded = {sv.index: sv for layer in split_layers for sv in layer.variables}
    state = EngineState(
        staged, lanes, host_device=host_device if offload else None, sharded=sharded
    )

    def make_state_optimizer(device, variables):
        # The user's optimizer decides per original variable (e.g. AdamW's exclusions).
        return make_optimizer(device, variables, [state.original_of(v) for v in variables])

    options = ProgramOptions(
        num_micro_batch=config.pipeline.num_micro_batch,
        gradients_reduce_method=config.communication.gradients_reduce_method,
        max_splits=config.communication.max_splits,
        num_communicators=config.communication.num_communicators,
        clip_after_allreduce=config.communication.clip_after_allreduce,
        pipeline_strategy=config.pipeline.strategy,
        fp16_scale=config.communication.fp16_scale if config.communication.fp16 else None,
        sparse_gradients=not config.communication.sparse_as_dense,
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
    if split_layers:
        runtime = split.SplitRuntime(
            split_layers,
            lanes,
            lanes_in_job,
            split_width,
        )
        apply_split(program, runtime)
    if config.gradient_checkpoint.type:
        apply_recompute(program, config.gradient_checkpoint, checkpoint_marks)
    if config.zero.level:
        if config.communication.fp16:
            raise ValueError(
                "communication.fp16 compresses all-reduced gradients; ZeRO reduce-scatters "
                f"them and does not support it yet. Received: zero.level={config.zero.level!r}, "
                "communication.fp16=True"
            )
        if offload or config.optimizer.num_apply_group > 1:
            raise ValueError(
                "zero.level shards the optimizer across replicas and cannot be combined with "
                f"offload.level or optimizer.num_apply_group yet. Received: zero.level="
                f"{config.zero.level!r}, offload.level={config.offload.level!r}, "
                f"optimizer.num_apply_group={config.optimizer.num_apply_group}"
            )
        program.update = ZeroUpdate(program, make_state_optimizer, level=config.zero.level)
    else:
        program.update = ReplicatedUpdate(
            program,
            make_state_optimizer,
            num_apply_group=config.optimizer.num_apply_group,
            shared_variables=offload,
            apply_device=host_device if offload else None,
        )
    if config.amp.level:
        apply_amp(program, config.amp, host_device)
    else:
        apply_nonfinite_guard(program, host_device, config.optimizer.nonfinite_loss == "skip")
    return state, program


def _check_split_compatible(config: Config, clip_global_norm) -> None:
    combined = {
        "zero.level": config.zero.level,
        "offload.level": config.offload.level,
        "gradient_checkpoint.type": config.gradient_checkpoint.type,
    }
    combined = {k: v for k, v in combined.items() if v}
    if combined:
        raise split.SplitError(
            "split layers cannot be combined with "
            + ", ".join(f"{k}={v!r}" for k, v in combined.items())
            + " yet; remove those settings or the split annotation."
        )
    if clip_global_norm is not None and not config.communication.clip_after_allreduce:
        raise split.SplitError(
            "global_clipnorm with split layers needs communication.clip_after_allreduce=True: "
            "a lane's local gradient holds only its shard, so the norm is taken after the "
            f"reduction. Received: global_clipnorm={clip_global_norm}"
        )


def apply_split(program: Program, runtime) -> None:
    """Split layers run on the lane's shards; split outputs get the sharded loss."""
    program.split = runtime
    num_outputs = len(tree.flatten(program.staged.model.outputs))
    loss = split.SplitLoss(program.loss_fn, runtime, num_outputs)
    split.check_split_metrics(program.metrics, runtime.layers)
    program.loss_fn = loss
    for executor in program.executors:
        executor.loss_fn = loss
    for k, stage in enumerate(program.staged.stages):
        call = split.split_stage_call(stage.model, runtime, training_kwargs)
        program.stage_calls[k] = call
        program.eval_stage_calls[k] = call


def apply_nonfinite_guard(program: Program, host_device: str, skip_metrics: bool) -> None:
    """Without AMP: a step whose gradients are not finite is skipped everywhere and counted.

    A NaN or Inf loss gives non-finite gradients, and applying them would destroy the
    weights and the optimizer state. As under AMP (where the loss scaler owns this), every
    lane checks its gradients and one scalar all-reduce makes the decision global. The
    trainer reads the `nonfinite_steps` log after each step and stops with an error
    naming the step, or warns and goes on (`optimizer.nonfinite_loss`); when it goes on
    (`skip_metrics`), non-finite micro-batch losses are also left out of the running
    metrics, so one bad batch does not turn the epoch's loss into NaN.
    """
    with tf.init_scope(), tf.device(host_device):
        count = tf.Variable(0, dtype=tf.int64, trainable=False, name="nonfinite_steps")
    inner = program.update
    everyone = program.stage_groups[0]

    def update_if_finite(lane_grads: list[list]) -> None:
        flags = []
        for lane, grads in zip(program.lanes, lane_grads):
            with tf.device(lane.devices[0]):
                flags.append(tf.cast(amp.all_finite(grads), tf.float32))
        finite_everywhere = everyone.all_reduce(flags, "sum")[0] >= everyone.size
        applied = amp.apply_if_finite(finite_everywhere, lambda: inner(lane_grads))
        with tf.device(host_device):
            count.assign_add(tf.cast(tf.logical_not(applied), tf.int64))

    if skip_metrics:
        update_metrics = program._update_metrics

        def update_finite_metrics(labels, y_pred, loss) -> None:
            def update():
                update_metrics(labels, y_pred, loss)
                return tf.constant(True)

            with tf.device(host_device):
                finite = tf.reduce_all(tf.math.is_finite(loss))
            tf.cond(finite, update, lambda: tf.constant(False))

        program._update_metrics = update_finite_metrics
    program.extra_logs["nonfinite_steps"] = count.value
    program.update = GuardedUpdate(inner, update_if_finite)


class GuardedUpdate:
    """An update wrapped by a finiteness check: same interface and state as `inner`."""

    def __init__(self, inner, call):
        self.inner, self._call = inner, call

    def __call__(self, lane_grads) -> None:
        self._call(lane_grads)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def apply_amp(program: Program, amp_config, host_device: str) -> None:
    """Loss scaling around the program's update (DeepSpeed's dynamic scaler or a fixed one).

    Every lane checks its own unscaled gradients; one scalar all-reduce over all lanes of
    the job makes the decision global, so every lane and worker applies or skips together
    (the collectives inside a skipped update are skipped everywhere).
    """
    scaler = amp.make_loss_scaler(amp_config, host_device)
    program.loss_scale = scaler.scale
    program.output_cast = amp.float32_outputs
    program.extra_logs.update(
        loss_scale=scaler.scale, skipped_steps=lambda: scaler.skipped_steps.value()
    )
    if isinstance(scaler, amp.FixedLossScaler):
        # A fixed scale (bfloat16, or a number) never recovers from a non-finite step: it
        # would skip every following step in silence. The trainer reads this count and
        # stops or warns as optimizer.nonfinite_loss says, as it does without AMP.
        program.extra_logs["nonfinite_steps"] = lambda: scaler.skipped_steps.value()
    inner = program.update
    everyone = program.stage_groups[0]

    def update_if_finite(lane_grads: list[list]) -> None:
        scale = scaler.scale()
        lane_grads = [amp.unscale_gradients(grads, scale) for grads in lane_grads]
        flags = []
        for lane, grads in zip(program.lanes, lane_grads):
            with tf.device(lane.devices[0]):
                flags.append(tf.cast(amp.all_finite(grads), tf.float32))
        finite_everywhere = everyone.all_reduce(flags, "sum")[0] >= everyone.size
        amp.apply_if_finite(finite_everywhere, lambda: inner(lane_grads))
        scaler.update(finite_everywhere)

    program.update = AmpUpdate(inner, update_if_finite, scaler)


class AmpUpdate:
    """An update wrapped by loss scaling: same interface, plus the scaler's state."""

    def __init__(self, inner, call, scaler):
        self.inner, self._call, self.scaler = inner, call, scaler

    def __call__(self, lane_grads) -> None:
        self._call(lane_grads)

    def checkpoint_variables(self) -> dict:
        named = dict(self.inner.checkpoint_variables())
        named.update({f"amp/{i}": v for i, v in enumerate(self.scaler.variables)})
        return named

    def __getattr__(self, name):
        return getattr(self.inner, name)
