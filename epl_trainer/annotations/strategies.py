"""EPL's annotation API in one place: the scopes (scopes.py) and their equivalent data form
`Strategy` (a layer-name regex -> stage mapping), resolved into a `ModelAnnotation`.

Two ways to say which TaskGraph each part of a model belongs to:

1. Scopes, as in EPL (`replicate`, `split`, `set_default_strategy`; scopes.py)::

       with epl.replicate(1, name="stage_0"):
           x = block1(inputs)
       with epl.replicate(1, name="stage_1"):
           outputs = block2(x)

2. Data, validated once and printable::

       Strategy(stages={"embed|encoder_[0-5]": 0, "encoder_([6-9]|1[01])|head": 1})

`resolve_annotation(model, ...)` turns either into a `ModelAnnotation`: the TaskGraph
requests (`StrategySpec`, device counts possibly unresolved) and the TaskGraph of every
compute node of the model. The planner resolves the device counts.
"""

from __future__ import annotations

import logging
import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from epl_trainer.annotations.scopes import (
    INHERITED_ATTR,
    NODE_ATTR,
    TaskGraphRecord,
    _StrategyBase,
    current_scope,
    current_taskgraph,
    recording_session,
    replicate,
    reset_annotations,
    set_default_strategy,
    split,
)
from epl_trainer.core.plan.ir import StrategySpec

__all__ = [
    "NODE_ATTR",
    "ModelAnnotation",
    "Strategy",
    "StrategySpec",
    "TaskGraphRecord",
    "current_scope",
    "current_taskgraph",
    "model_nodes",
    "replicate",
    "reset_annotations",
    "resolve_annotation",
    "set_default_strategy",
    "split",
]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------- data form
@dataclass(frozen=True)
class _Pattern:
    label: str  # "stage 1 ('encoder_9')" or "split ('head')"
    regex: re.Pattern
    taskgraph: int


@dataclass(frozen=True)
class Strategy:
    """Annotations as data: which layers form which TaskGraph.

    Args:
      default: strategy of every stage TaskGraph, or of the single TaskGraph when no
        stages are given. Default `replicate(1)`.
      stages: `{layer-name regex: stage index}`; indices are ints 0..S-1, each used at
        least once (several regexes may share a stage).
      split: layer-name regexes whose layers form one `split(None)` TaskGraph placed
        after the stages (or after the default TaskGraph).

    Regexes are applied with `re.fullmatch` to layer names, so "encoder_1" does not match
    "encoder_10" (write "encoder_1.*" for a prefix). With `stages`, every layer must
    match exactly one regex; Keras ops on KerasTensors (e.g. `x + y`) that match none
    join the latest TaskGraph among their inputs.
    """

    default: _StrategyBase | None = None
    stages: Mapping[str, int] | None = None
    split: Sequence[str] | None = None

    def __post_init__(self):
        # With split patterns the rest of the model defaults to replicate(None): one
        # device, or the split's devices when colocated (see planner.resolve_taskgraphs).
        if self.default is not None:
            default = self.default
        else:
            default = replicate(None) if self.split else replicate(1)
        if not isinstance(default, _StrategyBase):
            raise TypeError(
                "Strategy(default=...) must be replicate(...) or split(...). "
                f"Received: default={self.default!r}"
            )
        object.__setattr__(self, "default", default)
        object.__setattr__(self, "stages", _check_stages(self.stages))
        object.__setattr__(self, "split", _check_split(self.split))

    def __hash__(self) -> int:
        stages = tuple(sorted(self.stages.items())) if self.stages else None
        return hash((self.default, stages, self.split))

    @property
    def num_stages(self) -> int:
        return len(set(self.stages.values())) if self.stages else 0

    def taskgraph_specs(self) -> tuple[StrategySpec, ...]:
        """The TaskGraphs this mapping defines: stages (or the default), then split."""
        if self.stages:
            specs = [
                StrategySpec(self.default.kind, self.default.device_count, f"stage_{i}")
                for i in range(self.num_stages)
            ]
        else:
            specs = [self.default.spec]
        if self.split:
            specs.append(StrategySpec("split", None, "split"))
        return tuple(specs)

    def patterns(self) -> tuple[_Pattern, ...]:
        """Compiled regexes with the TaskGraph index each one selects."""
        found = [
            _Pattern(f"stage {stage} ({regex!r})", re.compile(regex), stage)
            for regex, stage in (self.stages or {}).items()
        ]
        split_index = max(self.num_stages, 1)
        found += [
            _Pattern(f"split ({regex!r})", re.compile(regex), split_index)
            for regex in self.split or ()
        ]
        return tuple(found)

    def match(self, layer_name: str) -> tuple[tuple[str, int], ...]:
        """(pattern label, TaskGraph index) of every regex that fullmatches the name."""
        return tuple(
            (p.label, p.taskgraph) for p in self.patterns() if p.regex.fullmatch(layer_name)
        )


