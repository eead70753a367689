"""`gradient_checkpoint.check_gradients`: gradients with checkpointing against plain ones.

Runs once, eagerly, before training: for each recomputed stage, the gradients of a
random projection of its outputs (plus its auxiliary losses) are computed by the plain
`stateless_call` and by the recomputed call, and must agree within a tolerance.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from epl_trainer.core.graph.partition import StagedModel, functional_graph


class GradientMismatchError(ValueError):
    """Gradients with checkpointing differ from the plain ones beyond the tolerance."""


def check_gradients(
    plain_call,
    recompute_call,
    variables: Sequence,
    non_trainable: Sequence,
    inputs,
    *,
    training: bool = True,
    names: Sequence[str] | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> float:
    """Compares both calls' gradients for one micro-batch (`check_gradients=True`).

    The objective is the sum of every float output times a fixed random tensor plus the
    auxiliary losses, so every output's gradient path is checked. Both calls get the
    same non-trainable values (so the same dropout masks). Call it eagerly, once.

    Args:
      plain_call, recompute_call: `stateless_call`-like callables of the same stage.
      variables: trainable values in the stage model's order.
      non_trainable: non-trainable values in the stage model's order.
      inputs: the stage's argument (float leaves are differentiated too).
      names: one per variable, for the error message (default: "variable <i>").

    Returns:
      The largest absolute difference over all gradients.

    Raises:
      GradientMismatchError: some |recomputed - plain| > atol + rtol * |plain|; the
        message names the worst tensor and the largest absolute difference.
    """
    variables = [tf.convert_to_tensor(v) for v in variables]
    flat = [tf.convert_to_tensor(x) for x in tree.flatten(inputs)]
    float_inputs = [x for x in flat if x.dtype.is_floating]
    names = list(names or [f"variable {i}" for i in range(len(variables))])
    names += [f"input {i}" for i, x in enumerate(flat) if x.dtype.is_floating]

    @tf.function(autograph=False)
    def both(variables, float_inputs):
        results = []
        for call in (plain_call, recompute_call):
            with tf.GradientTape() as tape:
                tape.watch(variables + float_inputs)
                leaves, at = list(flat), iter(float_inputs)
                leaves = [next(at) if x.dtype.is_floating else x for x in leaves]
                outputs, _, losses = call(
                    variables,
                    list(non_trainable),
                    tree.pack_sequence_as(inputs, leaves),
                    training=training,
                    return_losses=True,
                )
                objective = tf.add_n([tf.zeros([])] + [tf.cast(x, tf.float32) for x in losses])
                for i, y in enumerate(tree.flatten(outputs)):
                    if y.dtype.is_floating:
                        weights = tf.random.stateless_normal(tf.shape(y), [7, i], dtype=y.dtype)
                        objective += tf.cast(tf.reduce_sum(y * weights), tf.float32)
            results.append(
                tape.gradient(
                    objective,
                    variables + float_inputs,
                    unconnected_gradients=tf.UnconnectedGradients.ZERO,
                )
            )
        return results

    plain, recomputed = both(variables, float_inputs)
    worst, worst_excess, largest = None, -np.inf, 0.0
    for name, a, b in zip(names, plain, recomputed):
        a, b = np.asarray(tf.convert_to_tensor(a)), np.asarray(tf.convert_to_tensor(b))
        diff = np.abs(b.astype(np.float64) - a)
        if diff.size == 0:
            continue
        excess = float(np.max(diff - atol - rtol * np.abs(a)))
        largest = max(largest, float(diff.max()))
        if excess > worst_excess:
            worst, worst_excess, worst_diff = name, excess, float(diff.max())
    if worst_excess > 0:
        raise GradientMismatchError(
            f"Gradients with gradient checkpointing differ from the plain gradients: "
            f"worst is {worst!r} with max |difference| {worst_diff:.3g} (tolerance: "
            f"atol={atol}, rtol={rtol}). Received: largest difference over all "
            f"gradients {largest:.3g}"
        )
    return largest


def check_stage_gradients(
    staged: StagedModel,
    recomputed: dict,
    features,
    *,
    training: bool = True,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> dict:
    """`check_gradients` for every recomputed stage on one micro-batch of features.

    Stages run plainly in order to produce each stage's inputs; every stage uses the
    Keras model's current variable values (equal to the engine's before the first
    step). Call it eagerly, once, before training.

    Args:
      recomputed: stage index -> `RecomputedStage`.

    Returns:
      Stage index -> the largest absolute gradient difference.
    """
    values = dict(zip(staged.input_keys, staged.flatten_inputs(features)))
    if not staged.whole_model:
        graph_inputs = functional_graph(staged.model).inputs
        values = {
            k: keras.ops.convert_to_tensor(v, dtype=t.dtype)
            for (k, v), t in zip(values.items(), graph_inputs)
        }
    differences = {}
    for stage in staged.stages:
        model = stage.model
        variables = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        arguments = staged.stage_arguments(stage, values)
        if stage.index in recomputed:
            differences[stage.index] = check_gradients(
                model.stateless_call,
                recomputed[stage.index].stateless_call,
                variables,
                non_trainable,
                arguments,
                training=training,
                names=[f"stage {stage.index}: {v.path}" for v in model.trainable_variables],
                rtol=rtol,
                atol=atol,
            )
        outputs, _ = model.stateless_call(variables, non_trainable, arguments, training=training)
        values.update(staged.stage_results(stage, outputs))
    return differences
