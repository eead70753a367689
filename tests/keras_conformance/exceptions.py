"""Keras tests that pass on plain Keras but not routed through EPLTrainer, with the reason.

`EXCEPTIONS[reason] = (layouts, node ids)`; layouts "*" means every layout. The README's
"Keras's own tests" section lists the same reasons. A test listed here that passes routed
must be taken off (test_keras_conformance.py checks both ways).
"""

from __future__ import annotations

ALL = "*"

# Reasons that are the trainer's design, not something missing.
NONFINITE_NOT_APPLIED = (
    "a step whose loss is NaN or Inf is never applied (Keras applies it and the weights "
    "become NaN, which the test then looks for in the validation loss)"
)
NONFINITE_STOPS = (
    "the test's model diverges to NaN for some initial weights (Keras then trains on with "
    "NaN weights; EPLTrainer stops with NonFiniteLossError, or skips with "
    "optimizer.nonfinite_loss='skip')"
)
TF_DISTRIBUTE = (
    "the test trains under tf.distribute.MirroredStrategy: EPLTrainer distributes the model "
    "itself and refuses another strategy's scope by name"
)
# Tests whose outcome depends on the random initial weights: listed, may pass or fail.
SEED_DEPENDENT = {NONFINITE_STOPS}
ONE_LAYER_PIPELINE = (
    "a model of one layer (or one compute node) cannot be cut into the layout's 2 pipeline "
    "stages: EPLTrainer says so by name"
)
MICRO_BATCH_CALLS = (
    "with 2 micro-batches per step each layer runs twice per step, so a layer that counts "
    "its own calls counts 2 per step"
)

EXCEPTIONS: dict[str, tuple[tuple[str, ...], list[str]]] = {
    NONFINITE_NOT_APPLIED: (
        (ALL,),
        ["csv_logger_test.py::CSVLoggerTest::test_stop_training_csv"],
    ),
    NONFINITE_STOPS: (
        (ALL,),
        ["tensorboard_test.py::TestTensorBoardV2::test_TensorBoard_weight_images"],
    ),
    TF_DISTRIBUTE: (
        (ALL,),
        ["swap_ema_weights_test.py::SwapEMAWeightsTest::test_swap_ema_weights_with_tf_distribute"],
    ),
}  # fmt: skip


def for_layout(layout: str, baseline) -> dict[str, str]:
    """{node id: reason} of the listed exceptions for `layout` among `baseline`'s tests."""
    present = set(baseline)
    listed = {}
    for reason, (layouts, nodes) in EXCEPTIONS.items():
        if ALL in layouts or layout in layouts:
            listed.update({node: reason for node in nodes if node in present})
    return listed
