"""The user's loss (one, or one per model output) as a single callable, Keras-style."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import keras
from keras import tree

# Not exported by keras.losses, but what Keras itself wraps loss functions with.
from keras.src.losses.losses import LossFunctionWrapper

from epl_trainer.core.engine.objective import compiled_loss_terms


class CompiledLoss:
    """Sums one Keras loss per model output, with Keras's reduction semantics.

    `loss` may be a Keras `Loss`, a loss name ("mse", "sparse_categorical_crossentropy"),
    a function `(y_true, y_pred) -> per-sample losses`, or, for a model with several
    outputs, a list or dict of those matching the outputs (a single loss applies to
    every output, as in `Model.compile`). `loss_weights` (a list or dict like the
    outputs, as `Model.compile` takes it) scales each output's loss in the sum.
    """

    def __init__(self, loss, output_names: Sequence[str] | None = None, loss_weights=None):
        if loss is None:
            raise ValueError(
                "EPLTrainer needs a loss: pass loss=..., or compile the model with one. "
                "Received: loss=None"
            )
        self._spec = loss
        self._output_names = list(output_names or [])
        self._weights_spec = loss_weights

    def weights_for(self, num_outputs: int) -> list[float]:
        spec = self._weights_spec
        if spec is None:
            return [1.0] * num_outputs
        if isinstance(spec, Mapping):
            unknown = sorted(set(spec) - set(self._output_names))
            if unknown:
                raise ValueError(
                    f"loss_weights names outputs the model does not have: {unknown}. "
                    f"Outputs: {self._output_names}"
                )
            return [float(spec.get(name, 1.0)) for name in self._output_names]
        if isinstance(spec, (int, float)):
            return [float(spec)] * num_outputs
        if len(spec) != num_outputs:
            raise ValueError(
                f"loss_weights needs one weight per model output ({num_outputs}). "
                f"Received: loss_weights={spec!r}"
            )
        return [float(w) for w in spec]

    def losses_for(self, y_pred_flat_len: int) -> list[keras.losses.Loss]:
        spec = self._spec
        if isinstance(spec, Mapping):
            missing = [n for n in self._output_names if n not in spec]
            if missing or len(spec) != len(self._output_names):
                raise ValueError(
                    f"The loss dict must have one entry per model output {self._output_names}. "
                    f"Received keys: {sorted(spec)}"
                )
            return [_as_loss(spec[name]) for name in self._output_names]
        if isinstance(spec, (list, tuple)):
            if len(spec) != y_pred_flat_len:
                raise ValueError(
                    f"The model has {y_pred_flat_len} outputs but {len(spec)} losses were given."
                )
            return [_as_loss(s) for s in spec]
        return [_as_loss(spec)] * y_pred_flat_len

    def __call__(self, y_true, y_pred, sample_weight=None):
        """The total loss: sum over outputs of each output's reduced loss."""
        flat_pred = tree.flatten(y_pred)
        flat_true = tree.flatten(y_true)
        if len(flat_true) != len(flat_pred):
            raise ValueError(
                f"The labels have {len(flat_true)} tensor(s) but the model has "
                f"{len(flat_pred)} output(s). Labels: {tree.map_structure(_shape, y_true)}; "
                f"outputs: {tree.map_structure(_shape, y_pred)}"
            )
        losses = self.losses_for(len(flat_pred))
        weights = self.weights_for(len(flat_pred))
        total = None
        for loss, weight, t, p in zip(losses, weights, flat_true, flat_pred):
            value = loss(t, p, sample_weight=sample_weight)
            if weight != 1.0:
                value = value * weight
            total = value if total is None else total + value
        return total

    def terms(self, y_true, y_pred, sample_weight=None) -> list:
        """Each output's weighted loss sum and Keras's divisor, kept apart so the step
        divides once for the global batch (`core/engine/objective.py`)."""
        return compiled_loss_terms(self, y_true, y_pred, sample_weight)

    @property
    def is_sparse_categorical(self) -> bool:
        first = self._spec if not isinstance(self._spec, (list, tuple, Mapping)) else None
        return first is not None and "sparse_categorical" in _loss_name(first)

    def name(self) -> str:
        return _loss_name(self._spec)


def _as_loss(spec) -> keras.losses.Loss:
    if isinstance(spec, keras.losses.Loss):
        return spec
    fn = keras.losses.get(spec)
    if fn is None:
        raise ValueError(f"Unknown loss {spec!r}.")
    if isinstance(fn, keras.losses.Loss):
        return fn
    return LossFunctionWrapper(fn, name=getattr(fn, "__name__", "loss"))


def _loss_name(spec) -> str:
    if isinstance(spec, str):
        return spec
    if isinstance(spec, keras.losses.Loss):
        inner = getattr(spec, "fn", None)
        return getattr(inner, "__name__", None) or type(spec).__name__.lower()
    return getattr(spec, "__name__", type(spec).__name__).lower()


def _shape(x):
    return getattr(x, "shape", type(x).__name__)
