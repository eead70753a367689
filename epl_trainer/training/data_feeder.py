"""The trainer's data: `fit`'s, `evaluate`'s and the single batches' inputs as this
worker's batches, fitted to the model.

Data with Keras's meaning (`fit_inputs.py` holds the argument rules): numpy inputs dealt
to the workers in batches, in order or reshuffled every pass (`shuffle`), with
per-sample weights; Datasets sharded across workers as tf.distribute shards them
(io.auto_shard: by files, or by batches); with io.global_batches, every worker's rows of
each global batch instead (the job's batch then outlives a change in its worker count:
elastic.py); files read and sliced by `io.py`; a KerasHub task's batches mapped through
its preprocessor (`pipeline_models.py`). A model that waits for data (model_planning.py)
is planned from the first data's element spec before its batches are made.
"""

from __future__ import annotations

import logging

import numpy as np
import tensorflow as tf
from keras import tree

from epl_trainer.training import data as data_lib
from epl_trainer.training import fit_inputs, model_inputs, pipeline_models
from epl_trainer.training import io as io_lib
from epl_trainer.training import model_fn as model_fn_lib
from epl_trainer.training.context import TrainerContext
from epl_trainer.training.host_agreement import HostAgreement
from epl_trainer.training.model_planning import ModelPlanner
from epl_trainer.training.objectives import Objectives
from epl_trainer.training.progress import TrainingProgress

logger = logging.getLogger(__name__)


