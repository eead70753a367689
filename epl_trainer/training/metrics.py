"""The metrics of `compile(metrics=..., weighted_metrics=...)`, resolved by Keras's own
`CompileMetrics`: which metric reads which output, "accuracy" picked from the shapes,
and the names the logs show (`<output>_<metric>` with several outputs, made unique as
Keras makes them)."""

from __future__ import annotations

from collections.abc import Sequence

import keras
from keras import tree

# Keras's own resolver of compile()'s metrics structure; not exported by keras.metrics.
from keras.src.trainers.compile_utils import CompileMetrics


class CompiledMetrics:
    """(flat output index, metric) pairs built by Keras's `CompileMetrics`.

    Iterating gives the pairs (the index is in `keras.tree.flatten(y_pred)` order); the
    pairs, `weighted_ids` (ids of the `weighted_metrics`, which get the data's sample
    weights) and `log_names` are filled by `build` and updated in place when built
    again, so the engine's references stay valid.
    """

    def __init__(self, metrics, weighted_metrics, output_names: Sequence[str] | None = None):
        self._metrics = metrics
        self._weighted_metrics = weighted_metrics
        self.output_names = list(output_names or [])
        self._new_keras_metrics()  # Keras checks the arguments' types here
        self.pairs: list[tuple[int, keras.metrics.Metric]] = []
        self.weighted_ids: set[int] = set()
        self.log_names: dict[int, str] = {}
        self.built = False

    def _new_keras_metrics(self) -> CompileMetrics:
        return CompileMetrics(
            self._metrics, self._weighted_metrics, output_names=self.output_names or None
        )

    def build(self, y_true, y_pred) -> None:
        """Resolves the metrics from symbolic `y_true` / `y_pred` (the data's shapes), as
        Keras's first `fit` builds its `CompileMetrics`."""
        keras_metrics = self._new_keras_metrics()
        keras_metrics.build(y_true, y_pred)
        # Keras's flat order of the outputs (by output name for a dict), as indices
        # into keras.tree.flatten(y_pred), the order the engine reads outputs in.
        markers = tree.pack_sequence_as(y_pred, list(range(len(tree.flatten(y_pred)))))
        order = keras_metrics._flatten_y(markers)
        plain = _pairs(keras_metrics._flat_metrics, order)
        weighted = _pairs(keras_metrics._flat_weighted_metrics, order)
        self.pairs[:] = [(index, metric) for index, metric, _ in plain + weighted]
        self.weighted_ids.clear()
        self.weighted_ids.update(id(metric) for _, metric, _ in weighted)
        self.log_names.clear()
        self.log_names.update(_keras_names(plain, weighted))
        self.built = True

    def name(self, metric) -> str:
        """The metric's key in the logs."""
        return self.log_names.get(id(metric), metric.name)

    def __iter__(self):
        return iter(self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)


def _pairs(flat_lists, order) -> list:
    """[(flat output index, metric, output name or None)] of Keras's per-output
    `MetricsList`s."""
    found = []
    for position, metrics_list in enumerate(flat_lists):
        if not metrics_list:
            continue
        for metric in metrics_list.metrics:
            found.append((order[position], metric, metrics_list.output_name))
    return found


def _keras_names(plain, weighted) -> dict[int, str]:
    """{id(metric): log name}, as `CompileMetrics.result` names them: prefixed by the
    output's name, a repeated name numbered, a weighted metric whose name a plain one
    took prefixed by "weighted_"."""
    names, counters = {}, {}
    for _, metric, output in plain:
        name = f"{output}_{metric.name}" if output else metric.name
        if name in counters:
            counters[name] += 1
            name = f"{name}_{counters[name] - 1}"
        else:
            counters[name] = 1
        names[id(metric)] = name
    for _, metric, output in weighted:
        name = f"{output}_{metric.name}" if output else metric.name
        if name in counters:
            name = f"weighted_{metric.name}"
            name = f"{output}_{name}" if output else name
            if name in counters:
                counters[name] += 1
                name = f"{name}_{counters[name] - 1}"
            else:
                counters[name] = 1
        else:
            counters[name] = 1
        names[id(metric)] = name
    return names
