"""Each lane's stateful ops ordered among themselves, not after every other lane's.

Inside a `tf.function`, TF's automatic control dependencies run the stateful ops that
touch no resource (tf.debugging asserts, such as the shape checks of Keras's sparse
cross-entropy and of `ops.take`; `tf.print`) in program order: each waits for the last
one traced before it, whichever lane traced it. The lanes of a step are traced in turn,
while their collectives pair with the other lanes' inside the step (split layers and
Keras sharding maps, synchronized BatchNorm, transfers between stages). A lane's op that
waits for another lane's later op is then a deadlock: a check of lane 1's input waited
for lane 0's loss assert, which waited for lane 0's all-reduce with lane 1, which waited
for lane 1's input (the first step hung; tests/test_keras_distribution.py). Ordered per
lane, such ops wait only for their own lane's earlier ones, as they do on one device.

`traced_as_lane(li)` marks the ops traced inside it as lane li's; the resolver below,
registered with TF's automatic control dependencies, gives each such op lane li's order
token as a resource it writes, so one lane's ops chain on its token instead of the
function's single chain. Ops outside every lane keep that single chain.
"""

from __future__ import annotations

import contextlib
import weakref

import tensorflow as tf
from tensorflow.python.framework import auto_control_deps


class _LaneMarks:
    """One traced graph's lane spans: (first op id, last op id, lane) of each span, in
    the order they closed, and each lane's order token."""

    def __init__(self):
        self.spans: list[tuple[int, int, int]] = []
        self.tokens: dict[int, tf.Tensor] = {}

    def lane_of(self, op_id: int) -> int | None:
        """The lane of the innermost span holding `op_id` (spans nest when a lane's
        context is entered inside another's)."""
        found, begin = None, -1
        for first, last, lane in self.spans:
            if first < op_id < last and first > begin:
                found, begin = lane, first
        return found


_marks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def traced_as_lane(li: int):
    """The ops traced inside the block are lane li's: its stateful ops that touch no
    resource run in program order among lane li's alone. Nothing happens eagerly or
    outside a function being traced."""
    graph = tf.compat.v1.get_default_graph()
    if tf.executing_eagerly() or not getattr(graph, "building_function", False):
        yield
        return
    marks = _marks.get(graph)
    if marks is None:
        marks = _marks[graph] = _LaneMarks()
    with graph.control_dependencies(None):
        if li not in marks.tokens:
            marks.tokens[li] = tf.constant(li, name=f"lane{li}_order_token")
        begin = tf.no_op(name=f"lane{li}_ops_begin")
    try:
        yield
    finally:
        with graph.control_dependencies(None):
            end = tf.no_op(name=f"lane{li}_ops_end")
        marks.spans.append((begin._id, end._id, li))


@auto_control_deps.register_acd_resource_resolver
def _lane_order_resolver(op, resource_reads, resource_writes) -> bool:
    """Gives a lane's stateful op that touches no resource its lane's order token."""
    if resource_reads or resource_writes:
        return False
    marks = _marks.get(op.graph)
    if marks is None or not auto_control_deps.op_is_stateful(op):
        return False
    lane = marks.lane_of(op._id)
    if lane is None:
        return False
    resource_writes.add(marks.tokens[lane])
    return True
