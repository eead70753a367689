"""A (stage, micro-batch) backward split into B (input gradients) and W (weight gradients).

Zero-bubble schedules (schedule.py's ZB-H1) run the gradient of a stage's inputs (B, what
the previous stage waits for) at one point of the schedule and the gradient of its weights
(W, what no stage waits for) later, in what would otherwise be a bubble. Two
`tape.gradient` calls (inputs at B, weights at W, on a persistent tape) build the
gradients of the stage's internal activations twice, and grappler merges only part of that
(the calls hang under different control dependencies): the step runs more MatMuls and
takes longer (docs/benchmarks.md#one-backward-call-for-b-and-w). So the backward is ONE
`tape.gradient` call over the weights and the inputs, emitted at B, and the ops only the
weights' gradients need (a Dense layer's `x^T dy`, a bias's sum, unconnected zeros) are
held back: at W, each such op that reads no other held-back op gets a control input from a
no-op that waits for the stage's previous task (and, with stages on several workers, for
the stage's sends since its previous W: executor.py). The held-back ops then run in W's
place of the schedule, reading the activation gradients B computed (which stay alive until
then: what a micro-batch waiting for W keeps).

A backward that is one op (a stage compiled by XLA: its gradient is one function call)
has nothing to hold back: it runs whole at B, and W only hands its weight gradients on.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf


@dataclasses.dataclass
class PendingWeights:
    """What B leaves for W: the weights' gradients, and the ops W must release."""

    gradients: list  # per source variable, as `tape.gradient` returned them
    held_back: list  # ops computing only weight gradients that read no other such op


def split_gradient(compute, num_variables: int, split: bool = True):
    """Runs `compute()` (one `tape.gradient` over `variables + inputs`, in that order) and,
    if `split`, finds the ops only the first `num_variables` results need.

    Returns:
      (the inputs' gradients, `PendingWeights`). Unsplit, or eagerly (no graph to hold
      back: everything has run), `held_back` is empty.
    """
    if not split or tf.executing_eagerly():
        computed = compute()
        return computed[num_variables:], PendingWeights(computed[:num_variables], [])
    graph = tf.compat.v1.get_default_graph()
    before = len(graph.get_operations())
    computed = compute()
    created = set(graph.get_operations()[before:])
    input_grads = computed[num_variables:]
    weight_grads = computed[:num_variables]
    needed_by_inputs = _ancestors(_ops_of(input_grads), created)
    weights_only = _ancestors(_ops_of(weight_grads), created) - needed_by_inputs
    held_back = [
        op
        for op in weights_only
        if not any(x.op in weights_only for x in op.inputs)
        and not any(c in weights_only for c in op.control_inputs)
    ]
    held_back.sort(key=lambda op: op.name)  # a stable graph: the same edges every trace
    return input_grads, PendingWeights(weight_grads, held_back)


def release(pending: PendingWeights, after: list) -> None:
    """Lets W's held-back ops run once the tensors `after` (the stage's previous task)
    exist. Called at W's position in the schedule."""
    if not pending.held_back:
        return
    with tf.control_dependencies(after):
        gate = tf.no_op(name="weight_gradients_after_previous_task")
    for op in pending.held_back:
        # Ops made at B, ordered at W: TF has no public way to add an edge to an op
        # already built, and building the ops at W would compute B's part twice.
        op._add_control_input(gate)


def _ops_of(tensors) -> list:
    flat = tf.nest.flatten(tensors, expand_composites=True)
    return [t.op for t in flat if t is not None and hasattr(t, "op")]


def _ancestors(ops, within: set) -> set:
    """`ops` and every op they read (data and control inputs), among `within`."""
    seen: set = set()
    stack = [op for op in ops if op in within]
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        stack.extend(x.op for x in op.inputs if x.op in within)
        stack.extend(c for c in op.control_inputs if c in within)
    return seen
