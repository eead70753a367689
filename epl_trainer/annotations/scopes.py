"""EPL's scope API: `replicate` / `split` scopes and `set_default_strategy`, recorded on
the Keras nodes built inside them.

Every Keras `Node` (one call of a layer or a Keras op on KerasTensors) created while
building a functional model is tagged with the TaskGraph that is current at that
moment::

    with epl.replicate(1, name="stage_0"):
        x = block1(inputs)
    with epl.replicate(1, name="stage_1"):
        outputs = block2(x)

Recording rules (EPL's):

* Each scope is one TaskGraph, numbered in order of first entry. Re-entering the same
  scope object, or a scope with the same name, reuses its TaskGraph.
* `set_default_strategy(s)` opens a new TaskGraph that collects everything built
  outside a `with` block from then on; each call opens the next one (FastNN's BERT calls
  it once per stage).
* Nodes built before any scope or default belong to the first TaskGraph. Nodes built
  outside any scope after one closed, with no default set, join the most recently used
  `replicate` TaskGraph (EPL does the same, so a loss written after the last stage's
  block stays in the last stage).
* Strategies do not nest.
* A node made outside any scope and default that calls a nested Keras model (a model
  built inside a scope, called by the model passed to the trainer) joins the TaskGraph
  of the nested model's own layers (strategies.py): their nodes were made in the scope,
  as EPL's ops of `model_part1()` are.

The recording state is process-global, like EPL's `Env`; `reset_annotations()` clears it
(`epl.init()` calls it). Tags already attached to nodes survive a reset.
"""

from __future__ import annotations

import functools
import itertools
import logging
import numbers
from dataclasses import dataclass

from epl_trainer.core.plan.ir import StrategySpec

logger = logging.getLogger(__name__)

NODE_ATTR = "_epl_taskgraph"  # attribute holding a Node's TaskGraphRecord (or None)
# True on a Node made outside any scope and default: its TaskGraph (the last replicate
# one, or None) was inherited, not chosen where the node was made.
INHERITED_ATTR = "_epl_taskgraph_inherited"


# --------------------------------------------------------------------- strategies
class _StrategyBase:
    """A TaskGraph request; a context manager (a scope) and a value at once."""

    kind = ""

    def __init__(self, device_count: int | None = None, name: str | None = None):
        self._device_count = _check_device_count(device_count, self.kind)
        self._name = _check_name(name, self.kind)

    @property
    def device_count(self) -> int | None:
        return self._device_count

    @property
    def name(self) -> str | None:
        return self._name

    @property
    def spec(self) -> StrategySpec:
        return StrategySpec(self.kind, self._device_count, self._name)

    def __enter__(self):
        _enter_scope(self)
        return self

    def __exit__(self, *exc_info) -> bool:
        _exit_scope(self)
        return False

    def __repr__(self) -> str:
        name = f", name={self._name!r}" if self._name is not None else ""
        return f"{self.kind}(device_count={self._device_count!r}{name})"

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)


class replicate(_StrategyBase):  # lowercase: EPL's public name
    """Data-parallel TaskGraph: each model replica runs it on `device_count` devices
    (default 1), splitting the micro-batch across them."""

    kind = "replicate"


class split(_StrategyBase):  # lowercase: EPL's public name
    """Tensor-split TaskGraph: its layers are split over `device_count` devices
    (None = every device of the job, with `cluster.colocate_split_and_replicate`)."""

    kind = "split"


def _check_device_count(value, kind: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{kind}(device_count=...) must be a positive int or None. "
            f"Received: device_count={value!r} of type {type(value).__name__}"
        )
    if value < 1:
        raise ValueError(f"{kind}(device_count=...) must be >= 1. Received: device_count={value!r}")
    return int(value)


