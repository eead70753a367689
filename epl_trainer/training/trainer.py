"""EPLTrainer: fit / evaluate / predict / checkpoints for an ordinary Keras model.

The trainer is glue: it resolves the config, the model's compile settings and its
annotations, asks the engine to plan (`engine.plan_engine`, at construction) and to
build (`engine.build_engine`, at the first data), and runs the loop with standard Keras
callbacks, logs and checkpoints. The numerics live in `core/`.
"""

from __future__ import annotations

import contextlib
import logging
import time

import keras
import tensorflow as tf

from epl_trainer.annotations import checkpoints, strategies
from epl_trainer.config.sections import Config
from epl_trainer.core import engine
from epl_trainer.core.engine import ema, user_steps
from epl_trainer.core.plan import rules
from epl_trainer.runtime import elastic
from epl_trainer.runtime.cluster import build_cluster, detect_lost_workers
from epl_trainer.runtime.env import Env
from epl_trainer.runtime.watchdog import watchdog_for
from epl_trainer.training import (
    compiled,
    deepspeed_run,
    model_inputs,
    model_setup,
    optimizers,
    start_state,
)
from epl_trainer.training import data as data_lib
from epl_trainer.training import fit_inputs as fit_lib
from epl_trainer.training import model_fn as model_fn_lib
from epl_trainer.training import monitors as monitors_lib
from epl_trainer.training.end_of_data import EndOfDataAgreement, warn_if_out_of_data
from epl_trainer.training.memory import build_report
from epl_trainer.training.metric_sync import MetricSync
from epl_trainer.training.model_fn import ModelSpec  # noqa: F401  (re-exported: epl.ModelSpec)
from epl_trainer.training.on_batch import OnBatchMixin
from epl_trainer.training.step_errors import (
    NonFiniteLossError,  # noqa: F401  (re-exported: epl.NonFiniteLossError)
    nonfinite_loss_error,
    run_checked,
)
from epl_trainer.training.trainer_checkpoints import CheckpointMixin
from epl_trainer.training.trainer_data import TrainingDataMixin, needs_data_to_build
from epl_trainer.training.trainer_inference import (
    EVAL_STEPS_PER_CALL,  # noqa: F401  (re-exported)
    InferenceMixin,
)
from epl_trainer.training.trainer_objectives import ObjectivesMixin

logger = logging.getLogger(__name__)


