"""Memory-efficient mixed precision (EPL's `amp.level="O1"`) and loss scaling.

TensorFlow's original AMP keeps a float16 copy of every weight next to the float32
one; EPL's memory-efficient AMP instead casts each weight when it is used and frees the
cast afterwards. Keras 3 mixed dtype policies do exactly that: variables stay float32,
a layer computes in float16/bfloat16, and each variable read inside the layer's call is
cast on the fly (autocast). `apply_mixed_precision` puts such policies on an already
built model, so the engine's variables and `stateless_call` are unchanged; only the
dtypes of the activations change.

Loss scaling keeps small float16 gradients from flushing to zero: the objective is
multiplied by the scale before the backward pass and the gradients are divided by it
afterwards; a step whose gradients are not finite is skipped. The dynamic schedule is
DeepSpeed's (`deepspeed/runtime/fp16/loss_scaler.py`, `DynamicLossScaler.update_scale`
with `consecutive_hysteresis=False`, its default; scale factor 2), driven by the
`amp.initial_scale_power`, `amp.loss_scale_window`, `amp.hysteresis` and
`amp.min_loss_scale` keys (DeepSpeed's `fp16` section):

- overflow: if the remaining hysteresis is 1 (or `hysteresis == 1`), the scale halves,
  but not below `min_loss_scale`; overflowing *at* the minimum is an error. Otherwise
  the remaining hysteresis drops by one and the scale stays. Either way the step is
  remembered as the last overflow.
- no overflow: when `(step - last_overflow_step) % loss_scale_window == 0`, the scale
  doubles (capped at `MAX_LOSS_SCALE`) and the hysteresis is restored. Clean steps
  alone do not restore it (that would be `consecutive_hysteresis=True`).
- the step counter advances after every update; the last overflow starts at -1, so
  the first doubling comes after `loss_scale_window` clean steps.

`LossScaleSchedule` is that algorithm in plain Python (the reference for tests);
`DynamicLossScaler` is the same in TensorFlow variables, updated inside the step.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import keras
import tensorflow as tf
from keras import tree

# In-graph assertion messages start with this; `min_scale_error` turns them into errors.
MIN_SCALE_ERROR = "Loss scale hit amp.min_loss_scale="
# Far above anything float16 needs (its largest value is 65504), and low enough that
# doubling never reaches float32 infinity (an infinite scale could never shrink again).
MAX_LOSS_SCALE = 2.0**64

MIXED_POLICIES = {"float16": "mixed_float16", "bfloat16": "mixed_bfloat16"}


class MinLossScaleError(RuntimeError):
    """The gradients overflowed while the loss scale was at `amp.min_loss_scale`."""


# ---- mixed-precision compute ----------------------------------------------------------


def apply_mixed_precision(
    model: keras.Layer, dtype: str, keep_float32: str | None = None
) -> list[str]:
    """Makes a built model compute in `dtype` while its variables stay float32.

    Every layer (the model itself, nested models, sublayers of custom layers) whose
    policy is plain "float32" gets the mixed policy of `dtype` — the state a model
    built under `keras.config.set_dtype_policy("mixed_float16")` would have. No
    variable is created, replaced or cast in place: each read inside a layer's call
    is cast to `dtype` and the cast is transient. Keras's layers keep their
    numerically sensitive parts in float32 themselves (LayerNormalization and
    BatchNormalization normalise in float32; Embedding gathers from its float32 table
    and casts the rows). Input layers keep their dtype, and layers with another policy
    (integer preprocessing, an explicit float64, an existing mixed policy) are left
    alone, so the function is idempotent.

    The model's outputs come out in `dtype`; pass them through `float32_outputs`
    before the loss and metrics (Keras losses would cast them too, but would lose the
    cached logits of a softmax/sigmoid output and fall back to clipped probabilities).

    Args:
      model: a built Keras layer or model.
      dtype: "float16" or "bfloat16" (`amp.dtype`).
      keep_float32: a regex; layers whose name it fully matches (`re.fullmatch`) stay
        float32, together with their sublayers.

    Returns:
      The layers changed, each named by the chain of layer names leading to it from the
      model ("attention/query", "nested/block/inner"); the model itself by its name.

    Raises:
      ValueError: `dtype` is not a low-precision float, or the model is not built.
    """
    if dtype not in MIXED_POLICIES:
        raise ValueError(
            f"apply_mixed_precision expects dtype in {list(MIXED_POLICIES)} (amp.dtype). "
            f"Received: dtype={dtype!r}"
        )
    if not model.built:
        raise ValueError(
            f"apply_mixed_precision needs a built model (its variables must exist). "
            f"Call it on a batch first. Received: unbuilt {type(model).__name__} {model.name!r}"
        )
    keep = re.compile(keep_float32) if keep_float32 is not None else None
    policy = keras.DTypePolicy(MIXED_POLICIES[dtype])
    changed: list[str] = []
    seen: set[int] = set()

    def visit(layer: keras.Layer, path: str) -> None:
        if id(layer) in seen or isinstance(layer, keras.layers.InputLayer):
            return
        seen.add(id(layer))
        if keep is not None and keep.fullmatch(layer.name):
            return
        if _is_plain_float32(layer.dtype_policy):
            layer.dtype_policy = policy
            changed.append(path or layer.name)
        for sublayer in layer._flatten_layers(include_self=False, recursive=False):
            visit(sublayer, f"{path}/{sublayer.name}" if path else sublayer.name)

    visit(model, "")
    return changed


def _is_plain_float32(policy) -> bool:
    return (
        not isinstance(policy, keras.dtype_policies.DTypePolicyMap)
        and policy.quantization_mode is None
        and policy.variable_dtype == "float32"
        and policy.compute_dtype == "float32"
    )


def float32_outputs(outputs):
    """Casts every floating tensor of a nested structure to float32 (others unchanged).

    A softmax or sigmoid output carries its logits for Keras's crossentropy losses
    (`_keras_logits`), which then compute from logits, stably; a plain cast would drop
    them. They are carried over, cast to float32, so the loss runs from float32 logits
    — as TensorFlow's automatic mixed precision (which EPL's AMP is built on) keeps
    softmax cross-entropy in float32. A Keras mask (`_keras_mask`, e.g. from
    `Embedding(mask_zero=True)`) is carried over too. A no-op on float32 tensors.
    """

    def cast(x):
        if not isinstance(x, tf.Tensor) or not x.dtype.is_floating or x.dtype == tf.float32:
            return x
        y = tf.cast(x, tf.float32)
        logits = getattr(x, "_keras_logits", None)
        mask = getattr(x, "_keras_mask", None)  # a padding mask the loss divides by
        try:
            if logits is not None:
                y._keras_logits = tf.cast(logits, tf.float32)
            if mask is not None:
                y._keras_mask = mask
        except AttributeError:  # an eager tensor may refuse new attributes
            pass
        return y

    return tree.map_structure(cast, outputs)


# ---- loss-scaling arithmetic ---------------------------------------------------------


def scale_loss(loss: tf.Tensor, scale) -> tf.Tensor:
    """`loss * scale`, in the loss's dtype (the objective whose gradients are taken)."""
    return loss * tf.cast(scale, loss.dtype)