def _check_stages(stages) -> dict[str, int] | None:
    if stages is None:
        return None
    if not isinstance(stages, Mapping):
        raise TypeError(
            f"stages must be a dict {{layer-name regex: stage index}}. Received: stages={stages!r}"
        )
    if not stages:
        return None
    for regex, stage in stages.items():
        _compile(regex, "stages")
        if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or stage < 0:
            raise ValueError(
                f"Stage indices must be ints >= 0. Received: {regex!r}: "
                f"{stage!r} in stages={dict(stages)!r}"
            )
    used = {int(s) for s in stages.values()}
    missing = sorted(set(range(max(used) + 1)) - used)
    if missing:
        raise ValueError(
            f"Stage indices must be contiguous from 0; stage {missing[0]} is "
            f"missing. Received: stages={dict(stages)!r}"
        )
    return {regex: int(stage) for regex, stage in stages.items()}


def _check_split(patterns) -> tuple[str, ...] | None:
    if patterns is None:
        return None
    if isinstance(patterns, str):
        patterns = [patterns]
    if not isinstance(patterns, Sequence):
        raise TypeError(f"split must be a list of layer-name regexes. Received: {patterns!r}")
    for regex in patterns:
        _compile(regex, "split")
    return tuple(patterns) or None


def _compile(regex, where: str) -> re.Pattern:
    if not isinstance(regex, str):
        raise TypeError(f"{where} keys must be regex strings. Received: {regex!r}")
    try:
        return re.compile(regex)
    except re.error as error:
        raise ValueError(f"Invalid regex {regex!r} in {where}: {error}") from None


