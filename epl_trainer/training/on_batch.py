"""EPLTrainer's `train_on_batch`, `test_on_batch` and `predict_on_batch`, as Keras's.

Each runs one batch through the path its loop runs: `train_on_batch` through `fit`'s
training step (the batch split over the lanes and micro-batches, a batch that does not
split evenly filled up with weight-0 rows), `test_on_batch` and `predict_on_batch`
through `evaluate`'s and `predict`'s (inference.py). As in Keras, the metrics
are reset first, so the values returned are this batch's.

Between calls the Keras model holds the weights, as it does in Keras: each call first
copies the model's values into the engine (a `set_weights`, or another trainer that
trained shared layers, as a GAN's generator and discriminator trainers do), and
`train_on_batch` writes the trained values back. A loop of `train_on_batch` therefore
copies the weights twice per step, which `fit` does once per epoch.

With several workers, each worker passes its own batch, as each reads its own data in
`fit`: the step's batch is every input shard's batch together (workers holding stages of
the same replicas form one shard and pass the same batch), the loss is averaged over all
of its rows, and the returned loss and metrics are the global batch's. Every worker calls
the method at the same point, with a batch of at least one row.
"""

from __future__ import annotations

import inspect
import time

import keras
import tensorflow as tf

from epl_trainer.core import engine
from epl_trainer.training import fit_inputs, pipeline_models
from epl_trainer.training import model_fn as model_fn_lib
from epl_trainer.training.context import TrainerContext
from epl_trainer.training.data_feeder import DataFeeder, batch_rows
from epl_trainer.training.engine_runtime import EngineRuntime
from epl_trainer.training.inference import InferenceRunner
from epl_trainer.training.iterators import release
from epl_trainer.training.objectives import Objectives
from epl_trainer.training.progress import TrainingProgress
from epl_trainer.training.step_errors import nonfinite_loss_error, run_checked
from epl_trainer.training.step_stats import StepStats


class OnBatchRunner:
    """Runs the single-batch methods; holds no state of its own (the engine is the
    runtime's, the metrics the objectives', the step's values the step stats').
    """

    def __init__(
        self,
        context: TrainerContext,
        runtime: EngineRuntime,
        objectives: Objectives,
        feeder: DataFeeder,
        inference: InferenceRunner,
        progress: TrainingProgress,
        stats: StepStats,
    ):
        self._context = context
        self._runtime = runtime
        self._objectives = objectives
        self._feeder = feeder
        self._inference = inference
        self._progress = progress
        self._stats = stats

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
        """`EPLTrainer.train_on_batch` (its docstring has the arguments)."""
        _check_one_batch("train_on_batch", x)
        x, sample_weight = fit_inputs.with_class_weight(x, y, sample_weight, class_weight)
        dataset = self._one_batch("train_on_batch", x, y, sample_weight, model_fn_lib.TRAIN)
        self._objectives.require_loss("train_on_batch")
        self._runtime.check_model_unchanged("train_on_batch")
        program = self._runtime.ensure_for(dataset)
        self._objectives.reset()
        self._train_step_on(program, dataset)
        self._runtime.write_back()
        where = self._stats.nonfinite_step(self._progress.epochs_done, None)
        if where is not None:
            raise nonfinite_loss_error(where, self._context.config.communication)
        with self._runtime.watch("the step's metric sync"):
            return self._objectives.returned(self._objectives.logs(), return_dict)

    def test_on_batch(self, x, y=None, sample_weight=None, return_dict=False):
        """`EPLTrainer.test_on_batch` (its docstring has the arguments)."""
        _check_one_batch("test_on_batch", x)
        dataset = self._one_batch("test_on_batch", x, y, sample_weight, model_fn_lib.EVAL)
        self._objectives.require_loss("test_on_batch")
        no_callbacks = fit_inputs.callback_list(None, self._context.model, 0, steps=1)
        logs = self._inference.evaluate_dataset(dataset, no_callbacks)
        return self._objectives.returned(logs, return_dict)

    def predict_on_batch(self, x):
        """`EPLTrainer.predict_on_batch` (its docstring has the arguments)."""
        _check_one_batch("predict_on_batch", x)
        self._runtime.load_from_model()
        self._feeder.plan_from(x, None, None, model_fn_lib.INFER)
        preprocessing = pipeline_models.preprocessing(self._context.model)
        rows = batch_rows("predict_on_batch", x, preprocessing)
        return self._inference.predict(x, batch_size=rows, verbose=0)

    def _one_batch(self, method: str, x, y, sample_weight, mode: str) -> tf.data.Dataset:
        """The batch as a dataset, after the engine took the Keras model's weights."""
        self._runtime.load_from_model()
        return self._feeder.one_batch(method, x, y, sample_weight, mode)

    def _train_step_on(self, program, dataset) -> None:
        """Runs fit's training step on the dataset's one batch; records the step's own
        values (`step_stats`: throughput, AMP's loss scale and skipped steps)."""
        iterator = iter(dataset)
        start = time.perf_counter()
        try:
            with self._runtime.watch():
                end_of_data = self._context.end_of_data
                if end_of_data is None:
                    results = run_checked(program.train_on_iterator, iterator)
                else:  # the global batch's rows, agreed as fit's steps agree on them
                    shards = self._context.engine_plan.data_shards[1]
                    element, rows = end_of_data.next_batch(iterator, 0, shards)
                    spec = dataset.element_spec
                    results = run_checked(program.train_on_element, element, spec, rows)
        finally:  # deleting it can wait for tf.data's autotuning (iterators.py)
            release(iterator)
            del iterator
        elapsed = max(time.perf_counter() - start, 1e-9)
        batch = int(results.pop(engine.BATCH_SIZE_KEY))
        _, stats = self._stats.split(results, self._objectives.log_names())
        stats["samples_per_sec"] = batch * self._context.data_shards / elapsed
        self._stats.record(stats)


def _check_one_batch(method: str, x) -> None:
    """Keras's *_on_batch take arrays: a Dataset or generator holds many batches."""
    many = (tf.data.Dataset, keras.utils.PyDataset)
    if x is None or isinstance(x, many) or inspect.isgenerator(x):
        raise TypeError(
            f"{method} takes one batch: an array or tensor, or a dict, list or tuple of "
            "them; pass a Dataset, generator or PyDataset to fit / evaluate / predict. "
            f"Received: x of type {type(x).__name__}"
        )
