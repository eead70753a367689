"""The reference training step of a Keras model, traced and counted, and its profile table.

`train_step_flops(model, x, y)` traces what one step of plain Keras runs (forward, loss,
the GradientTape's backward and the optimizer's update) as one `tf.function`, for the
batch's exact shapes, and counts it with `flops.count_flops`. These are the model's FLOPs
of one step: what MFU (model FLOPs utilisation) divides by the time and the peak.
They do not depend on how the step is parallelised; a recomputation (gradient
checkpointing) costs time but adds no model FLOPs.

`format_profile` renders a count as DeepSpeed's flops profiler reports: a summary, the
FLOPs per op type, per pipeline stage and the top layers at each depth, and with
`detailed` every layer of the chosen depth with its forward and backward FLOPs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import keras
import tensorflow as tf

from epl_trainer.core.graph.flops import BACKWARD, FORWARD, OPTIMIZER, FlopCount, count_flops
from epl_trainer.core.plan.ir import format_count

__all__ = ["format_profile", "trace_train_step", "train_step_flops"]


def trace_train_step(model, x, y=None, sample_weight=None, *, loss=None, optimizer=None):
    """One training step of `model` as a traced `ConcreteFunction` (nothing runs).

    Args:
      model: a built Keras model.
      x, y, sample_weight: the batch, or `tf.TensorSpec`s of it (static shapes: the
        count needs them).
      loss: `loss(y_true, y_pred, sample_weight)` -> scalar; the model's own losses
        (`add_loss`) are added. None: the compiled loss (`model.compute_loss`).
      optimizer: the optimizer whose update the step runs; None: the compiled one. A copy
        is traced (built on its own slot variables), so the given one is not touched.

    Returns:
      (the concrete function, the name of its optimizer's scope).
    """
    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    clone = None
    if optimizer is not None:
        clone = type(optimizer).from_config(optimizer.get_config())
        clone.build(model.trainable_variables)
    if loss is None and not getattr(model, "compiled", False):
        raise ValueError(
            "The training step needs a loss: pass loss= or compile the model. "
            f"Received: model {model.name!r}, not compiled, loss=None"
        )

    def step(x, y, sample_weight):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            if loss is None:
                total = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
            else:
                total = tf.cast(loss(y, y_pred, sample_weight), tf.float32)
                if model.losses:
                    total += tf.add_n([tf.cast(t, tf.float32) for t in model.losses])
        variables = model.trainable_variables
        grads = tape.gradient(total, variables)
        if clone is not None:
            pairs = [(g, v) for g, v in zip(grads, variables, strict=True) if g is not None]
            clone.apply([g for g, _ in pairs], [v for _, v in pairs])
        return total

    specs = tf.nest.map_structure(_spec, (x, y, sample_weight))
    function = tf.function(step, autograph=False).get_concrete_function(*specs)
    return function, (clone.name if clone is not None else None)


def train_step_flops(
    model,
    x,
    y=None,
    sample_weight=None,
    *,
    loss=None,
    optimizer=None,
    trip_counts: Mapping[str, int] | None = None,
) -> FlopCount:
    """The FLOPs of one plain Keras training step on this batch (`trace_train_step`)."""
    function, scope = trace_train_step(model, x, y, sample_weight, loss=loss, optimizer=optimizer)
    return count_flops(
        function, model=model, optimizer_scopes=(scope,) if scope else (), trip_counts=trip_counts
    )


def _spec(value):
    if value is None or isinstance(value, tf.TensorSpec):
        return value
    if isinstance(value, keras.KerasTensor):
        return tf.TensorSpec(value.shape, value.dtype)
    tensor = tf.convert_to_tensor(value)
    return tf.TensorSpec(tensor.shape, tensor.dtype)


# ------------------------------------------------------------------ the table
def format_profile(
    count: FlopCount,
    *,
    module_depth: int = -1,
    top_modules: int = 1,
    detailed: bool = True,
    stage_of: Mapping[str, int] | Callable[[str], int | None] | None = None,
    summary: Sequence[tuple[str, str]] = (),
) -> str:
    """The profile as text: `summary` rows first (step time, TFLOP/s, MFU, ...), then the
    breakdowns of `count`'s contraction FLOPs.

    Args:
      module_depth: layer depth of the detailed table (1: the model's own layers, 2: their
        sublayers; -1: the deepest).
      top_modules: how many layers to name at each depth, largest first.
      detailed: add the table of every layer at `module_depth`.
      stage_of: top-level layer -> pipeline stage (regexes or a function); None: no
        per-stage table.
    """
    total = count.flops
    phases = count.by_phase()
    lines = ["-" * 30 + " EPL FLOPs profile " + "-" * 30]
    rows = [
        ("FLOPs per step (matmul/conv/einsum)", format_count(total)),
        *((f"  {phase}", _with_share(phases[phase], total)) for phase in phases),
        ("elementwise FLOPs (estimate, not in MFU)", format_count(count.elementwise_flops)),
        *summary,
    ]
    if count.unknown_loops:
        rows.append(("loops counted once (trip count unknown)", ", ".join(count.unknown_loops)))
    if count.unresolved:
        rows.append(("ops without static shapes (not counted)", str(len(count.unresolved))))
    width = max(len(label) for label, _ in rows)
    lines += [f"  {label.ljust(width)}  {value}" for label, value in rows]
    lines += ["", "FLOPs per op type:"]
    lines += _table(
        ("op type", "FLOPs", "share"),
        [(t, format_count(f), _share(f, total)) for t, f in count.by_op_type().items()],
    )
    if stage_of is not None:
        lines += ["", "FLOPs per pipeline stage (forward + backward):"]
        stages = count.by_stage(stage_of)
        lines += _table(
            ("stage", "FLOPs", "share"),
            [
                ("-" if s is None else str(s), format_count(f), _share(f, total))
                for s, f in stages.items()
            ],
        )
    deepest = max((len(op.layer) for op in count.ops), default=0)
    depth = deepest if module_depth < 0 else min(module_depth, deepest)
    lines += ["", f"Top {top_modules} layer(s) by FLOPs at each depth:"]
    for level in range(1, depth + 1):
        layers = sorted(
            ((k, f) for k, f in count.by_layer(level).items() if k), key=lambda kf: -kf[1]
        )
        named = ", ".join(f"{k} {format_count(f)}" for k, f in layers[:top_modules])
        lines.append(f"  depth {level}: {named}")
    if detailed and depth:
        lines += ["", f"FLOPs per layer (depth {depth}):"]
        forward, backward = (count.by_layer(depth, phase) for phase in (FORWARD, BACKWARD))
        optimizer = count.by_layer(depth, OPTIMIZER)
        layers = [k for k in count.by_layer(depth) if k or forward.get(k) or backward.get(k)]
        lines += _table(
            ("layer", "forward", "backward", "optimizer", "share"),
            [
                (
                    k or "(no layer: loss, optimizer)",
                    format_count(forward.get(k, 0)),
                    format_count(backward.get(k, 0)),
                    format_count(optimizer.get(k, 0)),
                    _share(forward.get(k, 0) + backward.get(k, 0) + optimizer.get(k, 0), total),
                )
                for k in layers
            ],
        )
    lines.append("-" * 79)
    return "\n".join(lines)


def _share(part: float, total: float) -> str:
    return f"{100 * part / total:.1f}%" if total else "-"


def _with_share(part: float, total: float) -> str:
    return f"{format_count(part)} ({_share(part, total)})"


def _table(columns, rows) -> list[str]:
    """Rows under a header; the first column left-aligned, the others right."""
    cells = [tuple(str(c) for c in row) for row in [columns, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    out = []
    for first, *rest in cells:
        padded = [first.ljust(widths[0]), *(c.rjust(w) for c, w in zip(rest, widths[1:]))]
        out.append(("  " + "  ".join(padded)).rstrip())
    out.insert(1, "  " + "  ".join("-" * w for w in widths))
    return out