class DataFeeder:
    """Draws the job's shuffling seed; turns the user's inputs into batches.

    Args:
      context: the run's settings (config, cluster, model, the plan's data shards).
      planner: plans a model that waits for data from the first data.
      objectives: built from the first batches' shapes.
      progress: numbers the passes over shuffled data (`epochs_done`).
      agreement: agrees on the shuffling seed over workers.
    """

    def __init__(
        self,
        context: TrainerContext,
        planner: ModelPlanner,
        objectives: Objectives,
        progress: TrainingProgress,
        agreement: HostAgreement,
    ):
        self._context = context
        self._planner = planner
        self._objectives = objectives
        self._progress = progress
        self._agreement = agreement

    @property
    def shuffle_seed(self) -> int | None:
        """The job's shuffling seed (None until drawn); kept with the progress, which a
        checkpoint saves and restores."""
        return self._progress.shuffle_seed

    # ---- fit -------------------------------------------------------------------------

    def fit_dataset(self, x, y, sample_weight, batch_size, shuffle):
        """This worker's training batches, and for shuffled numpy inputs the source of
        each pass's order (`data.ReshuffledArrays`)."""
        context = self._context
        config = context.config
        preprocessing = pipeline_models.preprocessing(context.model)
        if isinstance(x, tf.data.Dataset):
            if config.io.slicing:
                logger.warning(
                    "io.slicing slices files given as fit(files, parse_fn=...); a "
                    "tf.data.Dataset is sharded by io.auto_shard=%r instead.",
                    config.io.auto_shard,
                )
            x = data_lib.shard_dataset(
                x,
                context.data_shard,
                context.data_shards,
                auto_shard=config.io.auto_shard,
                global_batches=config.io.global_batches,
            )
            dataset = data_lib.as_dataset(
                x, y, batch_size, sample_weight=sample_weight, preprocessing=preprocessing
            )
            return dataset, None
        if shuffle not in (True, False, "batch"):
            raise ValueError(f'shuffle must be True, False or "batch". Received: {shuffle!r}')
        # A short last batch trains as Keras does (the engine fills it up with weight-0
        # rows). Dealt whole batches to several input shards, it would leave one shard
        # without a batch while its peers have one: dropped there. Dealt in rows
        # (io.global_batches), it is shared as any other.
        rows = config.io.global_batches
        deal = dict(
            worker_index=context.data_shard,
            worker_num=context.data_shards,
            drop_remainder=context.data_shards > 1 and not rows,
            preprocessing=preprocessing,
            deal_rows=rows,
        )
        if not shuffle:
            return data_lib.as_dataset(x, y, batch_size, sample_weight=sample_weight, **deal), None
        passes = data_lib.ReshuffledArrays(
            x, y, batch_size, sample_weight=sample_weight, seed=self.agreed_seed(), mode=shuffle,
            **deal,
        )  # fmt: skip
        return passes.dataset(self._progress.epochs_done), passes

    def agreed_seed(self) -> int:
        """The job's shuffling seed: drawn once from NumPy's global generator (which
        `keras.utils.set_random_seed` seeds), the chief's on every worker."""
        if self.shuffle_seed is None:
            seed = int(np.random.randint(2**31 - 1))
            if self._context.cluster.worker_num > 1:
                seed = self._agreement.gather([seed, 0], "agreeing on the shuffling seed")[0][0]
            self._progress.shuffle_seed = seed
        return self.shuffle_seed

    def files_dataset(self, files, y, batch_size, parse_fn, file_format, steps_per_epoch):
        """This worker's batches from input files (sliced across workers with io.slicing)."""
        if parse_fn is None or y is not None:
            raise ValueError(
                "Training from files needs x = file names or a glob, y=None and a parse_fn "
                f"mapping one record to (features, labels). Received: y={type(y).__name__}, "
                f"parse_fn={parse_fn!r}, file_format={file_format!r}"
            )
        context = self._context
        workers = context.cluster.worker_num
        if workers > 1 and steps_per_epoch is None:
            # A worker's share holds an unknown number of records: an epoch bounded by the
            # data would let one worker stop while its peers wait in a collective.
            raise ValueError(
                "Training from files on several workers needs steps_per_epoch (each "
                f"worker's files repeat). Received: steps_per_epoch=None, worker_num={workers}"
            )
        files = io_lib.expand_files(files)
        io = context.config.io
        if io.slicing:
            files = io_lib.slice_files(
                files,
                worker_index=context.data_shard,
                replicas_per_worker=context.engine_plan.lanes_per_data_shard(),
                unbalanced_io_slicing=io.unbalanced_io_slicing,
                drop_last_files=io.drop_last_files,
            )
        dataset = io_lib.files_dataset(
            files,
            parse_fn,
            data_lib.DEFAULT_BATCH_SIZE if batch_size is None else batch_size,
            file_format=file_format or "tfrecord",
            repeat=workers > 1,
        )
        # Batches of parsed records, preprocessed as any batches (pipeline_models.py).
        preprocessing = pipeline_models.preprocessing(context.model)
        return data_lib.as_dataset(dataset, preprocessing=preprocessing)

    def validation_dataset(self, validation_data, batch_size, steps):
        """fit's validation batches, built once (Keras caches them too)."""
        validation_data = model_inputs.python_source_dataset(validation_data)
        val_x, val_y, val_weight = fit_inputs.unpack_x_y_sample_weight(validation_data)
        # A dataset is already batched (as in Model.fit); batch_size is for arrays.
        batch_size = None if isinstance(val_x, tf.data.Dataset) else batch_size
        dataset = self.evaluation_dataset(val_x, val_y, val_weight, batch_size, model_fn_lib.EVAL)
        return fit_inputs.at_most(dataset, steps)

    # ---- evaluate, predict and single batches ------------------------------------------

    def evaluation_dataset(self, x, y, sample_weight, batch_size, mode):
        """This worker's evaluation batches (the model planned from them first if needed)."""
        x = self.arrays_for_model(x, y, sample_weight, mode)
        context = self._context
        # Arrays are dealt in rows of each global batch, as fit's with io.global_batches:
        # every row is evaluated once and every worker runs as many batches, a short last
        # one included. (Dealt in whole batches, those that could not go to every worker
        # were skipped: the logs left rows out, or, with fewer batches than workers,
        # reported a loss of 0 from no rows at all.) `batch_size` is per worker, the
        # global batch with io.global_batches, as fit's.
        rows = context.data_shards > 1 and not isinstance(x, tf.data.Dataset)
        if rows and not context.config.io.global_batches:
            batch_size = data_lib.checked_batch_size(batch_size) * context.data_shards
        dataset = data_lib.as_dataset(
            x,
            y,
            batch_size,
            sample_weight=sample_weight,
            worker_index=context.data_shard,
            worker_num=context.data_shards,
            preprocessing=pipeline_models.preprocessing(context.model),
            deal_rows=rows,
        )
        return self.labelled_for_model(dataset)

    def arrays_for_model(self, x, y, sample_weight, mode):
        """`x` as the model takes it; a model that waits for data is planned from it first."""
        x = model_inputs.python_source_dataset(x)
        self.plan_from(x, y, sample_weight, mode)
        return model_inputs.arrays_for_model(self._context.model, x)

    def plan_from(self, x, y, sample_weight, mode, parse_fn=None, file_format=None) -> None:
        """Plans a model that waits for data from the element spec of `x` (a probe)."""
        if self._planner.waits_for_data:
            probe = data_lib.spec_probe(x, y, parse_fn, file_format, sample_weight)
            self._planner.build_from_data(probe, mode)

    def labelled_for_model(self, dataset):
        """Batches of `(x, y[, sample_weight])` fitted to the model's inputs, with the loss
        and metrics built from their shapes (at the first data)."""
        dataset = model_inputs.fitted_to_model(dataset, self._context.model, with_labels=True)
        self._objectives.build(dataset.element_spec)
        return dataset

    def prediction_dataset(self, x, batch_size, steps):
        """Batches of features for `predict` (labels in a Dataset are dropped, after a
        KerasHub task's preprocessor, which may make its own)."""
        x = model_inputs.python_source_dataset(x)
        self.plan_from(x, None, None, model_fn_lib.INFER)
        model = self._context.model
        x = model_inputs.arrays_for_model(model, x)
        preprocessing = pipeline_models.preprocessing(model)
        if preprocessing is None and isinstance(x, tf.data.Dataset):
            x = data_lib.features_only(x)
        dataset = data_lib.as_dataset(x, None, batch_size, preprocessing=preprocessing)
        if preprocessing is not None:
            # As Keras: a batch (with its labels, if any) is preprocessed first, then its
            # features are predicted (a causal LM's preprocessor makes labels itself).
            dataset = data_lib.features_only(dataset)
        dataset = fit_inputs.at_most(dataset, steps)
        return model_inputs.fitted_to_model(dataset, model, with_labels=False)

    def one_batch(self, method: str, x, y, sample_weight, mode: str) -> tf.data.Dataset:
        """`x, y, sample_weight` as a dataset of one batch, this worker's (not dealt to
        the workers as `evaluate`'s arrays are), for the *_on_batch `method`."""
        x = self.arrays_for_model(x, y, sample_weight, mode)
        preprocessing = pipeline_models.preprocessing(self._context.model)
        dataset = data_lib.as_dataset(
            x,
            y,
            batch_rows(method, x, preprocessing),
            sample_weight=sample_weight,
            preprocessing=preprocessing,
        )
        return self.labelled_for_model(dataset)


def batch_rows(method: str, x, preprocessing) -> int:
    """The rows of the batch `x` (a preprocessed model's raw samples: a list of strings
    is one array of them)."""
    arrays = x if preprocessing is None else preprocessing.raw_arrays(x)
    leaves = tree.flatten(arrays)
    shape = np.shape(leaves[0]) if leaves else ()
    if not shape or shape[0] == 0:
        raise ValueError(
            f"{method} needs a batch of at least one sample, with a batch dimension. "
            f"Received: x whose first array has shape {shape}"
        )
    return int(shape[0])
