"""EPLTrainer's training data: arrays, Datasets and files as this worker's batches.

`fit`'s data with Keras's meaning (`fit_inputs.py` holds the argument rules): numpy
inputs dealt to the workers in batches, in order or reshuffled every pass (`shuffle`),
with per-sample weights; Datasets sharded across workers as tf.distribute shards them
(io.auto_shard: by files, or by batches); with io.global_batches, every worker's rows of
each global batch instead (the job's batch then outlives a change in its worker count:
elastic.py); files read and sliced by `io.py`; a
KerasHub task's batches mapped through its preprocessor (`pipeline_models.py`). A
model that can be planned only once it has seen data (an Estimator-style model_fn, an
unbuilt Sequential) is built here from the data's element spec.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from epl_trainer.training import data as data_lib
from epl_trainer.training import fit_inputs, model_inputs, pipeline_models
from epl_trainer.training import io as io_lib
from epl_trainer.training import model_fn as model_fn_lib

logger = logging.getLogger(__name__)


class TrainingDataMixin:
    """The data methods of `EPLTrainer` (see trainer.py for the attributes)."""

    @property
    def _waits_for_data(self) -> bool:
        """Whether the model is built (and planned) only from the first data."""
        return self._pending_model_fn is not None or self._pending_model is not None

    def _build_from_data(self, dataset, mode: str) -> None:
        """Builds an Estimator-style model_fn's model, or an unbuilt Sequential, from the
        data's element spec, and plans it (once)."""
        if self._pending_model is not None:
            (spec, arguments), self._pending_model = self._pending_model, None
            with_labels = mode != model_fn_lib.INFER
            features = data_lib.unpack_element(dataset.element_spec, with_labels)[0]
            build_sequential(spec.model, features)
            self._setup(spec, **arguments)
        if self._pending_model_fn is None:
            return
        fn, arguments = self._pending_model_fn
        self._pending_model_fn = None
        spec = model_fn_lib.call_estimator_model_fn(fn, dataset.element_spec, mode, self.params)
        self._setup(spec, **arguments)

    def _fit_dataset(self, x, y, sample_weight, batch_size, shuffle):
        """This worker's training batches, and for shuffled numpy inputs the source of
        each pass's order (`data.ReshuffledArrays`)."""
        preprocessing = pipeline_models.preprocessing(self.model)
        if isinstance(x, tf.data.Dataset):
            if self.config.io.slicing:
                logger.warning(
                    "io.slicing slices files given as fit(files, parse_fn=...); a "
                    "tf.data.Dataset is sharded by io.auto_shard=%r instead.",
                    self.config.io.auto_shard,
                )
            x = data_lib.shard_dataset(
                x,
                self.data_shard,
                self.data_shards,
                auto_shard=self.config.io.auto_shard,
                global_batches=self.config.io.global_batches,
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
        rows = self.config.io.global_batches
        deal = dict(
            worker_index=self.data_shard,
            worker_num=self.data_shards,
            drop_remainder=self.data_shards > 1 and not rows,
            preprocessing=preprocessing,
            deal_rows=rows,
        )
        if not shuffle:
            return data_lib.as_dataset(x, y, batch_size, sample_weight=sample_weight, **deal), None
        seed = self._agreed_shuffle_seed()
        passes = data_lib.ReshuffledArrays(
            x, y, batch_size, sample_weight=sample_weight, seed=seed, mode=shuffle, **deal
        )
        return passes.dataset(self.epochs_done), passes

    def _agreed_shuffle_seed(self) -> int:
        """The job's shuffling seed: drawn once from NumPy's global generator (which
        `keras.utils.set_random_seed` seeds), the chief's on every worker."""
        if self._shuffle_seed is None:
            seed = int(np.random.randint(2**31 - 1))
            if self.cluster.worker_num > 1:
                seed = self._agree([seed, 0])[0][0]
            self._shuffle_seed = seed
        return self._shuffle_seed

    def _validation_dataset(self, validation_data, batch_size, steps):
        """fit's validation batches, built once (Keras caches them too)."""
        validation_data = model_inputs.python_source_dataset(validation_data)
        val_x, val_y, val_weight = fit_inputs.unpack_x_y_sample_weight(validation_data)
        # A dataset is already batched (as in Model.fit); batch_size is for arrays.
        batch_size = None if isinstance(val_x, tf.data.Dataset) else batch_size
        dataset = self._evaluation_dataset(val_x, val_y, val_weight, batch_size, model_fn_lib.EVAL)
        return fit_inputs.at_most(dataset, steps)

    def _files_dataset(self, files, y, batch_size, parse_fn, file_format, steps_per_epoch):
        """This worker's batches from input files (sliced across workers with io.slicing)."""
        if parse_fn is None or y is not None:
            raise ValueError(
                "Training from files needs x = file names or a glob, y=None and a parse_fn "
                f"mapping one record to (features, labels). Received: y={type(y).__name__}, "
                f"parse_fn={parse_fn!r}, file_format={file_format!r}"
            )
        workers = self.cluster.worker_num
        if workers > 1 and steps_per_epoch is None:
            # A worker's share holds an unknown number of records: an epoch bounded by the
            # data would let one worker stop while its peers wait in a collective.
            raise ValueError(
                "Training from files on several workers needs steps_per_epoch (each "
                f"worker's files repeat). Received: steps_per_epoch=None, worker_num={workers}"
            )
        files = io_lib.expand_files(files)
        if self.config.io.slicing:
            files = io_lib.slice_files(
                files,
                worker_index=self.data_shard,
                replicas_per_worker=self.engine_plan.lanes_per_data_shard(),
                unbalanced_io_slicing=self.config.io.unbalanced_io_slicing,
                drop_last_files=self.config.io.drop_last_files,
            )
        dataset = io_lib.files_dataset(
            files,
            parse_fn,
            data_lib.DEFAULT_BATCH_SIZE if batch_size is None else batch_size,
            file_format=file_format or "tfrecord",
            repeat=workers > 1,
        )
        # Batches of parsed records, preprocessed as any batches (pipeline_models.py).
        return data_lib.as_dataset(dataset, preprocessing=pipeline_models.preprocessing(self.model))


def needs_data_to_build(model) -> bool:
    """An unbuilt Sequential: it has no layer graph to plan until it sees its input."""
    return isinstance(model, keras.Sequential) and not model.built


def build_sequential(model, features) -> None:
    """Builds a Sequential for inputs like `features` (batch dimension left open), as
    Keras builds one when its first training function is traced."""
    if tree.is_nested(features):
        raise ValueError(
            "A Sequential model takes one input tensor. Received features "
            f"{tree.map_structure(lambda t: t.shape, features)}"
        )
    model.build((None, *tuple(features.shape)[1:]))
    if getattr(model, "_functional", None) is None:
        raise ValueError(
            f"Sequential model {model.name!r} could not be built from the data's shape "
            f"{tuple(features.shape)}; give its first layer an input shape (keras.Input)."
        )
