"""How a training step is compiled: the trainer's `jit_compile`, or "auto" by a rule.

Three ways to use XLA:

* per stage (`compiled_stage_call`): each stage's forward and its backward compile
  separately; the only way for a pipeline, whose tasks run on several devices.
* the whole step (`Program(compile_gradients=True)`): forward, backward, loss and
  metrics of a step that runs on one device are one XLA function, as Keras compiles
  its step with `jit_compile=True`. The optimizer update stays outside it, inside the
  finiteness check (finite.py), itself compiled by `optimizer.jit_compile`: a skipped
  step inside XLA would select between new and old values of every variable and
  optimizer slot, a pass over all of them each step.
* per lane (`Program(compile_lanes=True)`, compiled_lanes.py): data parallelism on one
  worker, each lane's forward and backward one XLA function on its device; the
  reduction, update and metrics outside.

`jit_compile="auto"` (the default unless the user or the Keras model chose) compiles the
step of one device whole when oneDNN is off, and keeps plain ops otherwise. Without
oneDNN, TensorFlow's own MatMul kernel is slow on a weight gradient's product over a
small batch, where XLA's is fast; with oneDNN the two are level, and compiling buys
nothing but the compile time. Data parallelism on one worker follows the same rule, each
lane compiled whole. Pipelines keep plain ops: compiled stages were slower than plain
ones with oneDNN on and off. The measurements behind the rule are in
docs/benchmarks.md#when-a-step-compiles-with-xla.
"""

from __future__ import annotations

import dataclasses

from epl_trainer.core.graph.peak import onednn_enabled

AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class JitChoice:
    """Attributes:
    compile: the step uses XLA (per stage, per lane or as a whole).
    whole_step: forward, backward and metrics are one XLA function.
    per_lane: each lane's forward and backward is one XLA function on its device.
    reason: why, for the log line.
    """

    compile: bool
    whole_step: bool
    per_lane: bool
    reason: str

    @property
    def per_stage(self) -> bool:
        """Each stage's forward (and its backward) compiled on its own."""
        return self.compile and not (self.whole_step or self.per_lane)


NO_XLA = JitChoice(False, False, False, "jit_compile=False")


def compiles_lanes(plan, config, synchronized: bool = False, sharded=()) -> bool:
    """Whether each lane's forward and backward runs on one device, whole: one worker,
    one replicated TaskGraph on one device per replica, one micro-batch, nothing that
    needs a lane's step cut into parts (ZeRO's per-micro-batch reduction,
    recomputation, synchronized BatchNorm's collectives: `synchronized`, the model has
    such layers; a Keras layout's sharded variables, gathered or looked up with
    collectives inside the lane: `sharded`, their paths)."""
    return not lanes_cut_because(plan, config, synchronized, sharded)


def lanes_cut_because(plan, config, synchronized: bool = False, sharded=()) -> str:
    """Why a lane's step is cut into parts that are not compiled as one ("" if it is
    not): the first reason `compiles_lanes` finds, for the logged choice."""
    sharded = list(sharded)
    reasons = (
        (plan.worker_num > 1, f"the job has {plan.worker_num} workers"),
        (len(plan.taskgraphs) > 1, f"the lanes have {len(plan.taskgraphs)} stages"),
        (plan.taskgraphs[0].kind != "replicate", "the layers are split across devices"),
        (plan.devices_per_replica > 1, f"a replica spans {plan.devices_per_replica} devices"),
        (plan.num_micro_batch > 1, f"each step has {plan.num_micro_batch} micro-batches"),
        (bool(config.zero.level), f"ZeRO {config.zero.level} reduces per micro-batch"),
        (bool(config.gradient_checkpoint.type), "gradient checkpointing cuts the lanes"),
        (synchronized, "synchronized BatchNorm's collectives run inside the lanes"),
        # A layout sharding only over the batch axis (KerasHub's maps on an (N, 1) mesh)
        # leaves one device per replica, but its blocks are gathered inside the lanes.
        (bool(sharded), f"variables laid out sharded {sharded[:4]} are gathered in the lanes"),
    )
    return next((why for cut, why in reasons if cut), "")


def layers_without_xla(model) -> list[str]:
    """The model's layers that say they do not compile with XLA (Keras's `supports_jit`,
    e.g. StringLookup, Hashing), as Keras's own "auto" asks; every layer when TensorFlow's
    op determinism is on, which XLA does not support for every op."""
    layers = list(model._flatten_layers(include_self=False))  # Keras's own walk
    try:
        from tensorflow.python.framework.config import is_op_determinism_enabled
    except ImportError:  # moved: then only the layers say
        is_op_determinism_enabled = bool
    if is_op_determinism_enabled():
        return ["all (op determinism is on)"]
    return [layer.name for layer in layers if not getattr(layer, "supports_jit", True)]


def choose(
    jit_compile, plan, config, synchronized: bool = False, without_xla: list = (), sharded=()
) -> JitChoice:
    """The trainer's `jit_compile` (True, False or "auto") for this plan.

    Args:
      synchronized: the model has synchronized BatchNorm layers (which XLA refuses).
      without_xla: `layers_without_xla(model)`: "auto" then keeps plain ops.
      sharded: the paths of variables a Keras layout holds sharded, read through
        collectives in the step (which XLA refuses: "auto" keeps plain ops).
    """
    cut_because = lanes_cut_because(plan, config, synchronized, sharded)
    lanes = not cut_because
    whole = lanes and plan.num_replicas == 1
    if jit_compile != AUTO:
        compile_ = bool(jit_compile)
        how = "the whole step" if whole else "each lane" if lanes else "each stage"
        return JitChoice(
            compile_, compile_ and whole, compile_ and lanes and not whole,
            f"jit_compile=True ({how})" if compile_ else "jit_compile=False",
        )  # fmt: skip
    if onednn_enabled():
        return JitChoice(False, False, False, "auto: plain ops, oneDNN is on (as fast as XLA here)")
    if without_xla:
        return JitChoice(False, False, False, f"auto: plain ops, no XLA for layers {without_xla}")
    why = "oneDNN is off (TF's MatMul is slow without it)"
    if whole:
        return JitChoice(True, True, False, f"auto: the whole step in XLA, {why}")
    if lanes:
        return JitChoice(True, False, True, f"auto: each lane in XLA, {why}")
    return JitChoice(False, False, False, f"auto: plain ops, {cut_because}")