def unscale_gradients(grads: Sequence, scale) -> list:
    """Each gradient times `1 / scale` (computed once, in float32), on its own device.

    None entries stay None; `tf.IndexedSlices` keep their indices.
    """
    inverse = tf.math.reciprocal(tf.cast(scale, tf.float32))
    unscaled = []
    for g in grads:
        if g is None:
            unscaled.append(None)
            continue
        with tf.device(g.device):
            if isinstance(g, tf.IndexedSlices):
                values = g.values * tf.cast(inverse, g.values.dtype)
                unscaled.append(tf.IndexedSlices(values, g.indices, g.dense_shape))
            else:
                unscaled.append(g * tf.cast(inverse, g.dtype))
    return unscaled


def all_finite(tensors: Sequence) -> tf.Tensor:
    """A scalar bool: no tensor holds an inf or a NaN (None entries are ignored).

    Each tensor is checked on its own device; only the per-tensor flags move.
    """
    flags = []
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, tf.IndexedSlices):
            t = t.values
        with tf.device(t.device):
            flags.append(tf.reduce_all(tf.math.is_finite(t)))
    if not flags:
        return tf.constant(True)
    return tf.reduce_all(tf.stack(flags))


def apply_if_finite(finite: tf.Tensor, apply_fn: Callable[[], object]) -> tf.Tensor:
    """Runs `apply_fn` (the optimizer apply) only when `finite`; returns `finite`.

    A skipped step leaves the variables, the optimizer slots and its iteration count
    untouched (DeepSpeed skips the step the same way). The optimizers must already be
    built: variables cannot be created inside a `tf.cond` branch.
    """

    def apply():
        apply_fn()
        return tf.constant(True)

    return tf.cond(finite, apply, lambda: tf.constant(False))


# ---- loss-scale schedules --------------------------------------------------------------


