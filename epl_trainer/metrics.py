"""Turns `metrics=[...]` into Keras metric objects, resolving "accuracy" as `compile` does."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import keras

_ACCURACY_NAMES = ("accuracy", "acc")


def resolve_metrics(
    metrics, loss_name: str, output_names: Sequence[str]
) -> list[tuple[int, keras.metrics.Metric]]:
    """Returns (output index, metric) pairs.

    Args:
      metrics: None, a list applied to every output, or a dict {output name: list}.
      loss_name: used to pick the accuracy variant for "accuracy" / "acc".
      output_names: the model's output names (metrics get a prefix when there are several).
    """
    if metrics is None:
        return []
    if isinstance(metrics, Mapping):
        unknown = [k for k in metrics if k not in output_names]
        if unknown:
            raise ValueError(
                f"metrics keys {unknown} are not model outputs. Outputs: {list(output_names)}"
            )
        per_output = {output_names.index(k): _as_list(v) for k, v in metrics.items()}
    else:
        per_output = dict.fromkeys(range(len(output_names)), _as_list(metrics))
    resolved = []
    for index, specs in per_output.items():
        prefix = f"{output_names[index]}_" if len(output_names) > 1 else ""
        for spec in specs:
            resolved.append((index, _as_metric(spec, loss_name, prefix)))
    check_unique_names(resolved)
    return resolved


def check_unique_names(resolved) -> None:
    """Metrics report under their names: two with one name would share a log entry."""
    names = [m.name for _, m in resolved]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"Metric names must be unique. Duplicated: {duplicates}")


def _as_list(spec) -> list:
    return list(spec) if isinstance(spec, (list, tuple)) else [spec]


def _as_metric(spec, loss_name: str, prefix: str) -> keras.metrics.Metric:
    if isinstance(spec, keras.metrics.Metric):
        if prefix and not spec.name.startswith(prefix):
            raise ValueError(
                f"With several outputs, pass metric names (not metric objects) or a dict per "
                f"output. Received object {spec.name!r}."
            )
        return spec
    if isinstance(spec, str) and spec.lower() in _ACCURACY_NAMES:
        return _accuracy_for(loss_name, name=prefix + spec)
    fn = keras.metrics.get(spec)
    if isinstance(fn, keras.metrics.Metric):
        return fn
    if isinstance(fn, type) and issubclass(fn, keras.metrics.Metric):
        return fn(name=prefix + (spec if isinstance(spec, str) else fn.__name__))
    name = spec if isinstance(spec, str) else getattr(fn, "__name__", "metric")
    return keras.metrics.MeanMetricWrapper(fn, name=prefix + name)


def _accuracy_for(loss_name: str, name: str) -> keras.metrics.Metric:
    lowered = loss_name.lower()
    if "sparse_categorical" in lowered:
        return keras.metrics.SparseCategoricalAccuracy(name=name)
    if "categorical" in lowered:
        return keras.metrics.CategoricalAccuracy(name=name)
    if "binary" in lowered:
        return keras.metrics.BinaryAccuracy(name=name)
    return keras.metrics.Accuracy(name=name)
