"""Keras tests that pass on plain Keras but not routed through EPLTrainer (`EXCEPTIONS`), and
those that pass routed with every call on Keras's own path (`EXPECTED_UNROUTED`), each with
its reason and the message it must show.

`EXCEPTIONS[reason] = Listed(layouts, message, nodes)`: each node must fail routed with a
failure text (its exceptions and messages) in which the regex `message` is found.
`EXPECTED_UNROUTED[reason] = Listed(layouts, message, nodes)`: each node must pass with no
routed call, its fallback reasons ("fit: not compiled", one a line, routing.py) matching
`message`. Layouts "*" means every layout; an entry naming a layout wins there.
verdict.py judges each test against these lists; a listed test that passes routed must be
taken off (so the lists stay true), and docs/reference/keras-conformance.md gives every
reason.
"""

from __future__ import annotations

from typing import NamedTuple

ALL = "*"
DP = "dp"
PIPELINE = "pipeline"


class Listed(NamedTuple):
    layouts: tuple[str, ...]
    message: str  # regex searched in the failure text (or the fallback reasons)
    nodes: list[str]


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
OWN_STEP_STEPS_PER_EXECUTION = (
    "a model's own train_step with steps_per_execution > 1: EPLTrainer refuses the "
    "combination by name (rules.user_steps_layout)"
)

# Keras behaviour the trainer does not have yet (trainers/ tests, issue #45 item 9).
TRAINER_MIXIN_MODEL = (
    "the model is a layer mixed in with Keras's backend Trainer (`class ExampleModel(Trainer, "
    "layers.Dense)`, as most of trainer_test.py's models), not a keras.Model: EPLTrainer "
    "takes it for a model_fn, calls it with no argument and fails (TypeError: missing a "
    "required argument)"
)
INPUT_STRUCTURE_WARNING = (
    "inputs given in another structure than the model's (a list for a dict of inputs): "
    "Keras's Functional warns and restructures them, EPLTrainer restructures them to the "
    "model's inputs (model_inputs.py) without that warning"
)
RAGGED_INPUTS = (
    "fit / predict on tf.RaggedTensor inputs and targets: the trainer's input path takes "
    "len() of a RaggedTensor (TypeError), or for a layer mixed with Sequential indexes a "
    "0-d array (IndexError)"
)
SEED_GENERATOR_PREDICT = (
    "a layer drawing from its own keras.random.SeedGenerator at inference (dropout in "
    "call) gives the same values in two predict calls: the generator's state does not "
    "advance as under Keras"
)

