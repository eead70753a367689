"""The trainer's `evaluate` and `predict`, with Keras's arguments, callbacks and logs.

Batches run in the compiled loops of the engine (`eval_many_on_iterator`,
`predict_many_on_iterator`), many per call: one host round trip per
`EVAL_STEPS_PER_CALL` batches. A callback that implements the test or predict batch
hooks gets them for every batch (`steps_per_execution` batches per call), as in Keras;
the progress bar alone is updated once per call.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from keras import tree

from epl_trainer.training import data as data_lib
from epl_trainer.training import fit_inputs
from epl_trainer.training import model_fn as model_fn_lib
from epl_trainer.training.context import TrainerContext
from epl_trainer.training.data_feeder import DataFeeder
from epl_trainer.training.engine_runtime import EngineRuntime
from epl_trainer.training.iterators import release
from epl_trainer.training.objectives import Objectives

# Evaluation and prediction batches per call of the compiled loop when no callback needs
# each batch: one host round trip per this many batches.
EVAL_STEPS_PER_CALL = 64


class InferenceRunner:
    """Runs evaluation and prediction through the engine. Holds no state of its own
    between calls: the metrics are the objectives', the engine the runtime's.

    Args:
      context: the run's settings.
      runtime: the engine (built at the first batch).
      objectives: the loss and metrics evaluated, and their logs.
      feeder: the inputs as batches.
    """

    def __init__(
        self,
        context: TrainerContext,
        runtime: EngineRuntime,
        objectives: Objectives,
        feeder: DataFeeder,
    ):
        self._context = context
        self._runtime = runtime
        self._objectives = objectives
        self._feeder = feeder

    def evaluate(
        self,
        x=None,
        y=None,
        batch_size=None,
        verbose="auto",
        sample_weight=None,
        steps=None,
        callbacks=None,
        return_dict=False,
    ):
        """`EPLTrainer.evaluate` (its docstring has the arguments)."""
        dataset = self._feeder.evaluation_dataset(
            x, y, sample_weight, batch_size, model_fn_lib.EVAL
        )
        self._objectives.require_loss("evaluate")
        dataset = fit_inputs.at_most(dataset, steps)
        verbose = fit_inputs.verbosity(verbose)
        callback_list = fit_inputs.callback_list(
            callbacks, self._context.model, verbose, steps=fit_inputs.num_batches(dataset)
        )
        logs = self.evaluate_dataset(dataset, callback_list)
        return self._objectives.returned(logs, return_dict)

    def evaluate_dataset(self, dataset, callbacks) -> dict:
        """Evaluates `dataset` with `callbacks` (evaluate's own, or fit's for validation)."""
        self._context.model.stop_evaluating = False
        first = next(iter(dataset.take(1)), None)  # builds the engine (and the model)
        program = None
        if first is not None:
            features = data_lib.unpack_element(first)[0]
            program = self._runtime.ensure(features)
            size = _rows(features)
        self._objectives.reset()
        self._runtime.run_hook(callbacks, "on_test_begin")
        batches = 0
        # A batch hook that may read or set the model's variables sees the trained ones,
        # and what it sets stays (the engine takes them back after the batches).
        hooks_see_variables = program is not None and fit_inputs.needs_fresh_weights_per_step(
            callbacks, "test"
        )
        if hooks_see_variables:
            self._runtime.write_back()
        if program is not None:

            def run_call(iterator, count):
                with self._runtime.watch("an evaluation step"):
                    ran = int(program.eval_many_on_iterator(iterator, count, size))
                return ran, self._objectives.local_logs()

            iterator = iter(dataset)
            try:
                batches = self.run_in_calls(dataset, iterator, 0, callbacks, "test", run_call)
            finally:  # deleting it can wait for tf.data's autotuning (iterators.py)
                release(iterator)
                del iterator
        if hooks_see_variables:
            self._runtime.load_from_model(optimizer=False)
        step_logs = getattr(program, "last_test_logs", None)  # a model's own test_step's
        if step_logs is not None:
            step_logs = {k: fit_inputs.log_value(v) for k, v in step_logs.items()}
        with self._runtime.watch("the evaluation's metric sync"):
            logs = self._objectives.logs(step_logs)
        if batches == 0 and self._context.cluster.worker_num == 1:
            # Keras's Mean reports 0 for no samples: a silent, wrong "perfect" loss.
            raise ValueError("evaluate received no data. Check the dataset, batch_size and steps.")
        self._runtime.run_hook(callbacks, "on_test_end", logs)
        return logs

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """`EPLTrainer.predict` (its docstring has the arguments)."""
        dataset = self._feeder.prediction_dataset(x, batch_size, steps)
        callback_list = fit_inputs.callback_list(
            callbacks,
            self._context.model,
            fit_inputs.verbosity(verbose),
            steps=fit_inputs.num_batches(dataset),
        )
        self._context.model.stop_predicting = False
        callback_list.on_predict_begin()
        iterator = iter(dataset)
        features = next(iterator, None)  # builds the engine (and the model)
        if features is None:
            raise ValueError("predict received no data.")
        program = self._runtime.ensure(features)
        size = _rows(features)
        callback_list.on_predict_batch_begin(0)
        # A pipeline whose stages are on several workers sends activations between them.
        with self._runtime.watch("a prediction step"):
            first = program.predict_step(features)
        flat = [[np.asarray(t)] for t in tree.flatten(first)]
        callback_list.on_predict_batch_end(0, {"outputs": tree.map_structure(np.asarray, first)})

        def run_call(iterator, count):
            with self._runtime.watch("a prediction step"):
                outputs, ran = program.predict_many_on_iterator(
                    iterator, count, size, tree.flatten(first)
                )
            outputs = [np.asarray(output) for output in outputs]
            for pieces, output in zip(flat, outputs):
                pieces.append(output)
            return int(ran), {"outputs": tree.pack_sequence_as(first, outputs)}

        if not self._context.model.stop_predicting:
            self.run_in_calls(dataset, iterator, 1, callback_list, "predict", run_call)
        release(iterator)  # deleting it can wait for tf.data's autotuning (iterators.py)
        del iterator
        callback_list.on_predict_end()
        return tree.pack_sequence_as(first, [np.concatenate(pieces) for pieces in flat])

    def run_in_calls(self, dataset, iterator, begin: int, callbacks, mode: str, run_call) -> int:
        """Runs the batches left in `iterator` through `run_call(iterator, count) ->
        (batches run, batch logs)`, with the batch callbacks around each call; returns
        the index of the next batch (the batches seen).

        Batch indices count from `begin`. With a known number of batches no call is
        begun past the end; otherwise, as Keras, the last `on_*_batch_begin` is the one
        that found the data used up.
        """
        per_call = EVAL_STEPS_PER_CALL
        if fit_inputs.has_batch_hooks(callbacks, mode):
            per_call = self._context.steps_per_execution
        known = fit_inputs.num_batches(dataset)
        stop_flag = "stop_evaluating" if mode == "test" else "stop_predicting"
        batch_begin = getattr(callbacks, f"on_{mode}_batch_begin")
        batch_end = getattr(callbacks, f"on_{mode}_batch_end")
        while known is None or begin < known:
            batch_begin(begin)
            ran, logs = run_call(iterator, per_call)
            if ran == 0:
                break
            batch_end(begin + ran - 1, logs)
            begin += ran
            if ran < per_call or getattr(self._context.model, stop_flag, False):
                break
        return begin


def _rows(features) -> int:
    return int(tf.shape(tree.flatten(features)[0])[0])
