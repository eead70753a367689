"""Optimizer updates compiled with XLA (`optimizer.jit_compile`, "auto" by default).

Keras 3 optimizers update each variable with a handful of separate ops (Adam: about ten
per variable), each a full pass over memory. Compiled with XLA, those ops fuse into one
loop per variable, about three times faster on large arrays. XLA's compile costs a
fraction of a second to seconds per update, and a compiled update gains only where the
arrays are large, so "auto" compiles an update of at least `AUTO_MIN_ELEMENTS` (1M)
parameters; smaller ones (a small model's, or a ZeRO shard of one) run as plain ops,
where a short run never repays the compile (the measurements:
docs/benchmarks.md#when-a-compiled-update-pays).

`OptimizerStep` wraps one optimizer built on its variables (one per lane and stage,
group, ZeRO shard or the offload host) and runs `optimizer.apply(grads, variables)`
as an XLA-compiled function where it compiles, else as plain ops:

* A compiled function may read only resources on its own device. The engine's replica
  optimizers share the user's learning-rate variable (so LR callbacks reach every
  replica), which lives on the host. Here each optimizer gets its own copy of that
  variable, refreshed from the user's before every update, outside the compiled code.
* Whether an optimizer compiles is found out when the engine is built: its update is
  lowered to XLA's HLO for the gradient shapes it will see, without running anything.
  If lowering fails (a custom optimizer with ops XLA lacks), a warning names the
  optimizer and the reason, and that update runs as plain ops. The answer is kept for
  the process, keyed by the optimizer's class and config and the variables' shapes,
  dtypes and device type: every lane of a data-parallel layout, and every later trainer
  of the same optimizer on the same model, would lower the same update again (for Adam
  on a small model, two lanes: ~0.5 s each, a third of the first fit).
"""

from __future__ import annotations

import logging

import keras
import tensorflow as tf

logger = logging.getLogger(__name__)

# `optimizer.jit_compile: auto` compiles updates of at least this many elements.
AUTO_MIN_ELEMENTS = 1_000_000

# Why an update does not lower to HLO ("" if it does), by `_lowering_key` (see the module
# docstring).
_LOWERING_FAILURES: dict[tuple, str] = {}


class OptimizerStep:
    """`step(grads)` applies `grads` to `variables` with `optimizer` on `device`.

    Args:
      optimizer: a Keras optimizer built on `variables`.
      variables: the variables it updates (engine copies or shards).
      device: where the variables (and the optimizer's slots) live.
      jit_compile: compile the update with XLA (`optimizer.jit_compile`): True, False,
        or "auto" (`auto_compiles`).
    """

    def __init__(self, optimizer, variables, device: str, jit_compile: bool | str):
        self.optimizer = optimizer
        self.variables = list(variables)
        self.device = device
        self._mirrors = []  # (local copy, source) of cross-device learning-rate variables
        self.jit_compile = False
        if jit_compile == "auto":
            jit_compile = auto_compiles(self.variables)
        if jit_compile:
            self._mirror_learning_rate()
            failure = self._lowering_failure()
            if failure:
                logger.warning(
                    "optimizer.jit_compile: %s does not compile with XLA on %s; its update "
                    "runs as plain TensorFlow ops. Reason: %s",
                    type(self.optimizer).__name__,
                    self.device,
                    failure,
                )
            self.jit_compile = not failure

        def apply(grads):
            optimizer.apply(grads, self.variables)

        self._plain = apply
        self._compiled = tf.function(apply, jit_compile=True, autograph=False)

    def __call__(self, grads) -> None:
        with tf.device(self.device):
            for local, source in self._mirrors:
                local.assign(source.value)
            if self.jit_compile:
                self._compiled(list(grads))
            else:
                self._plain(list(grads))

    def _mirror_learning_rate(self) -> None:
        rate = self.optimizer._learning_rate
        if not isinstance(rate, keras.Variable) or _same_device(rate, self.device):
            return
        with tf.init_scope(), tf.device(self.device):
            # Copied to the device first: a variable made from a tensor stays with it.
            value = tf.identity(rate.value)
            local = keras.Variable(value, dtype=rate.dtype, trainable=False, name="lr")
        self.optimizer._learning_rate = local
        self._mirrors.append((local, rate))

    def _lowering_failure(self) -> str:
        """Why the update does not lower to HLO ("" if it does), lowered once per key."""
        key = self._lowering_key()
        if key is None:
            return self._lower()
        if key not in _LOWERING_FAILURES:
            _LOWERING_FAILURES[key] = self._lower()
        return _LOWERING_FAILURES[key]

    def _lowering_key(self) -> tuple | None:
        """What decides whether this update lowers to HLO, or None if the optimizer has
        no config to tell one instance from another (then it is probed every time)."""
        try:
            config = dict(self.optimizer.get_config())
        except Exception:  # a custom optimizer without a usable get_config
            return None
        # Neither the name nor the learning rate's value changes the ops (a schedule's
        # config does: it stays).
        config.pop("name", None)
        if isinstance(config.get("learning_rate"), (int, float)):
            config["learning_rate"] = "a number"
        config = repr(sorted(config.items()))
        device_type = tf.DeviceSpec.from_string(self.device).device_type
        shapes = tuple((tuple(v.shape), v.dtype) for v in self.variables)
        return (type(self.optimizer), config, shapes, device_type)

    def _lower(self) -> str:
        """Lowers the update to HLO for dense gradients shaped like the variables; returns
        why it failed, or "" if it lowered. Nothing runs and no state changes. (Keras's
        optimizers also compile with the IndexedSlices of an Embedding's gradient:
        scatter ops are XLA ops.)"""
        probe = tf.function(
            lambda grads: self.optimizer.apply(grads, self.variables),
            jit_compile=True,
            autograph=False,
        )
        try:
            with tf.init_scope(), tf.device(self.device):
                grads = [tf.zeros(v.shape, v.dtype) for v in self.variables]
                probe.experimental_get_compiler_ir(grads)(stage="hlo")
        except Exception as error:
            return str(error).splitlines()[0][:300] or type(error).__name__
        return ""


def auto_compiles(variables) -> bool:
    """`optimizer.jit_compile: auto`: whether the update of `variables` is compiled (it
    covers at least `AUTO_MIN_ELEMENTS` parameters; a variable of unknown size counts as
    large)."""
    total = 0
    for variable in variables:
        shape = tf.TensorShape(variable.shape)
        if not shape.is_fully_defined():
            return True
        total += shape.num_elements()
    return total >= AUTO_MIN_ELEMENTS


def _same_device(variable, device: str) -> bool:
    def key(name):
        spec = tf.DeviceSpec.from_string(name)
        return spec.job or "localhost", spec.task or 0, spec.device_type, spec.device_index or 0

    return key(variable.value.device) == key(device)