def _check_dynamic_args(initial_scale, window, hysteresis, min_scale) -> None:
    terms = (
        f"Received: initial_scale={initial_scale}, loss_scale_window={window}, "
        f"hysteresis={hysteresis}, min_loss_scale={min_scale}"
    )
    if window < 1 or hysteresis < 1:
        raise ValueError(f"amp.loss_scale_window and amp.hysteresis must be >= 1. {terms}")
    if not 0 < min_scale <= initial_scale <= MAX_LOSS_SCALE:
        raise ValueError(
            "Dynamic loss scaling needs 0 < amp.min_loss_scale <= 2**amp.initial_scale_power "
            f"<= {MAX_LOSS_SCALE:g}. {terms}"
        )


def _min_scale_message(min_scale: float, step) -> str:
    return (
        f"{MIN_SCALE_ERROR}{min_scale:g} and the gradients still overflow (inf or NaN) at "
        f"step {step}. Lower amp.min_loss_scale, try amp.dtype='bfloat16', or look for the "
        "source of the non-finite values (learning rate, data)."
    )


class LossScaleSchedule:
    """DeepSpeed's dynamic loss scaling in plain Python (see the module docstring).

    Attributes mirror DeepSpeed's: `scale` (cur_scale), `cur_iter`,
    `last_overflow_iter`, `cur_hysteresis`; plus `skipped_steps`.
    """

    def __init__(self, initial_scale: float, window: int, hysteresis: int, min_scale: float = 1.0):
        _check_dynamic_args(initial_scale, window, hysteresis, min_scale)
        self.scale = float(initial_scale)
        self.window = window
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = hysteresis
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        """Advances one step.

        Raises:
          MinLossScaleError: `overflow` while the scale is at the minimum.
        """
        if overflow:
            self.skipped_steps += 1
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.scale == self.min_scale:
                    raise MinLossScaleError(_min_scale_message(self.min_scale, self.cur_iter + 1))
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.window == 0:
            self.cur_hysteresis = self.hysteresis
            self.scale = min(self.scale * 2, MAX_LOSS_SCALE)
        self.cur_iter += 1


class DynamicLossScaler:
    """`LossScaleSchedule` in TensorFlow variables, for use inside a `tf.function`.

    Build it outside any `tf.function` (it creates variables). `scale()` reads the
    current scale; `update(finite)` advances the schedule with graph arithmetic only
    (`tf.where`, no Python branch on tensors). Overflowing at the minimum scale fails
    an in-graph `tf.debugging.Assert` whose message starts with `MIN_SCALE_ERROR`
    (before any state changes); `min_scale_error` turns that error into a
    `MinLossScaleError`.

    Args:
      initial_scale: the first scale (`2**amp.initial_scale_power`).
      window: clean steps between doublings (`amp.loss_scale_window`).
      hysteresis: overflows that halve the scale (`amp.hysteresis`).
      min_scale: the lowest scale (`amp.min_loss_scale`).
      device: where the state lives (the host).
      debug_log: print DeepSpeed-style overflow messages from the graph (`amp.debug_log`).
    """

    def __init__(
        self,
        initial_scale: float,
        window: int,
        hysteresis: int,
        min_scale: float,
        device: str,
        debug_log: bool = False,
    ):
        _check_dynamic_args(initial_scale, window, hysteresis, min_scale)
        self.window = window
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.device = device
        self.debug_log = debug_log
        with tf.init_scope(), tf.device(device):
            self._scale = tf.Variable(initial_scale, dtype=tf.float32, trainable=False)
            self.cur_iter = tf.Variable(0, dtype=tf.int64, trainable=False)
            self.last_overflow_iter = tf.Variable(-1, dtype=tf.int64, trainable=False)
            self.cur_hysteresis = tf.Variable(hysteresis, dtype=tf.int64, trainable=False)
            self.skipped_steps = tf.Variable(0, dtype=tf.int64, trainable=False)

    @property
    def variables(self) -> list[tf.Variable]:
        return list(self.named_variables.values())

    @property
    def named_variables(self) -> dict[str, tf.Variable]:
        """The state to checkpoint with the model, by name."""
        return {
            "scale": self._scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
            "skipped_steps": self.skipped_steps,
        }

    def scale(self) -> tf.Tensor:
        """The current loss scale, a float32 scalar."""
        with tf.device(self.device):
            return self._scale.read_value()

    def update(self, finite) -> None:
        """Advances the schedule by one step; `finite` is a scalar bool tensor."""
        with tf.device(self.device):
            overflow = tf.logical_not(tf.convert_to_tensor(finite, tf.bool))
            scale = self._scale.read_value()
            step = self.cur_iter.read_value()
            last = self.last_overflow_iter.read_value()
            hysteresis = self.cur_hysteresis.read_value()
            shrink = overflow
            if self.hysteresis > 1:  # a build-time constant, not a runtime flag
                shrink = tf.logical_and(overflow, tf.equal(hysteresis, 1))
            at_min = tf.equal(scale, self.min_scale)
            check = tf.debugging.Assert(
                tf.logical_not(tf.logical_and(shrink, at_min)),
                [f"{MIN_SCALE_ERROR}{self.min_scale:g} with non-finite gradients; step:", step + 1],
            )
            with tf.control_dependencies([check]):
                grow = tf.logical_and(
                    tf.logical_not(overflow), tf.equal((step - last) % self.window, 0)
                )
                new_scale = tf.where(
                    shrink,
                    tf.maximum(scale / 2, self.min_scale),
                    tf.where(grow, tf.minimum(scale * 2, MAX_LOSS_SCALE), scale),
                )
                new_hysteresis = tf.where(
                    tf.logical_and(overflow, tf.logical_not(shrink)),
                    hysteresis - 1,
                    tf.where(grow, tf.constant(self.hysteresis, tf.int64), hysteresis),
                )
                if self.debug_log:
                    _log_overflow(overflow, scale, new_scale, hysteresis, new_hysteresis)
                self._scale.assign(new_scale)
                self.cur_hysteresis.assign(new_hysteresis)
                self.last_overflow_iter.assign(tf.where(overflow, step, last))
                self.skipped_steps.assign_add(tf.cast(overflow, tf.int64))
                self.cur_iter.assign(step + 1)