EXCEPTIONS: dict[str, Listed] = {
    NONFINITE_NOT_APPLIED: Listed(
        (ALL,),
        r"'nan' not found in .*NaN not logged in CSV Logger",
        [
            "csv_logger_test.py::CSVLoggerTest::test_stop_training_csv",
        ],
    ),
    NONFINITE_STOPS: Listed(
        (ALL,),
        r"NonFiniteLossError: The loss or its gradients are not finite",
        [
            "tensorboard_test.py::TestTensorBoardV2::test_TensorBoard_weight_images",
        ],
    ),
    TF_DISTRIBUTE: Listed(
        (ALL,),
        r"cannot run under a tf\.distribute strategy\. Received: MirroredStrategy",
        [
            "swap_ema_weights_test.py::SwapEMAWeightsTest::test_swap_ema_weights_with_tf_distribute",
        ],
    ),
    OWN_STEP_STEPS_PER_EXECUTION: Listed(
        (ALL,),
        r"Received: the model overrides train_step; with steps_per_execution=20",
        [
            "trainer_test.py::TestTrainer::test_retracing",
        ],
    ),
    TRAINER_MIXIN_MODEL: Listed(
        (ALL,),
        r"EPLTrainer refused the model: TypeError: missing a required argument: '(inputs|x)'",
        [
            "trainer_test.py::TestTrainer::test_adds_loss_scaling_optimizer",
            "trainer_test.py::TestTrainer::test_callback_methods_keys",
            "trainer_test.py::TestTrainer::test_evaluate_flow_graph_fn",
            "trainer_test.py::TestTrainer::test_evaluate_return_list_respect_metrics_order",
            "trainer_test.py::TestTrainer::test_evaluate_sparse_tf_graph",
            "trainer_test.py::TestTrainer::test_evaluate_with_custom_test_step_dict",
            "trainer_test.py::TestTrainer::test_evaluate_with_custom_test_step_flat",
            "trainer_test.py::TestTrainer::test_evaluate_with_different_batch_size_same_loss",
            "trainer_test.py::TestTrainer::test_fit_flow_graph_fn",
            "trainer_test.py::TestTrainer::test_fit_flow_steps_per_epoch_graph_fn",
            "trainer_test.py::TestTrainer::test_fit_sparse_tf_graph",
            "trainer_test.py::TestTrainer::test_fit_with_custom_train_step",
            "trainer_test.py::TestTrainer::test_fit_with_data_adapter_generator",
            "trainer_test.py::TestTrainer::test_fit_with_data_adapter_generator_infinite",
            "trainer_test.py::TestTrainer::test_fit_with_data_adapter_native_array",
            "trainer_test.py::TestTrainer::test_fit_with_data_adapter_np_array",
            "trainer_test.py::TestTrainer::test_fit_with_data_adapter_py_dataset",
            "trainer_test.py::TestTrainer::test_fit_with_data_adapter_py_dataset_cw",
            "trainer_test.py::TestTrainer::test_fit_with_data_adapter_py_dataset_infinite",
            "trainer_test.py::TestTrainer::test_fit_with_data_adapter_py_dataset_infinite_cw",
            "trainer_test.py::TestTrainer::test_fit_with_data_adapter_py_dataset_multithreading",
            "trainer_test.py::TestTrainer::test_fit_with_data_adapter_py_dataset_multithreading_cw",
            "trainer_test.py::TestTrainer::test_fit_with_data_adapter_py_dataset_multithreading_infinite",
            "trainer_test.py::TestTrainer::test_fit_with_data_adapter_tf_dataset",
            "trainer_test.py::TestTrainer::test_fit_with_data_adapter_tf_dataset_infinite",
            "trainer_test.py::TestTrainer::test_fit_with_different_batch_size_same_loss",
            "trainer_test.py::TestTrainer::test_fit_with_val_split_graph_fn",
            "trainer_test.py::TestTrainer::test_fit_with_val_split_steps_per_epoch_graph_fn",
            "trainer_test.py::TestTrainer::test_for_eval_epoch_iterator",
            "trainer_test.py::TestTrainer::test_loss_scaling_prevents_underflow",
            "trainer_test.py::TestTrainer::test_loss_weights",
            "trainer_test.py::TestTrainer::test_max_epochs_and_steps",
            "trainer_test.py::TestTrainer::test_metric_tracking",
            "trainer_test.py::TestTrainer::test_nested_inputs",
            "trainer_test.py::TestTrainer::test_predict_flow_graph_fn",
            "trainer_test.py::TestTrainer::test_predict_flow_struct_graph_fn",
            "trainer_test.py::TestTrainer::test_predict_sparse_tf_graph",
            "trainer_test.py::TestTrainer::test_recompile",
            "trainer_test.py::TestTrainer::test_steps_per_epoch_match_multi_epoch_non_jit",
            "trainer_test.py::TestTrainer::test_steps_per_epoch_match_one_epoch_non_jit",
            "trainer_test.py::TestTrainer::test_steps_per_epoch_not_match_but_high_enough_non_jit",
            "trainer_test.py::TestTrainer::test_steps_per_epoch_not_match_too_low_non_jit",
            "trainer_test.py::TestTrainer::test_steps_per_execution_steps_count_101_non_jit",
            "trainer_test.py::TestTrainer::test_steps_per_execution_steps_count_3_non_jit",
            "trainer_test.py::TestTrainer::test_steps_per_execution_steps_count_unknown_dataset_size_101_non_jit",
            "trainer_test.py::TestTrainer::test_steps_per_execution_steps_count_unknown_dataset_size_3_non_jit",
            "trainer_test.py::TestTrainer::test_steps_per_execution_steps_count_without_training",
            "trainer_test.py::TestTrainer::test_steps_per_execution_steps_per_epoch_match_multi_epoch_non_jit",
            "trainer_test.py::TestTrainer::test_steps_per_execution_steps_per_epoch_match_one_epoch_non_jit",
            "trainer_test.py::TestTrainer::test_steps_per_execution_steps_per_epoch_not_match_but_high_enough_non_jit",
            "trainer_test.py::TestTrainer::test_steps_per_execution_steps_per_epoch_not_match_too_low_non_jit",
            "trainer_test.py::TestTrainer::test_steps_per_execution_steps_per_epoch_unknown_data_size_match_non_jit",
            "trainer_test.py::TestTrainer::test_steps_per_execution_steps_per_epoch_unknown_data_size_not_match_but_high_enough_non_jit",
            "trainer_test.py::TestTrainer::test_steps_per_execution_steps_per_epoch_unknown_data_size_not_match_too_low_non_jit",
            "trainer_test.py::TestTrainer::test_steps_per_execution_unrolled_steps_steps_count_3",
            "trainer_test.py::TestTrainer::test_stop_loop_evaluate",
            "trainer_test.py::TestTrainer::test_stop_loop_fit",
            "trainer_test.py::TestTrainer::test_stop_loop_predict",
            "trainer_test.py::TestTrainer::test_training_arg",
            "trainer_test.py::TestTrainer::test_validation_data_infinite_generator",
        ],
    ),
    INPUT_STRUCTURE_WARNING: Listed(
        (ALL,),
        r"DID NOT WARN",
        [
            "functional_test.py::FunctionalTest::test_warning_for_mismatched_inputs_structure",
        ],
    ),
    RAGGED_INPUTS: Listed(
        (ALL,),
        r"object of type 'RaggedTensor' has no len\(\)|too many indices for array: array is 0-d",
        [
            "trainer_test.py::TestTrainer::test_trainer_with_raggeds_functional",
            "trainer_test.py::TestTrainer::test_trainer_with_raggeds_layer",
            "trainer_test.py::TestTrainer::test_trainer_with_raggeds_model",
        ],
    ),
    SEED_GENERATOR_PREDICT: Listed(
        (ALL,),
        r"np\.float32\(0\.0\) not greater than 0\.01",
        [
            "trainer_test.py::TestTrainer::test_rng_updated_during_predict",
        ],
    ),
    ONE_LAYER_PIPELINE: Listed(
        (PIPELINE,),
        r"Cannot cut 2 stages from model '\w+' with 1 compute nodes",
        [
            "trainer_test.py::TestTrainer::test_predict_dropout",
            "functional_test.py::FunctionalTest::test_required_none_raises_in_fit",
            "lambda_callback_test.py::LambdaCallbackTest::test_lambda_callback",
            "lambda_callback_test.py::LambdaCallbackTest::test_lambda_callback_during_prediction",
            "lambda_callback_test.py::LambdaCallbackTest::test_lambda_callback_with_batches",
            "lambda_callback_test.py::LambdaCallbackTest::test_lambda_callback_with_kwargs",
            "model_test.py::ModelTest::test_functional_dict_outputs_with_single_tensor",
            "model_test.py::ModelTest::test_functional_list_outputs_with_custom_compute_loss",
            "model_test.py::ModelTest::test_functional_optional_inputs_generator_optional_none",
            "model_test.py::ModelTest::test_functional_optional_inputs_generator_optional_tensor",
            "model_test.py::ModelTest::test_functional_optional_inputs_optional_none",
            "model_test.py::ModelTest::test_functional_optional_inputs_optional_tensor",
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
            "trainer_test.py::TestTrainer::test_constraints_are_applied",
            "trainer_test.py::TestTrainer::test_partial_loss_partial_label",
            "trainer_test.py::TestTrainer::test_predict_generator_1_non_jit",
            "trainer_test.py::TestTrainer::test_predict_generator_50_non_jit",
            "trainer_test.py::TestTrainer::test_predict_preserve_order_1_non_jit",
            "trainer_test.py::TestTrainer::test_predict_preserve_order_50_non_jit",
            "trainer_test.py::TestTrainer::test_retracing",
            "trainer_test.py::TestTrainer::test_rng_updated_during_predict",
            "trainer_test.py::TestTrainer::test_trainer_with_raggeds_functional",
        ],
    ),
    MICRO_BATCH_CALLS: Listed(
        (PIPELINE,),
        r"AssertionError: (12 != 6|4 != 2)\b",
        [
            "backup_and_restore_test.py::BackupAndRestoreCallbackTest::test_backup_corrupted",
            "backup_and_restore_test.py::BackupAndRestoreCallbackTest::test_best_case_epoch",
            "backup_and_restore_test.py::BackupAndRestoreCallbackTest::test_best_case_step",
        ],
    ),
    SUBCLASSED_PIPELINE: Listed(
        (PIPELINE,),
        r"is a subclassed model: only functional and Sequential models can be cut",
        [
            "trainer_test.py::TestTrainer::test_nested_input_predict",
            "callback_test.py::CallbackTest::test_model_state_is_current_on_epoch_end",
            "trainer_test.py::TestTrainer::test_callbacks_can_update_state_at_batch_boundary",
            "trainer_test.py::TestTrainer::test_compute_loss_no_training_backwards_compatibility",
            "trainer_test.py::TestTrainer::test_evaluate_with_custom_compute_loss",
            "trainer_test.py::TestTrainer::test_fwd_pass_loss_presence_in_compute_loss",
            "trainer_test.py::TestTrainer::test_metric_update_in_compute_loss",
            "trainer_test.py::TestTrainer::test_trainer_with_raggeds_model",
        ],
    ),
}  # fmt: skip

# Tests that pass with every fit / evaluate / predict call on Keras's own path (routing.py
# keeps it for fit / evaluate on an uncompiled model, whose Keras error the test expects).
EXPECTED_UNROUTED: dict[str, Listed] = {}


def for_layout(layout: str, lists: dict[str, Listed]) -> dict[str, tuple[str, str]]:
    """{node id: (reason, message)} of `lists`' entries for `layout`. An entry naming the
    layout wins over one for every layout: a test that fails for a reason everywhere can
    fail earlier in the pipeline layout for a reason of its own (a one-layer model is
    refused before it trains). A node listed twice at the same level is an error."""
    listed: dict[str, tuple[str, str]] = {}
    for level in (ALL, layout):  # the layout's own entries last, so that they win
        seen: dict[str, str] = {}
        for reason, entry in lists.items():
            if level not in entry.layouts:
                continue
            for node in entry.nodes:
                if node in seen:
                    raise ValueError(
                        f"{node} is listed twice for layout {level!r}. Received: reasons "
                        f"{seen[node]!r} and {reason!r}"
                    )
                seen[node] = reason
                listed[node] = (reason, entry.message)
    return listed