def _check_name(value, kind: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{kind}(name=...) must be a str or None. Received: name={value!r}")
    if not value:
        raise ValueError(f"{kind}(name=...) must not be empty. Received: name=''")
    return value


# ---------------------------------------------------------------------- recording
@dataclass(eq=False)
class TaskGraphRecord:
    """A TaskGraph opened while recording; attached to Keras nodes as `NODE_ATTR`."""

    session: int  # recording session (bumped by reset_annotations)
    index: int  # order of creation within the session
    strategy: _StrategyBase  # the scope or default that opened it

    @property
    def spec(self) -> StrategySpec:
        return self.strategy.spec

    def __repr__(self) -> str:
        return f"<TaskGraph {self.index} {self.strategy!r}>"


class _Recording:
    """State of one recording session."""

    def __init__(self, session: int):
        self.session = session
        self.records: list[TaskGraphRecord] = []
        self.by_name: dict[str, TaskGraphRecord] = {}
        self.by_object: dict[int, tuple[_StrategyBase, TaskGraphRecord]] = {}
        self.scope: _StrategyBase | None = None  # the active `with` block
        self.scope_record: TaskGraphRecord | None = None
        self.default_record: TaskGraphRecord | None = None
        self.last_replicate: TaskGraphRecord | None = None

    def current(self) -> TaskGraphRecord | None:
        return self.scope_record or self.default_record or self.last_replicate

    def inherited(self) -> bool:
        """Whether a node made now gets its TaskGraph by inheritance (no scope or default)."""
        return self.scope_record is None and self.default_record is None

    def open(self, strategy: _StrategyBase, reuse_object: bool) -> TaskGraphRecord:
        """The TaskGraph `strategy` stands for: an existing one, or a new one."""
        name = strategy.name
        if name is not None and name in self.by_name:
            record = self.by_name[name]
            if record.spec != strategy.spec:
                raise ValueError(
                    f"TaskGraph {name!r} was opened as {record.strategy!r} and cannot be "
                    f"re-entered as {strategy!r}. Use another name for a different "
                    "TaskGraph."
                )
            return record
        if reuse_object and id(strategy) in self.by_object:
            return self.by_object[id(strategy)][1]
        record = TaskGraphRecord(self.session, len(self.records), strategy)
        self.records.append(record)
        if name is not None:
            self.by_name[name] = record
        # Keep the object alive with its id so the id cannot be reused by another one.
        self.by_object[id(strategy)] = (strategy, record)
        return record


_SESSIONS = itertools.count()
_RECORDING = _Recording(next(_SESSIONS))


def reset_annotations() -> None:
    """Forgets every scope, default strategy and TaskGraph recorded so far."""
    global _RECORDING
    _RECORDING = _Recording(next(_SESSIONS))


def recording_session() -> tuple[int, tuple[TaskGraphRecord, ...]]:
    """The current recording session and the TaskGraphs opened in it so far."""
    return _RECORDING.session, tuple(_RECORDING.records)


def current_taskgraph() -> TaskGraphRecord | None:
    """The TaskGraph a node built now would join (None: the first TaskGraph)."""
    return _RECORDING.current()


def current_scope() -> _StrategyBase | None:
    """The strategy (scope, default, or last replicate scope) new nodes are recorded
    under, or None before any annotation. For debugging."""
    record = _RECORDING.current()
    return record.strategy if record is not None else None


def set_default_strategy(strategy: replicate | split | None) -> None:
    """Opens a new TaskGraph for everything built outside a `with` block from now on.

    Each call opens the next TaskGraph (unless `strategy` is named after an existing
    one); `None` removes the default.

    Raises:
      TypeError: `strategy` is not a `replicate`/`split` (or None).
      ValueError: called inside a `with replicate/split` block.
    """
    if strategy is not None and not isinstance(strategy, _StrategyBase):
        raise TypeError(
            "set_default_strategy() takes replicate(...), split(...) or None (a Strategy "
            f"mapping is passed to the trainer or resolve_annotation()). Received: {strategy!r}"
        )
    recording = _RECORDING
    if recording.scope is not None:
        raise ValueError(
            f"set_default_strategy({strategy!r}) cannot be called inside the "
            f"`with {recording.scope!r}` block; call it outside any scope."
        )
    if strategy is None:
        recording.default_record = None
        return
    _install_node_hook()
    record = recording.open(strategy, reuse_object=False)
    recording.default_record = record
    if strategy.kind == "replicate":
        recording.last_replicate = record


def _enter_scope(strategy: _StrategyBase) -> None:
    recording = _RECORDING
    if recording.scope is not None:
        raise ValueError(
            f"Strategy annotations do not nest: cannot enter {strategy!r} inside "
            f"{recording.scope!r}. Close the outer `with` block first; each layer belongs "
            "to exactly one TaskGraph."
        )
    _install_node_hook()
    recording.scope_record = recording.open(strategy, reuse_object=True)
    recording.scope = strategy


def _exit_scope(strategy: _StrategyBase) -> None:
    recording = _RECORDING
    if recording.scope is not strategy:
        return  # reset_annotations() ran inside the block: nothing to close
    if strategy.kind == "replicate":
        recording.last_replicate = recording.scope_record
    recording.scope = recording.scope_record = None


def _install_node_hook() -> None:
    """Tags every new Keras Node with the current TaskGraph (idempotent).

    Keras also creates nodes when a Model is built from intermediate tensors (it clones
    the graph between them); clones get the TaskGraph of the node they copy rather than
    whatever is current at clone time.
    """
    from keras.src.models import functional
    from keras.src.ops.node import Node

    if not getattr(Node.__init__, "_epl_hook", False):
        original_init = Node.__init__

        @functools.wraps(original_init)
        def init(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            setattr(self, NODE_ATTR, _RECORDING.current())
            setattr(self, INHERITED_ATTR, _RECORDING.inherited())

        init._epl_hook = True
        Node.__init__ = init

    if not getattr(functional.clone_graph_nodes, "_epl_hook", False):
        original_clone = functional.clone_graph_nodes

        @functools.wraps(original_clone)
        def clone_graph_nodes(inputs, outputs):
            from keras import tree

            cloned_inputs, cloned_outputs = original_clone(inputs, outputs)
            _copy_tags(tree.flatten(outputs), tree.flatten(cloned_outputs))
            return cloned_inputs, cloned_outputs

        clone_graph_nodes._epl_hook = True
        functional.clone_graph_nodes = clone_graph_nodes


def _copy_tags(original_tensors: list, cloned_tensors: list) -> None:
    """Walks an original graph and its Keras clone side by side, copying node tags."""
    pending = list(zip(original_tensors, cloned_tensors, strict=False))
    seen: set[int] = set()
    while pending:
        original, clone = pending.pop()
        source, target = _producer(original), _producer(clone)
        if (
            source is None
            or target is None
            or target.is_input
            or id(target) in seen
            or source.operation is not target.operation
        ):
            continue
        seen.add(id(target))
        setattr(target, NODE_ATTR, getattr(source, NODE_ATTR, None))
        setattr(target, INHERITED_ATTR, getattr(source, INHERITED_ATTR, True))
        pending.extend(
            zip(source.arguments.keras_tensors, target.arguments.keras_tensors, strict=False)
        )


def _producer(tensor):
    history = getattr(tensor, "_keras_history", None)
    if history is None or history.operation is None:
        return None
    return history.operation._inbound_nodes[history.node_index]
