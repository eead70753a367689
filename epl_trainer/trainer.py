"""EPLTrainer: fit / evaluate / predict / checkpoints for an ordinary Keras model.

The trainer is glue: it resolves the config, annotations and plan, cuts the model
into stages, creates the engine state and program, and runs the loop with standard
Keras callbacks. The numerics live in `core/`.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from epl_trainer import checkpoint as ckpt
from epl_trainer import data as data_lib
from epl_trainer import deepspeed, optimizers
from epl_trainer import io as io_lib
from epl_trainer import model_fn as model_fn_lib
from epl_trainer.annotations import checkpoints, strategies
from epl_trainer.cluster import build_cluster, detect_lost_workers
from epl_trainer.config import Config
from epl_trainer.core import comm
from epl_trainer.core.engine import amp
from epl_trainer.core.engine import split as split_lib
from epl_trainer.core.engine.builder import build_engine
from epl_trainer.core.engine.gradient_check import check_stage_gradients
from epl_trainer.core.engine.program import BATCH_SIZE_KEY, BATCH_SPLIT_ERROR, Program
from epl_trainer.core.engine.state import EngineState, lanes_for_worker
from epl_trainer.core.graph.auto_partition import auto_partition
from epl_trainer.core.graph.partition import partition_model, whole_model
from epl_trainer.core.plan import planner
from epl_trainer.end_of_data import EndOfDataAgreement
from epl_trainer.env import Env
from epl_trainer.losses import CompiledLoss
from epl_trainer.memory import build_report
from epl_trainer.metrics import resolve_metrics
from epl_trainer.model_fn import ModelSpec  # noqa: F401  (re-exported: epl.ModelSpec)
from epl_trainer.watchdog import watchdog_for

logger = logging.getLogger(__name__)


class NonFiniteLossError(FloatingPointError):
    """A float32 training step produced a NaN or Inf loss (non-finite gradients)."""


class EPLTrainer:
    """Trains a Keras model with the parallelism given by annotations and config.

    Args:
      model: a Keras model, or a `model_fn` returning one (or a `ModelSpec`). A model_fn
        is called after the config is resolved, so `epl.replicate`/`epl.split` scopes
        inside it are recorded. EPL's Estimator-style `model_fn(features, labels, mode,
        params)` is called at the first fit / evaluate / predict with symbolic inputs
        made from that data's element spec (mode "train", "eval" or "infer"); it returns
        output tensors, a model or a `ModelSpec`. The trainer's `model`, `plan` and
        `staged` exist from then on. A model that went through `model.compile(...)` brings
        its optimizer, loss, loss_weights and metrics: each is used unless the
        same argument is passed here (passed arguments win).
      loss: a Keras loss (object, name or function; list/dict for several outputs).
      optimizer: a Keras optimizer or its name. It stays the "master": its learning rate
        (settable by callbacks) drives every replica's copy. Default: the compiled
        model's optimizer, else SGD.
      metrics: Keras metrics or names ("accuracy" is resolved from the loss, as compile).
      loss_weights: scales each output's loss (a list or dict, as `Model.compile`).
      params: passed to an Estimator-style model_fn as its `params`.
      strategy: `epl.Strategy(...)`, or a bare `epl.replicate(n)` / `epl.split(n)`.
      stages: {layer-name regex: stage index}, a shortcut for `Strategy(stages=...)`.
      split: [layer-name regex], a shortcut for `Strategy(split=...)`.
      config: an `epl.Config`, a dict of dotted keys or a JSON/YAML path; None uses the
        config given to `epl.init()` (or the defaults). A DeepSpeed config (JSON path,
        dict or `epl_trainer.deepspeed.DeepSpeedConfig`) is translated on top of
        `epl.init()`'s config, and its optimizer/scheduler replace `optimizer`.
    """

    def __init__(
        self,
        model,
        loss=None,
        optimizer=None,
        metrics=None,
        strategy=None,
        stages=None,
        split=None,
        config=None,
        loss_weights=None,
        params=None,
    ):
        if optimizer is None and isinstance(model, keras.Model):
            optimizer = compiled_settings(model).get("optimizer")
        self._optimizer_given = optimizer is not None
        config, optimizer, self.deepspeed = deepspeed.trainer_setup(config, optimizer or "sgd")
        self.config = Env.get().config if config is None else Config.load(config)
        self.cluster = Env.get().cluster if config is None else build_cluster(self.config.cluster)
        self.optimizer = keras.optimizers.get(optimizer)
        self.params = params
        self._program: Program | None = None
        self._state: EngineState | None = None
        self.epochs_done = 0
        self._metric_sync = None
        # Where training stands inside the epoch in progress, for checkpoints: steps run in
        # it, and the batches taken from the current pass of the data (EpochBatches).
        self._step_in_epoch = 0
        self._batches: data_lib.EpochBatches | None = None
        self._resume_position = (0, 0)  # (step_in_epoch, input position) of a restore
        self._nonfinite_seen = 0
        multi_worker = self.cluster.worker_num > 1
        self._end_of_data = EndOfDataAgreement(self.cluster) if multi_worker else None
        arguments = dict(
            loss=loss,
            metrics=metrics,
            loss_weights=loss_weights,
            strategy=strategy,
            stages=stages,
            split=split,
        )
        if model_fn_lib.is_estimator_model_fn(model):
            # Built from the first dataset's element spec (`_build_from_data`).
            self._pending_model_fn = (model, arguments)
            return
        self._pending_model_fn = None
        spec = model_fn_lib.ModelSpec(model) if isinstance(model, keras.Model) else None
        if spec is None:
            if not callable(model):
                raise TypeError(
                    f"model must be a keras.Model or a model_fn. Received: {type(model).__name__}"
                )
            spec = model_fn_lib.call_model_fn(model)
        self._setup(spec, **arguments)

    def _setup(self, spec, loss, metrics, loss_weights, strategy, stages, split) -> None:
        """Takes the model and cuts and plans it (from __init__, or at the first data)."""
        model = spec.model
        compiled = compiled_settings(model)
        loss = _first(loss, spec.loss, compiled.get("loss"))
        metrics = _first(metrics, spec.metrics, compiled.get("metrics"))
        loss_weights = _first(loss_weights, spec.loss_weights, compiled.get("loss_weights"))
        if not self._optimizer_given and self.deepspeed is None:
            chosen = _first(spec.optimizer, compiled.get("optimizer"))
            if chosen is not None:
                self.optimizer = keras.optimizers.get(chosen)
        self.model = model
        self.loss = CompiledLoss(loss, _output_names(model), loss_weights)
        self.metrics = resolve_metrics(metrics, self.loss.name(), _output_names(model))
        self.loss_tracker = keras.metrics.Mean(name="loss")
        _check_supported(self.config)
        annotation, auto = _annotate(model, self.config, strategy, stages, split)
        self.plan = planner.build_plan(
            annotation.taskgraphs,
            self.cluster.devices_by_worker,
            self.cluster.worker_index,
            num_micro_batch=self.config.pipeline.num_micro_batch,
            colocate_split_and_replicate=self.config.cluster.colocate_split_and_replicate,
            prefer_intra_node=self.config.cluster.device_place_prefer_intra_node,
            pipeline_strategy=self.config.pipeline.strategy,
            stage_costs=auto.stage_costs if auto else None,
            cut_description=auto.cut_description if auto else None,
        )
        has_split = any(tg.kind == "split" for tg in self.plan.taskgraphs)
        self.lanes = lanes_for_worker(self.plan, self.cluster.worker_index)
        self.split_layers = []
        if has_split:
            # Colocated TaskGraphs share every device of a lane: one stage, whose split
            # layers run on the lane's shards (core/split.py).
            self.staged = whole_model(model)
            self.split_layers = split_lib.find_split_layers(
                model, annotation, self.plan.taskgraphs, self.plan.taskgraphs[0].device_count
            )
            outputs = len(tree.flatten(model.outputs))
            split_lib.sparse_outputs(self.loss.losses_for(outputs), self.split_layers)
            split_lib.check_split_metrics(self.metrics, self.split_layers)
        elif len(self.plan.taskgraphs) == 1:
            self.staged = whole_model(model)
        else:
            self.staged = partition_model(
                model, annotation.node_taskgraph, len(self.plan.taskgraphs)
            )
        self.lanes_in_job = sorted(
            (
                lane
                for w in range(self.cluster.worker_num)
                for lane in lanes_for_worker(self.plan, w)
            ),
            key=lambda lane: lane.index,
        )
        if self.deepspeed is not None:  # accumulation steps may follow from the lane count
            self.config, self.plan = self.deepspeed.resolve_plan(
                self.config, self.plan, len(self.lanes_in_job)
            )
        self.model.optimizer = self.optimizer  # what Keras callbacks read (LR, iterations)

    def _build_from_data(self, dataset, mode: str) -> None:
        """Builds an Estimator-style model_fn's model from the data's element spec (once)."""
        if self._pending_model_fn is None:
            return
        fn, arguments = self._pending_model_fn
        self._pending_model_fn = None
        spec = model_fn_lib.call_estimator_model_fn(fn, dataset.element_spec, mode, self.params)
        self._setup(spec, **arguments)

    # ---- building the engine (lazily: a subclassed model is built by its first batch) ----

    def _ensure_program_for(self, dataset) -> Program:
        """Builds the program; an unbuilt (subclassed) model is first called on one batch."""
        needs_batch = not self.model.built or self.config.gradient_checkpoint.check_gradients
        if self._program is None and needs_batch:
            element = next(iter(dataset.take(1)))
            return self._ensure_program(data_lib.split_element(element, with_labels=False)[0])
        return self._ensure_program(None)

    def _ensure_program(self, features) -> Program:
        if self._program is not None:
            return self._program
        if not self.model.built:
            self.model(tree.map_structure(lambda x: x[:1], features))
        if self.config.amp.level:  # compute in low precision, float32 weights cast on use
            changed = amp.apply_mixed_precision(self.model, self.config.amp.dtype)
            if self.config.amp.debug_log:
                logger.info(
                    "AMP %s: %d layers compute in %s: %s",
                    self.config.amp.level,
                    len(changed),
                    self.config.amp.dtype,
                    changed,
                )
        with tf.device(self.cluster.host_device):
            self.loss_tracker.reset_state()
        self._state, self._program = build_engine(
            self.staged,
            self.lanes,
            self.lanes_in_job,
            self.config,
            self.cluster.host_device,
            self.loss,
            self.metrics,
            self.loss_tracker,
            self._replica_optimizer,
            clip_global_norm=self.optimizer.global_clipnorm,
            step_counter=self.optimizer.iterations,
            split_layers=self.split_layers,
            split_width=self.plan.taskgraphs[0].device_count if self.split_layers else 1,
            checkpoint_marks=checkpoints.get_collection(),
        )
        if self.config.gradient_checkpoint.check_gradients and self._program.recomputed:
            self._check_recompute_gradients(features)
        return self._program

    def _check_recompute_gradients(self, features) -> None:
        """gradient_checkpoint.check_gradients: compare recomputed and plain gradients once."""
        if features is None:
            raise ValueError("gradient_checkpoint.check_gradients needs a batch to compare on.")
        parts = len(self.lanes) * self.config.pipeline.num_micro_batch
        micro_batch = tree.map_structure(lambda x: x[: max(1, x.shape[0] // parts)], features)
        check_stage_gradients(self.staged, self._program.recomputed, micro_batch)

    def _replica_optimizer(self, device: str, variables: list, originals: list):
        """A copy of the user's optimizer for engine-owned copies of `originals`, on `device`."""
        with tf.device(device):
            # Global-norm clipping is done over all stages by the program.
            replica = optimizers.replica(self.optimizer, variables, originals, global_clipnorm=None)
            if isinstance(self.optimizer._learning_rate, keras.Variable):
                replica._learning_rate = self.optimizer._learning_rate  # LR callbacks reach all
            replica.build(variables)
        return replica

    # ---- fit / evaluate / predict ------------------------------------------------------

    def fit(
        self,
        x,
        y=None,
        batch_size=None,
        epochs=1,
        steps_per_epoch=None,
        validation_data=None,
        callbacks=None,
        verbose="auto",
        parse_fn=None,
        file_format=None,
    ):
        """Trains; returns a `keras.callbacks.History` (as `Model.fit`).

        With `parse_fn`, `x` is a list of file names or a glob: records are read with
        `file_format` ("tfrecord" by default, "text", or a callable `files -> Dataset`),
        parsed by `parse_fn(record) -> (features, labels)` and batched by `batch_size`
        per worker. With `io.slicing=True` each worker reads only its share of the files
        (`epl_trainer.io`).
        """
        if self._pending_model_fn is not None:
            self._build_from_data(_spec_probe(x, y, parse_fn, file_format), model_fn_lib.TRAIN)
        if self.deepspeed is not None:  # batch sizes, monitors and steps_per_print
            batch_size = self.deepspeed.fit_batch_size(x, batch_size, self.plan, len(self.lanes))
            extra = self.deepspeed.callbacks(self.loss_tracker, self.cluster.is_chief)
            callbacks = [*(callbacks or []), *extra]
        if parse_fn is not None or file_format is not None:
            dataset = self._files_dataset(x, y, batch_size, parse_fn, file_format, steps_per_epoch)
        else:
            if self.config.io.slicing and isinstance(x, tf.data.Dataset):
                logger.warning(
                    "io.slicing slices files given as fit(files, parse_fn=...); a "
                    "tf.data.Dataset is used as given (shard it with epl.io.slice_files)."
                )
            dataset = data_lib.as_dataset(
                x,
                y,
                batch_size,
                worker_index=self.cluster.worker_index,
                worker_num=self.cluster.worker_num,
                drop_remainder=True,
            )
        data_lib.check_element_spec(dataset.element_spec, self.model, with_labels=True)
        verbose = 1 if verbose == "auto" else verbose
        # A fresh trainer with checkpoint.dir resumes its newest checkpoint; `epochs` then
        # counts from the job's first epoch (Keras's initial_epoch), so a restarted script
        # finishes the run it was doing instead of adding epochs.
        resumed = self._auto_resume(dataset)
        last_epoch = epochs if resumed else self.epochs_done + epochs
        callback_list = keras.callbacks.CallbackList(
            callbacks,
            add_history=True,
            add_progbar=verbose != 0,
            model=self.model,
            verbose=verbose,
            epochs=last_epoch,
            steps=steps_per_epoch,
        )
        write_back_each_step = _needs_fresh_weights_per_step(callback_list)
        self.model.stop_training = False
        callback_list.on_train_begin()
        first_step, position = self._resume_position
        self._resume_position = (0, 0)
        self._batches = batches = data_lib.EpochBatches(dataset, steps_per_epoch, position)
        logs = {}
        try:
            for epoch in range(self.epochs_done, last_epoch):
                self._reset_metrics()
                callback_list.on_epoch_begin(epoch)
                logs = self._run_epoch(batches, callback_list, write_back_each_step, first_step)
                first_step = 0
                if validation_data is not None:
                    val_x, val_y = _unpack_validation(validation_data)
                    # A dataset is already batched (as in Model.fit); batch_size is for arrays.
                    val_batch = None if isinstance(val_x, tf.data.Dataset) else batch_size
                    val_logs = self.evaluate(val_x, val_y, batch_size=val_batch)
                    logs.update({f"val_{k}": v for k, v in val_logs.items()})
                self.epochs_done = epoch + 1
                self._step_in_epoch = 0
                self._state.write_back()
                if self.config.checkpoint.dir:
                    self._save_periodic()
                callback_list.on_epoch_end(epoch, logs)
                if self.model.stop_training:
                    break
        finally:
            self._batches = None
        if self._state is not None:
            self._state.write_back()
        callback_list.on_train_end(logs)
        if self._state is not None:
            self._state.load_from_model()  # e.g. EarlyStopping(restore_best_weights=True)
        return self.model.history

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
                worker_index=self.cluster.worker_index,
                replicas_per_worker=[len(lanes_for_worker(self.plan, w)) for w in range(workers)],
                unbalanced_io_slicing=self.config.io.unbalanced_io_slicing,
                drop_last_files=self.config.io.drop_last_files,
            )
        return io_lib.files_dataset(
            files,
            parse_fn,
            data_lib.DEFAULT_BATCH_SIZE if batch_size is None else batch_size,
            file_format=file_format or "tfrecord",
            repeat=workers > 1,
        )

    def _run_epoch(self, batches, callback_list, write_back_each_step, first_step=0) -> dict:
        program = self._ensure_program_for(batches.dataset)
        logs = {}

        def step(index, iterator):
            nonlocal logs
            callback_list.on_train_batch_begin(index)
            start = time.perf_counter()
            with self._lost_worker_check():
                if self._end_of_data is None:
                    results = _run_checked(program.train_on_iterator, iterator)
                else:  # raises StopIteration on every worker once any ran out
                    element = self._end_of_data.next_batch(iterator, index)
                    results = _run_checked(program.train_on_element, element)
            batch = int(results.pop(BATCH_SIZE_KEY))
            logs = {name: float(value) for name, value in results.items()}
            self._check_finite(logs, index)
            elapsed = time.perf_counter() - start
            logs["samples_per_sec"] = batch * self.cluster.worker_num / max(elapsed, 1e-9)
            if write_back_each_step:
                self._state.write_back()
            callback_list.on_train_batch_end(index, logs)
            return self.model.stop_training

        def after_step(index):
            self._step_in_epoch = index + 1
            every = self.config.checkpoint.save_steps
            step = int(self.optimizer.iterations.numpy())
            if self.config.checkpoint.dir and every and step % every == 0:
                self._save_periodic()

        # A resumed epoch may have no step left (killed between its last step's
        # checkpoint and the epoch-end one).
        if batches.run_epoch(step, first_step, after_step) == 0 and first_step == 0:
            raise ValueError(
                "The training data yielded no batch. Check the dataset, batch_size "
                "and steps_per_epoch."
            )
        # Epoch logs: metrics reduced over all workers, plus the last step's other values
        # (throughput, AMP loss scale and skipped steps).
        with self._lost_worker_check("the epoch's metric sync"):
            metric_logs = self._logs()
        return {**metric_logs, **{k: v for k, v in logs.items() if k not in metric_logs}}

    def evaluate(self, x, y=None, batch_size=None, steps=None) -> dict:
        """Returns {"loss": ..., metric name: ...} over the data (every worker's share)."""
        dataset = data_lib.as_dataset(
            x,
            y,
            batch_size,
            worker_index=self.cluster.worker_index,
            worker_num=self.cluster.worker_num,
        )
        self._build_from_data(dataset, model_fn_lib.EVAL)
        data_lib.check_element_spec(dataset.element_spec, self.model, with_labels=True)
        self._reset_metrics()
        if steps is not None:
            dataset = dataset.take(steps)
        batches = 0
        for element in dataset:
            features, labels = data_lib.split_element(element, with_labels=True)
            program = self._ensure_program(features)
            with self._lost_worker_check("an evaluation step"):
                program.eval_step(features, labels)
            batches += 1
        with self._lost_worker_check("the evaluation's metric sync"):
            logs = self._logs()
        if batches == 0 and self.cluster.worker_num == 1:
            # Keras's Mean reports 0 for no samples: a silent, wrong "perfect" loss.
            raise ValueError(
                "evaluate received no data. Check the dataset, batch_size and steps. "
                f"Received: steps={steps}"
            )
        return logs

    def predict(self, x, batch_size=None):
        """Model outputs for `x` (numpy, structured like the model's outputs)."""
        dataset = data_lib.as_dataset(x, None, batch_size)
        self._build_from_data(dataset, model_fn_lib.INFER)
        data_lib.check_element_spec(dataset.element_spec, self.model, with_labels=False)
        outputs = []
        for element in dataset:
            features, _ = data_lib.split_element(element, with_labels=False)
            outputs.append(self._ensure_program(features).predict_step(features))
        if not outputs:
            raise ValueError("predict received no data.")
        return tree.map_structure(lambda *xs: np.concatenate([np.asarray(a) for a in xs]), *outputs)

    def memory_report(self, print_table: bool = True):
        """Bytes of parameters, gradients and optimizer state per device (engine state).

        Returns an `epl_trainer.memory.MemoryReport` (index it by device name); prints
        it as a table unless `print_table=False`.
        """
        if self._program is None:
            raise ValueError("memory_report() needs the engine: call fit() or restore first.")
        report = build_report(self._state, self._program.update, self.lanes)
        if print_table:
            print(report)
        return report

    # ---- checkpoints -----------------------------------------------------------------

    def save_checkpoint(self, directory: str, keep_max: int | None = None) -> str | None:
        """Saves engine state (weights, optimizer slots, loss scale, step, input position).

        Only worker 0 writes; the `keep_max` newest checkpoints are kept (all if None).
        """
        if self._state is None:
            raise ValueError("Nothing to save yet: call fit() (or restore) first.")
        if self.config.zero.level and self.cluster.worker_num > 1:
            # Each worker holds only its replicas' optimizer shards; worker 0 alone
            # cannot write them all.
            raise NotImplementedError(
                "save_checkpoint with zero.level across several workers is not implemented "
                f"yet. Received: zero.level={self.config.zero.level!r}, "
                f"worker_num={self.cluster.worker_num}"
            )
        step = int(self.optimizer.iterations.numpy())
        if not self.cluster.is_chief:
            return None
        if self._state.sharded:
            self._state.write_back()  # sharded variables are saved from the Keras model
        metadata = {
            "epochs_done": self.epochs_done,
            # Inside fit: the position in the epoch in progress and in its data pass.
            "step_in_epoch": self._step_in_epoch,
            "input_position": 0 if self._batches is None else self._batches.position,
            "plan": self.plan.summary(),
        }
        variables, names = self._checkpoint_variables()
        return ckpt.save(directory, variables, metadata, step, names, keep_max)

    def restore_checkpoint(self, directory: str, features=None) -> str:
        """Restores the newest checkpoint in `directory` into every lane.

        A trainer that has not trained yet needs the model built (functional models are);
        for subclassed models, and for an Estimator-style model_fn, pass one batch of
        `features` to build it.
        """
        if self._pending_model_fn is not None:
            if features is None:
                raise ValueError(
                    "restore_checkpoint before the first fit needs `features` (one batch) to "
                    "build the Estimator-style model_fn's model."
                )
            element = tf.data.Dataset.from_tensors(features)
            self._build_from_data(element, model_fn_lib.TRAIN)
        if self._program is None:
            if features is None and not self.model.built:
                raise ValueError(
                    "restore_checkpoint on a subclassed model that was never called needs "
                    "`features` (one batch) to build it."
                )
            self._ensure_program(features)
        path = ckpt.latest(directory)
        expected, names = self._checkpoint_variables()
        values, metadata = ckpt.load(path, expected, names)
        for key, variable in expected.items():
            variable.assign(values[key])
        self._copy_lane0_to_all()
        self.epochs_done = metadata.get("epochs_done", 0)
        self._step_in_epoch = metadata.get("step_in_epoch", 0)
        self._resume_position = (self._step_in_epoch, metadata.get("input_position", 0))
        self._state.write_back()
        return path

    def _auto_resume(self, dataset) -> bool:
        """checkpoint.dir: a trainer that has not run yet restores the newest checkpoint.

        A damaged newest checkpoint stops here with its CheckpointError rather than
        training from scratch and overwriting the folder's history.
        """
        directory = self.config.checkpoint.dir
        if not directory or self._state is not None or not ckpt.exists(directory):
            return False
        self._ensure_program_for(dataset)
        path = self.restore_checkpoint(directory)
        logger.info(
            "Resumed from %s: epoch %d, step %d of it.", path, self.epochs_done, self._step_in_epoch
        )
        return True

    def _save_periodic(self) -> None:
        self.save_checkpoint(self.config.checkpoint.dir, keep_max=self.config.checkpoint.keep_max)

    @contextlib.contextmanager
    def _lost_worker_check(self, what: str = "a training step"):
        """Bounds the collectives inside the block and names a lost peer if one failed."""
        timeout = self.config.communication.timeout_seconds
        watchdog = watchdog_for(self.cluster, timeout)
        with detect_lost_workers(self.cluster, timeout), watchdog.watch(what):
            yield

    def _check_finite(self, logs: dict, index: int) -> None:
        """Stops (or warns, optimizer.nonfinite_loss="skip") after a skipped non-finite step."""
        count = int(logs.get("nonfinite_steps", 0))
        if count <= self._nonfinite_seen:
            return
        self._nonfinite_seen = count
        step = int(self.optimizer.iterations.numpy())
        where = f"training step {step} (epoch {self.epochs_done + 1}, batch {index})"
        if self.config.optimizer.nonfinite_loss == "skip":
            logger.warning("Non-finite loss at %s: the step was skipped.", where)
            return
        raise NonFiniteLossError(
            f"The loss or its gradients are not finite (NaN or Inf) at {where}. The step was "
            "not applied: weights and optimizer state are those before it. Look for the "
            "source (learning rate, input data, a log of zero), or set "
            "optimizer.nonfinite_loss='skip' to skip such steps."
        )

    def _checkpoint_variables(self) -> tuple[dict, dict]:
        """Lane 0's state under positional keys, and readable names for those keys."""
        state = self._state
        named, names = {}, {}

        def add(key, variable, description):
            named[key] = variable
            names[key] = description

        for i, v in enumerate(state.model_trainable):
            # Sharded variables (split layers) are saved whole, from the Keras model.
            source = v if i in state.sharded else state.trainable[0][i]
            add(f"trainable/{i}", source.value, v.path)
        for i, v in enumerate(state.model_non_trainable):
            add(f"non_trainable/{i}", state.non_trainable[0][i].value, v.path)
        for key, v in self._program.update.checkpoint_variables().items():
            if v is not self.optimizer._learning_rate:
                # The loss scaler's state is plain tf.Variables, not Keras variables.
                if isinstance(v, keras.Variable):
                    add(key, v.value, f"{key} ({v.path})")
                else:
                    add(key, v, f"{key} ({v.name})")
        add("optimizer/iterations", self.optimizer.iterations.value, "optimizer iterations")
        if isinstance(self.optimizer._learning_rate, keras.Variable):
            add("optimizer/learning_rate", self.optimizer._learning_rate.value, "learning rate")
        return named, names

    def _copy_lane0_to_all(self) -> None:
        state = self._state
        for li in range(1, len(state.lanes)):
            for dst, src in zip(
                state.trainable[li] + state.non_trainable[li],
                state.trainable[0] + state.non_trainable[0],
            ):
                if dst is not src and "seed_generator_state" not in src.path:
                    dst.assign(src.value)
        state.load_sharded_from_model()  # each lane's own slice, over the copy above
        self._program.update.after_restore()

    # ---- logs and checks ---------------------------------------------------------------

    def _reset_metrics(self) -> None:
        self.loss_tracker.reset_state()
        for _, metric in self.metrics:
            metric.reset_state()

    def _logs(self) -> dict:
        metrics = [self.loss_tracker] + [m for _, m in self.metrics]
        if self.cluster.worker_num > 1:
            return self._synced_logs(metrics)
        return {m.name: float(m.result()) for m in metrics}

    def _synced_logs(self, metrics) -> dict:
        """Metric results over all workers: their state variables are summed first."""
        if self._metric_sync is None:
            hosts = tuple(
                devices[0].rsplit("/device:", 1)[0] + "/device:CPU:0"
                for devices in self.cluster.devices_by_worker
            )
            group = comm.CollectiveGroup(hosts, (self.cluster.host_device,))
            variables = [v for m in metrics for v in m.variables]
            buckets = comm.plan_buckets([1] * len(variables), [v.dtype for v in variables], 1)
            # Create the ordering token now: a variable created inside the trace makes
            # tf.function trace twice, and the second trace would take another instance
            # key on this worker only (e.g. one that got no evaluation data and built no
            # program), so the workers' keys would no longer meet.
            comm.ordering_token(self.cluster.host_device)

            @tf.function
            def reduce_all():
                with tf.device(self.cluster.host_device):
                    values = [tf.identity(v.value) for v in variables]
                return comm.fused_all_reduce(group, [values], buckets, "sum")[0]

            self._metric_sync = reduce_all
        reduced = iter(self._metric_sync())
        logs = {}
        for m in metrics:
            values = [next(reduced) for _ in m.variables]
            logs[m.name] = float(m.stateless_result(values))
        return logs


def _run_checked(step_fn, *args):
    """Runs a step; the in-graph batch-split assertion becomes the ValueError it stands for."""
    try:
        return step_fn(*args)
    except tf.errors.InvalidArgumentError as e:
        if (error := amp.min_scale_error(e)) is not None:
            raise error from None
        found = re.search(rf"\[({re.escape(BATCH_SPLIT_ERROR)}.*?)\] \[(\d+)\]", e.message)
        if found:
            raise ValueError(found.group(1) + found.group(2)) from None
        raise


def _annotate(model, config: Config, strategy, stages, split):
    """The model's TaskGraphs: from annotations, or cut automatically (auto.auto_parallel).

    Returns (annotation, AutoPartition or None).
    """
    if not config.auto.auto_parallel:
        annotation = strategies.resolve_annotation(
            model, strategy=strategy, stages=stages, split=split
        )
        return annotation, None
    num_stages = config.pipeline.num_stages
    if num_stages is None:
        raise ValueError(
            "auto.auto_parallel=True needs pipeline.num_stages (how many stages to cut). "
            "Received: pipeline.num_stages=None"
        )
    given = {"strategy": strategy, "stages": stages, "split": split}
    given = {k: v for k, v in given.items() if v is not None}
    scoped = strategies.resolve_annotation(model).source == "scopes"
    if given or scoped:
        raise ValueError(
            "auto.auto_parallel=True cuts the model itself; do not also annotate it. Received: "
            + (", ".join(f"{k}={v!r}" for k, v in given.items()) or "replicate/split scopes")
        )
    auto = auto_partition(model, num_stages)
    logger.info("Automatic pipeline partition:\n%s", auto.describe())
    annotation = strategies.ModelAnnotation(auto.taskgraph_specs(), auto.node_stage, source="auto")
    return annotation, auto


def _spec_probe(x, y, parse_fn, file_format) -> tf.data.Dataset:
    """A dataset with the element spec of fit's data, for building a model_fn's model."""
    if parse_fn is not None or file_format is not None:
        raise ValueError(
            "An Estimator-style model_fn is built from the data's element spec; with "
            "fit(files, parse_fn=...) call trainer.evaluate or fit on a tf.data.Dataset "
            "of the parsed records first."
        )
    return x if isinstance(x, tf.data.Dataset) else data_lib.as_dataset(x, y, batch_size=1)


def _first(*values):
    """The first value that is not None (passed arguments, then model_fn, then compile)."""
    return next((v for v in values if v is not None), None)


def compiled_settings(model: keras.Model) -> dict:
    """What `model.compile(...)` was given: optimizer, loss, loss_weights, metrics.

    Empty for a model that was never compiled. Keras keeps the arguments as given in
    `_compile_config` (what `get_compile_config` serialises); `optimizer` and `loss`
    are also public attributes, used when that record is missing.
    """
    if not getattr(model, "compiled", False):
        return {}
    record = getattr(getattr(model, "_compile_config", None), "config", None) or {}
    settings = {
        "optimizer": record.get("optimizer", getattr(model, "optimizer", None)),
        "loss": record.get("loss", getattr(model, "loss", None)),
        "loss_weights": record.get("loss_weights"),
        "metrics": record.get("metrics"),
    }
    if record.get("weighted_metrics"):
        raise ValueError(
            "The model was compiled with weighted_metrics, which EPLTrainer does not support "
            "yet; pass metrics=... instead. Received: weighted_metrics="
            f"{record['weighted_metrics']!r}"
        )
    inner = getattr(settings["optimizer"], "inner_optimizer", None)
    if inner is not None:
        # compile() wraps the optimizer in a LossScaleOptimizer under mixed_float16; the
        # engine scales the loss itself (amp.*), so it drives the inner optimizer.
        settings["optimizer"] = inner
    return {k: v for k, v in settings.items() if v is not None}


def _output_names(model) -> list[str]:
    names = getattr(model, "output_names", None)
    return list(names) if names else ["output"]


def _check_supported(config: Config) -> None:
    """Refuses settings that cannot apply instead of silently ignoring them."""
    values = config.to_dict()
    if values["pipeline.num_stages"] is not None and not values["auto.auto_parallel"]:
        raise ValueError(
            "pipeline.num_stages only applies to the automatic pipeline "
            "(auto.auto_parallel=True); give stages with epl.replicate scopes or stages=. "
            f"Received: pipeline.num_stages={values['pipeline.num_stages']}"
        )


def _needs_fresh_weights_per_step(callback_list) -> bool:
    return any(
        isinstance(cb, keras.callbacks.ModelCheckpoint) and cb.save_freq != "epoch"
        for cb in callback_list.callbacks
    )


def _unpack_validation(validation_data):
    if isinstance(validation_data, tf.data.Dataset):
        return validation_data, None
    if isinstance(validation_data, (tuple, list)) and len(validation_data) == 2:
        return validation_data
    raise ValueError(
        "validation_data must be a tf.data.Dataset or an (x, y) tuple. "
        f"Received: {type(validation_data).__name__}"
    )