# --------------------------------------------------------------------- resolution
@dataclass(frozen=True, eq=False)
class ModelAnnotation:
    """Which TaskGraph every compute node of a model belongs to."""

    taskgraphs: tuple[StrategySpec, ...]
    node_taskgraph: Mapping[Any, int]  # Node -> TaskGraph index, in topological order
    source: str = "scopes"  # "scopes", "strategy" or "default" (plain data parallelism)

    @property
    def nodes(self) -> tuple:
        """The model's compute nodes in topological order."""
        return tuple(self.node_taskgraph)

    def taskgraph_nodes(self, index: int) -> tuple:
        return tuple(n for n, k in self.node_taskgraph.items() if k == index)

    def taskgraph_name(self, index: int) -> str:
        name = self.taskgraphs[index].name
        return name if name is not None else f"taskgraph_{index}"

    def describe(self) -> str:
        """A table: TaskGraphs, then every node with its TaskGraph."""
        lines = [f"{len(self.taskgraphs)} TaskGraph(s) (from {self.source}):"]
        for i, spec in enumerate(self.taskgraphs):
            count = "auto" if spec.device_count is None else spec.device_count
            lines.append(f"  {i} {self.taskgraph_name(i)}: {spec.kind}, device_count={count}")
        rows = [("node", "type", "taskgraph")]
        rows += [
            (_node_label(node), type(node.operation).__name__, f"{k} {self.taskgraph_name(k)}")
            for node, k in self.node_taskgraph.items()
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        for row in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        return "\n".join(lines)


def _node_label(node) -> str:
    operation = node.operation
    inbound = operation._inbound_nodes
    if len(inbound) > 1:
        index = next(i for i, n in enumerate(inbound) if n is node)
        return f"{operation.name}[{index}]"
    return operation.name


def _has_layer_graph(model) -> bool:
    import keras

    return isinstance(model, keras.Sequential) or hasattr(model, "_nodes_by_depth")


def model_nodes(model) -> list:
    """The compute nodes of a functional (or built Sequential) model, topologically
    ordered, input nodes excluded."""
    import keras

    graph = model
    if isinstance(model, keras.Sequential):
        graph = getattr(model, "_functional", None)
        if graph is None:
            raise ValueError(
                f"Sequential model {model.name!r} is not built; give its first "
                "layer an input shape or call it once first."
            )
    if not hasattr(graph, "_nodes_by_depth"):
        raise TypeError(
            "Annotations need a functional Keras model "
            "(keras.Model(inputs, outputs)) or a built Sequential; a subclassed "
            f"model has no layer graph. Received: {type(model).__name__}"
        )
    nodes = []
    for depth in sorted(graph._nodes_by_depth, reverse=True):
        for node in graph._nodes_by_depth[depth]:
            if not (node.is_input or isinstance(node.operation, keras.layers.InputLayer)):
                nodes.append(node)
    return nodes


def resolve_trainer_annotation(model, auto_parallel: bool, strategy, stages, split):
    """The trainer's annotation: `resolve_annotation`'s, or None when
    `auto.auto_parallel` lets the engine cut the model itself (which then refuses an
    annotation given as well, rather than silently ignoring it)."""
    if not auto_parallel:
        return resolve_annotation(model, strategy=strategy, stages=stages, split=split)
    given = {"strategy": strategy, "stages": stages, "split": split}
    given = {k: v for k, v in given.items() if v is not None}
    scoped = resolve_annotation(model).source == "scopes"
    if given or scoped:
        raise ValueError(
            "auto.auto_parallel=True cuts the model itself; do not also annotate it. Received: "
            + (", ".join(f"{k}={v!r}" for k, v in given.items()) or "replicate/split scopes")
        )
    return None


def resolve_annotation(model, strategy=None, stages=None, split=None) -> ModelAnnotation:
    """The TaskGraphs of `model` and the TaskGraph of each of its compute nodes.

    Args:
      model: a functional Keras model (or a built Sequential).
      strategy: a `Strategy`, a bare `replicate(n)`/`split(n)` (one TaskGraph for the
        whole model), or None.
      stages, split: shortcuts for `Strategy(stages=..., split=...)`.

    Without a data form, the scope tags recorded while the model was built are used
    (untagged nodes go to TaskGraph 0); without those either, the whole model is one
    `replicate(1)` TaskGraph (plain data parallelism). A data form wins over scope tags.

    Raises:
      ValueError: a layer matches no pattern or several, a pattern matches no layer, or
        the same mapping is given twice.
      TypeError: unsupported `strategy` or model.
    """
    data_form = _data_form(strategy, stages, split)
    if not _has_layer_graph(model) and (
        data_form is None or not (data_form.stages or data_form.split)
    ):
        # A subclassed model has no layer graph to cut, but as one TaskGraph (plain data
        # parallelism) it needs none.
        if data_form is None:
            return ModelAnnotation((StrategySpec("replicate", 1, None),), {}, source="default")
        return ModelAnnotation(data_form.taskgraph_specs(), {}, source="strategy")
    nodes = model_nodes(model)
    if data_form is None:
        return _from_scope_tags(nodes, model.name)
    if any(getattr(node, NODE_ATTR, None) is not None for node in nodes):
        logger.warning(
            "Model %r was built inside replicate/split scopes and a %r was also "
            "given; the data form wins and the scopes are ignored.",
            model.name,
            data_form,
        )
    return _from_strategy(nodes, data_form, model.name)


def _data_form(strategy, stages, split_patterns) -> Strategy | None:
    if strategy is not None and not isinstance(strategy, Strategy | _StrategyBase):
        raise TypeError(
            "strategy must be a Strategy, replicate(...), split(...), a "
            "keras.distribution.DataParallel or ModelParallel, or None. "
            f"Received: {strategy!r}"
        )
    base = Strategy(default=strategy) if isinstance(strategy, _StrategyBase) else strategy
    if stages is None and split_patterns is None:
        return base
    if base is None:
        return Strategy(stages=stages, split=split_patterns)
    if stages is not None and base.stages:
        raise ValueError(
            f"Stages were given twice: in strategy={base!r} and as "
            f"stages={stages!r}. Give them once."
        )
    if split_patterns is not None and base.split:
        raise ValueError(
            f"Split patterns were given twice: in strategy={base!r} and as "
            f"split={split_patterns!r}. Give them once."
        )
    return Strategy(
        default=base.default,
        stages=stages if stages is not None else base.stages,
        split=split_patterns if split_patterns is not None else base.split,
    )


def _from_scope_tags(nodes: list, model_name: str) -> ModelAnnotation:
    tags = {node: _node_tag(node) for node in nodes}
    unique = {id(r): r for r in tags.values() if r is not None}
    records = sorted(unique.values(), key=lambda r: (r.session, r.index))
    if not records:
        return ModelAnnotation(
            (StrategySpec("replicate", 1, None),), dict.fromkeys(nodes, 0), source="default"
        )
    _warn_unused_taskgraphs(records, model_name)
    index = {id(r): i for i, r in enumerate(records)}
    assignment = {node: 0 if tag is None else index[id(tag)] for node, tag in tags.items()}
    return ModelAnnotation(tuple(r.spec for r in records), assignment, source="scopes")


def _node_tag(node) -> TaskGraphRecord | None:
    """The TaskGraph of a node: the one current where it was made, except for a call of
    a nested model made outside any scope and default, which joins the TaskGraph its own
    layers were built in. Before, `keras.Sequential([part1, part2])` of two sub-models
    built in two stage scopes trained as one data-parallel TaskGraph (the last stage's,
    which both calls inherited), silently dropping the pipeline.

    Raises:
      ValueError: such a nested model's layers were built in several TaskGraphs (one
        node cannot be cut into stages).
    """
    tag = getattr(node, NODE_ATTR, None)
    if tag is not None and not getattr(node, INHERITED_ATTR, False):
        return tag
    model = node.operation
    if not _has_layer_graph(model) or getattr(model, "_functional", True) is None:
        return tag  # a layer, or an unbuilt Sequential
    session = tag.session if tag is not None else recording_session()[0]
    inner = {id(r): r for r in map(_node_tag, model_nodes(model)) if r is not None}
    inner = [r for r in inner.values() if r.session == session]
    if len(inner) > 1:
        raise ValueError(
            f"Nested model {model.name!r} is called outside any replicate/split scope, and "
            f"its layers were built in several TaskGraphs ({', '.join(map(repr, inner))}). "
            "A nested model is one node of the model calling it and is not cut into "
            f"TaskGraphs: pass {model.name!r} itself to the trainer, or call each part "
            "inside its scope."
        )
    return inner[0] if inner else tag


def _warn_unused_taskgraphs(records: list, model_name: str) -> None:
    """Warns when this session opened TaskGraphs that hold none of the model's nodes: a
    layer joins the TaskGraph current where it is *called*, so layers only constructed
    in a scope (and called later, e.g. by `keras.Sequential([...])`) are not in it."""
    session, opened = recording_session()
    if not any(r.session == session for r in records):
        return  # the model was annotated in an earlier session
    used = {id(r) for r in records}
    unused = [r for r in opened if id(r) not in used]
    if unused:
        logger.warning(
            "TaskGraph(s) %s were opened by replicate/split scopes but hold no layer call "
            "of model %r, which uses %s. A layer joins the TaskGraph where it is called "
            "(where its node is made), not where it is constructed: call the layers inside "
            "the scopes.",
            ", ".join(map(repr, unused)),
            model_name,
            ", ".join(map(repr, records)),
        )


def _from_strategy(nodes: list, strategy: Strategy, model_name: str) -> ModelAnnotation:
    import keras

    patterns = strategy.patterns()
    hits = dict.fromkeys((p.label for p in patterns), 0)
    assignment: dict = {}
    for node in nodes:
        name = node.operation.name
        matched = [p for p in patterns if p.regex.fullmatch(name)]
        for p in matched:
            hits[p.label] += 1
        is_layer = isinstance(node.operation, keras.layers.Layer)
        if len(matched) > 1:
            raise ValueError(
                f"Layer {name!r} matches several patterns: "
                f"{', '.join(p.label for p in matched)}. Each layer must match exactly one "
                "(patterns are applied with re.fullmatch)."
            )
        if matched:
            assignment[node] = matched[0].taskgraph
        elif is_layer and strategy.stages:
            raise ValueError(
                f"Layer {name!r} matches no stage or split pattern (patterns are applied "
                f"with re.fullmatch). Received: stages={strategy.stages!r}, "
                f"split={strategy.split!r}"
            )
        elif is_layer:
            assignment[node] = 0
        else:  # a Keras op such as `x + y`: follow its latest input
            assignment[node] = max((assignment.get(p, 0) for p in node.parent_nodes), default=0)
    for label, count in hits.items():
        if count == 0:
            names = sorted({node.operation.name for node in nodes})
            raise ValueError(
                f"{label} matches no layer of model {model_name!r}. Its layers: {names}"
            )
    return ModelAnnotation(strategy.taskgraph_specs(), assignment, source="strategy")