def _log_overflow(overflow, scale, new_scale, hysteresis, new_hysteresis) -> None:
    def log():
        tf.print(
            "[epl amp] OVERFLOW! Skipping step. Attempted loss scale:",
            scale,
            "-> now",
            new_scale,
            "; hysteresis",
            hysteresis,
            "->",
            new_hysteresis,
        )
        return tf.constant(True)

    tf.cond(overflow, log, lambda: tf.constant(False))


class FixedLossScaler:
    """A constant loss scale with `DynamicLossScaler`'s interface.

    `update` only counts skipped (non-finite) steps.
    """

    def __init__(self, value: float, device: str):
        if not value > 0:
            raise ValueError(f"A fixed loss scale must be > 0. Received: amp.loss_scale={value}")
        self.value = float(value)
        self.device = device
        with tf.init_scope(), tf.device(device):
            self.skipped_steps = tf.Variable(0, dtype=tf.int64, trainable=False)

    @property
    def variables(self) -> list[tf.Variable]:
        return [self.skipped_steps]

    @property
    def named_variables(self) -> dict[str, tf.Variable]:
        """The state to checkpoint with the model, by name."""
        return {"skipped_steps": self.skipped_steps}

    def scale(self) -> tf.Tensor:
        with tf.device(self.device):
            return tf.constant(self.value, tf.float32)

    def update(self, finite) -> None:
        with tf.device(self.device):
            overflow = tf.logical_not(tf.convert_to_tensor(finite, tf.bool))
            self.skipped_steps.assign_add(tf.cast(overflow, tf.int64))


def make_loss_scaler(amp_config, device: str) -> DynamicLossScaler | FixedLossScaler:
    """The loss scaler `amp_config` (an `AmpConfig` with level "O1") asks for.

    `amp.loss_scale="dynamic"` gives DeepSpeed's dynamic schedule for float16; for
    bfloat16, whose exponent range is float32's, it gives a fixed scale of 1 (as
    DeepSpeed does). A number gives that fixed scale.

    Raises:
      ValueError: AMP is off, or the dynamic settings are inconsistent.
    """
    if amp_config.level != "O1":
        raise ValueError(
            f"make_loss_scaler is for amp.level='O1'. Received: amp.level={amp_config.level!r}"
        )
    if amp_config.loss_scale != "dynamic":
        return FixedLossScaler(amp_config.loss_scale, device)
    if amp_config.dtype == "bfloat16":
        return FixedLossScaler(1.0, device)
    return DynamicLossScaler(
        2.0**amp_config.initial_scale_power,
        amp_config.loss_scale_window,
        amp_config.hysteresis,
        amp_config.min_loss_scale,
        device,
        debug_log=amp_config.debug_log,
    )


def min_scale_error(error: tf.errors.OpError) -> MinLossScaleError | None:
    """The `MinLossScaleError` a failed step stands for, or None if it is another error.

    Use around a step: `except tf.errors.InvalidArgumentError as e:` then
    `if (error := min_scale_error(e)) is not None: raise error from None`, else re-raise.
    """
    found = re.search(rf"\[{re.escape(MIN_SCALE_ERROR)}(\S+) [^\]]*\] \[(\d+)\]", error.message)
    if found is None:
        return None
    return MinLossScaleError(_min_scale_message(float(found.group(1)), int(found.group(2))))
