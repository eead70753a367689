"""Keras tests that pass on plain Keras but not routed through EPLTrainer, with the reason.

`EXCEPTIONS[reason] = (layouts, node ids)`; layouts "*" means every layout.
docs/reference/keras-conformance.md lists the same reasons. A test listed here that passes routed
must be taken off (test_keras_conformance.py checks both ways).
"""

from __future__ import annotations

ALL = "*"
PIPELINE = "pipeline"

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
SUBCLASSED_PIPELINE = (
    "a subclassed model has no layer graph to cut into pipeline stages: EPLTrainer says so "
    "by name (such a model trains data parallel)"
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
    ONE_LAYER_PIPELINE: (
        (PIPELINE,),
        [
            "lambda_callback_test.py::LambdaCallbackTest::test_lambda_callback",
            "lambda_callback_test.py::LambdaCallbackTest::test_lambda_callback_during_prediction",
            "lambda_callback_test.py::LambdaCallbackTest::test_lambda_callback_with_batches",
            "lambda_callback_test.py::LambdaCallbackTest::test_lambda_callback_with_kwargs",
            "model_test.py::ModelTest::test_functional_optional_inputs_optional_tensor",
            "swap_ema_weights_test.py::SwapEMAWeightsTest::test_swap_ema_weights",
            "swap_ema_weights_test.py::SwapEMAWeightsTest::test_swap_ema_weights_on_epoch",
            "swap_ema_weights_test.py::SwapEMAWeightsTest::test_swap_ema_weights_with_invalid_optimizer",
            "swap_ema_weights_test.py::SwapEMAWeightsTest::test_swap_ema_weights_with_loss_scale_optimizer",
            "tensorboard_test.py::TestTensorBoardV2::test_custom_summary",
            "terminate_on_nan_test.py::TerminateOnNaNTest::test_normal_training_does_not_raise_raise_error_false",
            "terminate_on_nan_test.py::TerminateOnNaNTest::test_normal_training_does_not_raise_raise_error_true",
            "terminate_on_nan_test.py::TerminateOnNaNTest::test_raise_error_terminate_does_not_trigger_on_train_end",
            "terminate_on_nan_test.py::TerminateOnNaNTest::test_raise_error_terminate_preserves_backup",
            "terminate_on_nan_test.py::TerminateOnNaNTest::test_raise_error_terminate_stops_on_later_batch",
            "terminate_on_nan_test.py::TerminateOnNaNTest::test_terminate_on_nan_graceful_stop",
            "terminate_on_nan_test.py::TerminateOnNaNTest::test_terminate_on_nan_raise_error_raises_error",
            "functional_test.py::FunctionalTest::test_required_none_raises_in_fit",
            "model_test.py::ModelTest::test_functional_dict_outputs_with_single_tensor",
            "model_test.py::ModelTest::test_functional_optional_inputs_generator_optional_none",
            "model_test.py::ModelTest::test_functional_optional_inputs_generator_optional_tensor",
            "model_test.py::ModelTest::test_functional_optional_inputs_optional_none",
            "model_test.py::ModelTest::test_functional_pickling_single_list_output_1",
            "model_test.py::ModelTest::test_functional_pickling_single_list_output_2",
            "model_test.py::ModelTest::test_functional_pickling_single_list_output_3",
            "model_test.py::ModelTest::test_functional_pickling_single_list_output_4",
            "model_test.py::ModelTest::test_functional_pickling_single_output_1",
            "model_test.py::ModelTest::test_functional_pickling_single_output_2",
            "model_test.py::ModelTest::test_functional_pickling_single_output_3",
            "model_test.py::ModelTest::test_functional_pickling_single_output_4",
            "model_test.py::ModelTest::test_functional_single_output_single_dict_output_1",
            "model_test.py::ModelTest::test_functional_single_output_single_dict_output_2",
            "model_test.py::ModelTest::test_functional_single_output_single_dict_output_3",
            "model_test.py::ModelTest::test_functional_single_output_single_dict_output_4",
            "model_test.py::ModelTest::test_functional_single_output_single_list_output_1",
            "model_test.py::ModelTest::test_functional_single_output_single_list_output_2",
            "model_test.py::ModelTest::test_functional_single_output_single_list_output_3",
            "model_test.py::ModelTest::test_functional_single_output_single_list_output_4",
            "model_test.py::ModelTest::test_functional_single_output_single_output_1",
            "model_test.py::ModelTest::test_functional_single_output_single_output_2",
            "model_test.py::ModelTest::test_functional_single_output_single_output_3",
            "model_test.py::ModelTest::test_functional_single_output_single_output_4",
        ],
    ),
    MICRO_BATCH_CALLS: (
        (PIPELINE,),
        [
            "backup_and_restore_test.py::BackupAndRestoreCallbackTest::test_backup_corrupted",
            "backup_and_restore_test.py::BackupAndRestoreCallbackTest::test_best_case_epoch",
            "backup_and_restore_test.py::BackupAndRestoreCallbackTest::test_best_case_step",
        ],
    ),
    SUBCLASSED_PIPELINE: (
        (PIPELINE,),
        [
            "callback_test.py::CallbackTest::test_model_state_is_current_on_epoch_end",
        ],
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