class EPLTrainer(CheckpointMixin, TrainingDataMixin, InferenceMixin, OnBatchMixin, ObjectivesMixin):
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
      loss: a Keras loss (object, name or function), or a list / dict / nested structure
        of them, as `Model.compile` takes it; matched to the outputs by Keras's own
        `CompileLoss` at the first data (losses.py).
      optimizer: a Keras optimizer or its name. It stays the "master": its learning rate
        (settable by callbacks) drives every replica's copy. Default: the compiled
        model's optimizer, else SGD.
      metrics: Keras metrics or names, in `Model.compile`'s structures (a list for one
        output, a list or dict per output); resolved by Keras's own `CompileMetrics`
        ("accuracy" from the shapes) and logged under Keras's names (metrics.py).
      weighted_metrics: metrics that get the data's sample weights, as `Model.compile`'s
        (plain `metrics` do not). Default: the compiled model's.
      loss_weights: scales each output's loss (a list or dict, as `Model.compile`).
      params: passed to an Estimator-style model_fn as its `params`.
      strategy: `epl.Strategy(...)`, or a bare `epl.replicate(n)` / `epl.split(n)`.
      stages: {layer-name regex: stage index}, a shortcut for `Strategy(stages=...)`.
      split: [layer-name regex], a shortcut for `Strategy(split=...)`.
      config: an `epl.Config`, a dict of dotted keys or a JSON/YAML path, whose keys go
        over those given to `epl.init()` (the other keys keep init's values); None uses
        init's config (or the defaults). A DeepSpeed config (JSON path,
        dict or `epl_trainer.deepspeed.DeepSpeedConfig`) is translated on top of
        `epl.init()`'s config, and its optimizer/scheduler replace `optimizer`.
      steps_per_execution: training steps run per call of the compiled step (a loop in
        the graph), as `Model.compile(steps_per_execution=...)`: batch callbacks then run
        once per call. Default: the compiled model's, else 1. With several workers they
        agree on the end of the data before each step inside the loop.
      jit_compile: XLA, as `Model.compile(jit_compile=True)`: on one device the whole
        step but the update (`optimizer.jit_compile`), else each stage's forward and
        backward. Default: a compiled value Keras's "auto" would not give, else "auto"
        (jit_choice.py). A model's own train_step runs in plain ops.

    A Sequential model without an input shape is built from the first data's shapes (as
    `Model.fit` builds it) and planned then; `plan`, `staged` and `lanes` exist from then on.
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
        steps_per_execution=None,
        jit_compile=None,
        weighted_metrics=None,
    ):
        model_setup.check_no_distribution_strategy(model)
        keras_scaler = optimizer
        if optimizer is None and isinstance(model, keras.Model):
            keras_scaler = getattr(model, "optimizer", None) if model.compiled else None
            optimizer = compiled.settings(model).get("optimizer")
        self._optimizer_given = optimizer is not None
        config, optimizer, self.deepspeed = deepspeed_run.trainer_setup(config, optimizer or "sgd")
        # The trainer's keys go over epl.init()'s (a DeepSpeed config is translated on top
        # of them too): a config= naming one key keeps init's devices and checkpoint.dir.
        env = Env.get()
        self.config = env.config if config is None else env.config.merge(Config.load(config))
        self.cluster = env.cluster if config is None else build_cluster(self.config.cluster)
        self.config = elastic.sized_config(self.config, self.cluster.worker_num)
        self.optimizer = compiled.unwrapped_optimizer(keras.optimizers.get(optimizer))
        if isinstance(model, keras.Model) and not self.config.amp.level:
            # Keras's mixed precision (a mixed dtype policy, a LossScaleOptimizer) becomes
            # the engine's AMP with Keras's loss-scale schedule, not a silent float16 run.
            amp_keys = compiled.mixed_precision_keys(model, keras_scaler)
            if amp_keys:
                self.config = self.config.replace(amp_keys)
        self.params = params
        if steps_per_execution is None and isinstance(model, keras.Model):
            steps_per_execution = compiled.settings(model).get("steps_per_execution")
        self.steps_per_execution = _checked_steps_per_execution(steps_per_execution)
        if jit_compile is None and isinstance(model, keras.Model):
            # Keras records its "auto" resolved (True on a GPU): only a value it would not
            # give is the user's choice.
            jit_compile = compiled.user_jit_intent(model)
        self.jit_compile = jit_compile if jit_compile in (True, False) else "auto"
        self._engine: engine.Engine | None = None
        self.epochs_done = 0
        self._metric_sync = MetricSync(self.cluster) if self.cluster.worker_num > 1 else None
        # Where training stands inside the epoch in progress, for checkpoints: steps run in
        # it, and the batches taken from the current pass of the data (EpochBatches).
        self._step_in_epoch = 0
        self._batches: data_lib.EpochBatches | None = None
        self._resume_position = (0, 0)  # (step_in_epoch, input position) of a restore
        self._restored = False  # a checkpoint was restored since the last fit
        self._nonfinite_seen = 0
        # The trainer's own per-step values, kept out of the callbacks' logs (which are
        # Keras's: loss and metrics): throughput, and with AMP the loss scale and skipped
        # steps. `step_stats` holds the last step's, `stats_history` the last step of each
        # epoch of the latest `fit` (as `History.history` does for the logs).
        self.step_stats: dict = {}
        self.stats_history: dict[str, list] = {}
        multi_worker = self.cluster.worker_num > 1
        self._end_of_data = EndOfDataAgreement(self.cluster) if multi_worker else None
        self._shuffle_seed: int | None = None
        self._pending_model = None
        arguments = dict(
            loss=loss,
            metrics=metrics,
            weighted_metrics=weighted_metrics,
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
        if needs_data_to_build(spec.model):
            # Planning cuts the layer graph, which an unbuilt Sequential does not have
            # yet: it is built from the first data's shapes (`_build_from_data`).
            self.model, self._pending_model = spec.model, (spec, arguments)
            return
        self._setup(spec, **arguments)

    def _setup(
        self, spec, loss, metrics, loss_weights, strategy, stages, split, weighted_metrics=None
    ) -> None:
        """Takes the model and cuts and plans it (from __init__, or at the first data)."""
        model = spec.model
        given = compiled.settings(model)
        first = compiled.first_given
        if not self._optimizer_given and self.deepspeed is None:
            chosen = first(spec.optimizer, given.get("optimizer"))
            if chosen is not None:
                self.optimizer = keras.optimizers.get(chosen)
        self.model = model
        objectives = dict(
            loss=first(loss, spec.loss, given.get("loss")),
            metrics=first(metrics, spec.metrics, given.get("metrics")),
            loss_weights=first(loss_weights, spec.loss_weights, given.get("loss_weights")),
            weighted_metrics=first(weighted_metrics, given.get("weighted_metrics")),
        )
        self._setup_objectives(model, **objectives)
        annotation = strategies.resolve_trainer_annotation(
            model, self.config.auto.auto_parallel, strategy, stages, split
        )
        self.engine_plan = engine.plan_engine(
            model,
            self.config,
            self.cluster.devices_by_worker,
            self.cluster.worker_index,
            taskgraphs=annotation.taskgraphs if annotation else None,
            node_taskgraph=annotation.node_taskgraph if annotation else None,
            loss=self.loss,
            metrics=self.metrics,
            clip_global_norm=self.optimizer.global_clipnorm,
            steps_per_execution=self.steps_per_execution,
            jit_compile=self.jit_compile,
        )
        if self.deepspeed is not None:  # accumulation steps may follow from the lane count
            self.config, self.engine_plan.plan = self.deepspeed.resolve_plan(
                self.config, self.engine_plan.plan, len(self.engine_plan.lanes_in_job)
            )
        if self.engine_plan.user_steps:  # its own steps read compile()'s settings
            passed = (loss, metrics, loss_weights, weighted_metrics)
            compiled.compile_for_own_steps(model, self.optimizer, objectives, passed)
        if compiled.unwrapped_optimizer(getattr(model, "optimizer", None)) is not self.optimizer:
            # What Keras callbacks read (LR, iterations) and Keras saves. A LossScaleOptimizer
            # around it stays: it holds the loss scale (update/master_state.py).
            self.model.optimizer = self.optimizer
        if ema.uses_ema(self.optimizer):
            rules.check_ema(self.config.zero)
        self._start_state = start_state.StartState(self.cluster, self._lost_worker_check)
        self._start_state.take(self.model, self.optimizer)  # worker 0's values (start_state.py)

    @property
    def plan(self):
        """The parallel plan: TaskGraphs x replicas x devices, micro-batches, schedule."""
        return self.engine_plan.plan

    @property
    def data_shards(self) -> int:
        """Input shards the job reads: the worker count, unless replicas span workers
        (those workers read the same batches). A worker's batch = global batch / this."""
        planned = getattr(self, "engine_plan", None)  # None: a model_fn not built yet
        return self.cluster.worker_num if planned is None else planned.data_shards[0]

    @property
    def data_shard(self) -> int:
        """The input shard this worker reads (`fit` and `evaluate` shard arrays by it)."""
        planned, worker = getattr(self, "engine_plan", None), self.cluster.worker_index
        return worker if planned is None else planned.data_shards[1][worker]

    @property
    def staged(self):
        """The model cut into one sub-model per stage."""
        return self.engine_plan.staged

    @property
    def lanes(self):
        """This worker's lanes (one device per stage of a model replica)."""
        return self.engine_plan.lanes

    # ---- building the engine (lazily: a subclassed model is built by its first batch) ----

    def _ensure_engine_for(self, dataset) -> engine.Engine:
        """Builds the program; an unbuilt (subclassed) model is first called on one batch."""
        needs_batch = not self.model.built or self.config.gradient_checkpoint.check_gradients
        if self._engine is None and needs_batch:
            element = next(iter(dataset.take(1)))
            return self._ensure_engine(data_lib.split_element(element, with_labels=False)[0])
        return self._ensure_engine(None)

    def _ensure_engine(self, features) -> engine.Engine:
        if self._engine is not None:
            return self._engine
        if self._pending_model is not None:  # restore_checkpoint(features=...) before fit
            self._build_from_data(tf.data.Dataset.from_tensors(features), model_fn_lib.INFER)
        if not self.model.built:
            model_setup.build_model(self.model, features)
        self._build_objectives()
        with tf.device(self.cluster.host_device):
            self.loss_tracker.reset_state()
        self._start_state.take(self.model, self.optimizer)  # if the batch above built it
        self._engine = engine.build_engine(
            self.engine_plan,
            self.config,
            self.cluster.host_device,
            self.loss,
            self.metrics,
            self.loss_tracker,
            self._replica_optimizer,
            clip_global_norm=self.optimizer.global_clipnorm,
            step_counter=self.optimizer.iterations,
            checkpoint_marks=checkpoints.get_collection(),
            agree_on_batches=None
            if self._end_of_data is None
            else self._end_of_data.in_graph(self.engine_plan.data_shards[1]),
        )
        if self.config.gradient_checkpoint.check_gradients:
            self._engine.check_recompute_gradients(features)
        return self._engine

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
        x=None,
        y=None,
        batch_size=None,
        epochs=1,
        verbose="auto",
        callbacks=None,
        validation_split=0.0,
        validation_data=None,
        shuffle=True,
        class_weight=None,
        sample_weight=None,
        initial_epoch=0,
        steps_per_epoch=None,
        validation_steps=None,
        validation_batch_size=None,
        validation_freq=1,
        parse_fn=None,
        file_format=None,
    ):
        """Trains; returns a `keras.callbacks.History`. The arguments are `Model.fit`'s,
        with Keras's meaning (`fit_inputs.py`), and:

        - `batch_size` is per worker (numpy inputs are dealt to the workers in batches).
        - `shuffle` (True by default, as Keras): numpy inputs are dealt in a new order
          every epoch, from a seed drawn from NumPy's global generator (the same on every
          worker); "batch" shuffles whole batches; False keeps the array order (for runs
          compared with a fixed-order reference or resumed from a checkpoint). A Dataset
          is used as given, sharded across workers (`io.auto_shard`).
        - `sample_weight` and `class_weight` become one float32 weight per sample;
          `class_weight` needs a single output. Dataset elements may be
          `(x, y, sample_weight)`.
        - Epochs are numbered as in Keras: `initial_epoch .. epochs - 1` on every call
          (Keras's `BackupAndRestore` moves the start to its backup's epoch). A run
          resumed from `checkpoint.dir` continues its epoch count up to `epochs`, as
          BackupAndRestore; after an explicit `restore_checkpoint`, `fit` runs `epochs`
          more epochs numbered from the checkpoint's count.

        With `parse_fn`, `x` is a list of file names or a glob: records are read with
        `file_format` ("tfrecord" by default, "text", or a callable `files -> Dataset`),
        parsed by `parse_fn(record) -> (features, labels)` and batched by `batch_size`
        per worker. With `io.slicing=True` each worker reads only its share of the files
        (`epl_trainer.training.io`).
        """
        x = model_inputs.python_source_dataset(x, shuffle)
        if validation_split and validation_data is None:
            (x, y, sample_weight), validation_data = fit_lib.train_validation_split(
                x, y, sample_weight, validation_split
            )
        files = parse_fn is not None or file_format is not None
        if not files:
            x, sample_weight = fit_lib.with_class_weight(x, y, sample_weight, class_weight)
        if self._waits_for_data:
            probe = data_lib.spec_probe(x, y, parse_fn, file_format, sample_weight)
            self._build_from_data(probe, model_fn_lib.TRAIN)
        self._require_loss("fit")
        if not files:
            x = model_inputs.arrays_for_model(self.model, x)
        if self.deepspeed is not None:  # batch sizes, monitors and steps_per_print
            batch_size = self.deepspeed.fit_batch_size(x, batch_size, self.plan, len(self.lanes))
            extra = self.deepspeed.callbacks(
                self.loss_tracker, self.cluster.is_chief, self.step_stats
            )
            callbacks = [*(callbacks or []), *extra]
        if files:
            dataset = self._files_dataset(x, y, batch_size, parse_fn, file_format, steps_per_epoch)
            dataset, passes = fit_lib.with_class_weight(dataset, None, None, class_weight)[0], None
        else:
            dataset, passes = self._fit_dataset(x, y, sample_weight, batch_size, shuffle)
        dataset = model_inputs.fitted_to_model(dataset, self.model, with_labels=True)
        self._build_objectives(dataset.element_spec)
        validation = None
        if validation_data is not None:
            fit_lib.should_validate(0, validation_freq)  # a bad value fails before training
            validation = self._validation_dataset(
                validation_data, validation_batch_size or batch_size, validation_steps
            )
        verbose = fit_lib.verbosity(verbose)
        # A fresh trainer with checkpoint.dir resumes its newest checkpoint; `epochs` then
        # counts from the job's first epoch (Keras's initial_epoch), so a restarted script
        # finishes the run it was doing instead of adding epochs.
        resumed = self._auto_resume(dataset)
        start = "resumed" if resumed else "restored" if self._restored else "given"
        self._restored = False
        fit_lib.check_epochs(epochs, initial_epoch)
        callback_list = fit_lib.callback_list(
            monitors_lib.with_flops_profiler(self, callbacks, dataset),
            self.model,
            verbose,
            epochs=epochs,
            steps=steps_per_epoch or fit_lib.num_batches(dataset),
            add_history=True,
        )
        write_back_each_step = fit_lib.needs_fresh_weights_per_step(callback_list)
        self.model.stop_training = False
        self.stats_history = {}
        callback_list.on_train_begin()
        if self._engine is not None:
            # The model holds the trainer's state here; a callback may have set weights
            # (Keras's BackupAndRestore loads its backup and sets model._initial_epoch).
            self._engine.load_from_model()
        initial_epoch = getattr(self.model, "_initial_epoch", None) or initial_epoch
        epochs_run = fit_lib.epoch_range(epochs, initial_epoch, self.epochs_done, start)
        first_step, position = self._resume_position
        self._resume_position = (0, 0)
        # Workers that agree on the end of the data (end_of_data.py) all take each step.
        known = fit_lib.num_batches(dataset) if self._end_of_data is None else None
        self._batches = batches = data_lib.EpochBatches(
            dataset, steps_per_epoch, position, passes, self.epochs_done, known
        )
        logs = {}
        try:
            for epoch in epochs_run:
                self._run_hook(callback_list, "on_epoch_begin", epoch)
                logs = self._run_epoch(batches, callback_list, write_back_each_step, first_step)
                first_step = 0
                if validation is not None and fit_lib.should_validate(epoch, validation_freq):
                    val_logs = self._evaluate_dataset(validation, callback_list)
                    logs.update({f"val_{k}": v for k, v in val_logs.items()})
                self._end_epoch()
                self._run_hook(callback_list, "on_epoch_end", epoch, logs)
                if self.model.stop_training:
                    break
        finally:  # the last pass's iterator is deleted off this thread (iterators.py)
            self._batches = batches.close()
        if self._engine is not None:
            if len(epochs_run) and self._engine.runs_user_steps:
                user_steps.finalize_moving_averages(self.model)
            elif len(epochs_run) and ema.uses_ema(self.optimizer):
                self._engine.finalize_ema()  # as Keras's fit: the weights := their averages
            self._write_back()
        callback_list.on_train_end(logs)
        if self._engine is not None:
            self._engine.load_from_model()  # e.g. EarlyStopping(restore_best_weights=True)
        return self.model.history

    def _run_hook(self, callbacks, hook: str, *args) -> None:
        """Runs a callback hook; where a callback may set the weights (SwapEMAWeights, a
        set_weights), the model (and the optimizer's averages) get the trainer's state
        before it and the trainer takes them back after it."""
        sync = self._engine is not None and fit_lib.may_set_weights(callbacks, hook)
        sync_ema = sync and ema.uses_ema(self.optimizer) and not self._engine.runs_user_steps
        if sync:
            self._write_back()
            if sync_ema:
                self._engine.ema_to_master(self.optimizer)
        getattr(callbacks, hook)(*args)
        if sync:
            self._engine.load_from_model()
            if sync_ema:
                self._engine.ema_from_master(self.optimizer)

    def _end_epoch(self) -> None:
        """The epoch is done: the Keras model gets the weights, checkpoint.dir a checkpoint.

        `epochs_done` counts every epoch this trainer ran (a resumed one: the job's), across
        `fit` calls: it numbers the passes over shuffled data and the checkpoints, while
        callbacks see Keras's epoch index (from `initial_epoch`, each `fit`)."""
        self.epochs_done += 1
        self._step_in_epoch = 0
        self._write_back()
        if self.config.checkpoint.dir:
            self._save_periodic()

    def _run_epoch(self, batches, callback_list, write_back_each_step, first_step=0) -> dict:
        program = self._ensure_engine_for(batches.dataset)
        self._reset_metrics()
        log_names = None if self._runs_user_steps else {n for n, _ in self._named_metrics()}
        chunk = {"last": -1, "end": 0, "ran": 0}  # the last call's step indices and iterations

        def step(index, iterator, count):
            callback_list.on_train_batch_begin(index)
            start = time.perf_counter()
            with self._lost_worker_check():
                if self._end_of_data is not None and self.steps_per_execution == 1:
                    # StopIteration on every worker once any ran out
                    shards = self.engine_plan.data_shards[1]
                    element, rows = self._end_of_data.next_batch(iterator, index, shards)
                    spec = batches.dataset.element_spec
                    results = run_checked(program.train_on_element, element, spec, rows)
                elif self.steps_per_execution == 1:
                    results = run_checked(program.train_on_iterator, iterator)
                else:  # several workers agree on the end of the data inside the loop
                    results = run_checked(program.train_many_on_iterator, iterator, count)
            ran = int(results.pop(engine.STEPS_KEY, 1))
            rows = results.pop(engine.ROWS_BY_WORKER_KEY, None)
            if rows is not None and ran < count:
                warn_if_out_of_data([int(r) for r in rows], index + ran)
            if ran == 0:
                return 0, False
            batch = int(results.pop(engine.BATCH_SIZE_KEY))

            # Callbacks get Keras's logs (the loss and metrics); the trainer's own values
            # (throughput, AMP loss scale, skipped steps) go to `step_stats`.
            logged = {k for k in results if log_names is None or k in log_names}
            logs = {k: fit_lib.log_value(v) for k, v in results.items() if k in logged}
            stats = {k: fit_lib.log_value(v) for k, v in results.items() if k not in logged}
            chunk["logs"] = logs
            elapsed = time.perf_counter() - start
            stats["samples_per_sec"] = ran * batch * self.data_shards / max(elapsed, 1e-9)
            stats.update(call_steps=ran, call_seconds=max(elapsed, 1e-9))  # FlopsProfiler's
            self.step_stats.clear()
            self.step_stats.update(stats)
            nonfinite_at = self._nonfinite_step(stats, index + ran - 1)
            if write_back_each_step:
                self._write_back()
            chunk.update(last=index + ran - 1, end=int(self.optimizer.iterations.numpy()), ran=ran)
            # Keras's convention with steps_per_execution: one batch callback per call,
            # with the index of its last step.
            callback_list.on_train_batch_end(index + ran - 1, logs)
            if write_back_each_step:  # the model's variables, as a batch hook left them
                self._engine.load_from_model(optimizer=False)
            if nonfinite_at is not None and not self.model.stop_training:
                # The callbacks saw the NaN loss first (TerminateOnNaN stops or raises).
                raise nonfinite_loss_error(nonfinite_at)
            return ran, self.model.stop_training

        def after_step(index):
            self._step_in_epoch = index + 1
            every = self.config.checkpoint.save_steps
            if not (self.config.checkpoint.dir and every) or index != chunk["last"]:
                return  # a checkpoint holds the state after a whole call
            end = chunk["end"]
            if end // every > (end - chunk["ran"]) // every:  # a multiple of every was reached
                self._save_periodic()

        # A resumed epoch may have no step left (killed between its last step's
        # checkpoint and the epoch-end one).
        ran = batches.run_epoch(step, first_step, after_step, self.steps_per_execution)
        if ran == 0 and first_step == 0:
            raise ValueError(
                "The training data yielded no batch. Check the dataset, batch_size "
                "and steps_per_epoch."
            )
        # Epoch logs: the metrics reduced over all workers; the last step's own values
        # (throughput, AMP loss scale and skipped steps) join `stats_history`.
        for key, value in self.step_stats.items():
            self.stats_history.setdefault(key, []).append(value)
        with self._lost_worker_check("the epoch's metric sync"):
            return self._logs(chunk.get("logs"))

    def memory_report(self, print_table: bool = True):
        """Bytes of parameters, gradients and optimizer state per device (engine state).

        Returns an `epl_trainer.training.memory.MemoryReport` (index it by device name); prints
        it as a table unless `print_table=False`.
        """
        if self._engine is None:
            raise ValueError("memory_report() needs the engine: call fit() or restore first.")
        report = build_report(self._engine.state, self._engine.update, self.lanes)
        if print_table:
            print(report)
        return report

    def _write_back(self) -> None:
        """The Keras model gets the trained values. With a replica whose stages are on
        several workers this exchanges them with the peers: a lost peer there is named
        within communication.timeout_seconds, as in a step, instead of hanging."""
        with self._lost_worker_check("writing the weights back to the Keras model"):
            self._engine.write_back()

    @contextlib.contextmanager
    def _lost_worker_check(self, what: str = "a training step"):
        """Bounds the collectives inside the block and names a lost peer if one failed."""
        timeout = self.config.communication.timeout_seconds
        watchdog = watchdog_for(self.cluster, timeout)
        with detect_lost_workers(self.cluster, timeout), watchdog.watch(what):
            yield

    def _nonfinite_step(self, stats: dict, index: int | None) -> str | None:
        """Where a non-finite step that stops training was skipped ("training step ...
        (epoch, batch)", or "(train_on_batch)" for index None), or None. With
        optimizer.nonfinite_loss="skip" it only warns."""
        count = int(stats.get("nonfinite_steps", 0))
        if count <= self._nonfinite_seen:
            return None
        self._nonfinite_seen = count
        step = int(self.optimizer.iterations.numpy())
        position = f"epoch {self.epochs_done + 1}, batch {index}"
        where = f"training step {step} ({'train_on_batch' if index is None else position})"
        if self.config.optimizer.nonfinite_loss == "skip":
            logger.warning("Non-finite loss at %s: the step was skipped.", where)
            return None
        return where


def _checked_steps_per_execution(value) -> int:
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"steps_per_execution must be an int >= 1. Received: {value!r}")
    return value
