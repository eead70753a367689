"""EPLTrainer: fit / evaluate / predict / checkpoints for an ordinary Keras model.

The trainer is a facade over parts that each own their state, made here and reached
through its attributes (docs/architecture.md walks one `fit` call through them):

- `context` (context.py): the run's settings, which every part reads;
- `planner` (model_planning.py): takes the model and plans it, now or at the first data;
- `objectives` (objectives.py): the loss, the metrics and their logs;
- `runtime` (engine_runtime.py): the engine, built at the first data, and the Keras
  model kept in step with it;
- `feeder` (data_feeder.py): the user's inputs as this worker's batches;
- `checkpoints` (checkpoint_manager.py): save, restore, resume from `checkpoint.dir`;
- `inference` (inference.py): `evaluate` and `predict`;
- `fit_loop` (fit_loop.py): `fit`'s epochs, steps and callbacks;
- `on_batch` (on_batch.py): `train_on_batch`, `test_on_batch`, `predict_on_batch`;
- `progress` (progress.py) and `stats` (step_stats.py): where training stands, and the
  trainer's own per-step values.

The numerics live in `core/`.
"""

from __future__ import annotations

import logging

import keras

from epl_trainer.config.sections import Config
from epl_trainer.runtime import elastic
from epl_trainer.runtime.cluster import build_cluster
from epl_trainer.runtime.env import Env
from epl_trainer.training import compiled, deepspeed_run, keras_distribution, model_setup
from epl_trainer.training.checkpoint_manager import CheckpointManager
from epl_trainer.training.context import TrainerContext
from epl_trainer.training.data_feeder import DataFeeder
from epl_trainer.training.engine_runtime import EngineRuntime
from epl_trainer.training.fit_loop import FitLoop
from epl_trainer.training.host_agreement import HostAgreement
from epl_trainer.training.inference import (
    EVAL_STEPS_PER_CALL,  # noqa: F401  (re-exported)
    InferenceRunner,
)
from epl_trainer.training.model_fn import ModelSpec  # noqa: F401  (re-exported: epl.ModelSpec)
from epl_trainer.training.model_planning import ModelPlanner
from epl_trainer.training.objectives import Objectives
from epl_trainer.training.on_batch import OnBatchRunner
from epl_trainer.training.progress import TrainingProgress
from epl_trainer.training.step_errors import (
    NonFiniteLossError,  # noqa: F401  (re-exported: epl.NonFiniteLossError)
)
from epl_trainer.training.step_stats import StepStats

logger = logging.getLogger(__name__)


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
      loss: a Keras loss (object, name or function), or a list / dict / nested structure
        of them, as `Model.compile` takes it; matched to the outputs by Keras's own
        `CompileLoss` at the first data (losses.py).
      optimizer: a Keras optimizer or its name. It stays the "master": its learning rate
        (settable by callbacks) drives every replica's copy. Default: the compiled
        model's optimizer, else the model's `optimizer` (set by an earlier EPLTrainer,
        with that trainer's state), else SGD.
      metrics: Keras metrics or names, in `Model.compile`'s structures (a list for one
        output, a list or dict per output); resolved by Keras's own `CompileMetrics`
        ("accuracy" from the shapes) and logged under Keras's names (metrics.py).
      weighted_metrics: metrics that get the data's sample weights, as `Model.compile`'s
        (plain `metrics` do not). Default: the compiled model's.
      loss_weights: scales each output's loss (a list or dict, as `Model.compile`).
      params: passed to an Estimator-style model_fn as its `params`.
      strategy: `epl.Strategy(...)`, a bare `epl.replicate(n)` / `epl.split(n)`, or a
        `keras.distribution.DataParallel` / `ModelParallel` (keras_distribution.py: data
        parallelism over its mesh's devices). Without one, the distribution
        `keras.distribution.set_distribution` set (or whose `scope()` is current) is
        followed.
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
            # The compiled model's optimizer; else the one an earlier EPLTrainer left on the
            # model, which holds that trainer's optimizer state (update/master_state.py).
            keras_scaler = getattr(model, "optimizer", None)
            optimizer = compiled.settings(model).get("optimizer") or (
                compiled.unwrapped_optimizer(keras_scaler)
            )
        optimizer_given = optimizer is not None
        config, optimizer, deepspeed = deepspeed_run.trainer_setup(config, optimizer or "sgd")
        # The trainer's keys go over epl.init()'s (a DeepSpeed config is translated on top
        # of them too): a config= naming one key keeps init's devices and checkpoint.dir.
        env = Env.get()
        resolved = env.config if config is None else env.config.merge(Config.load(config))
        cluster = env.cluster if config is None else build_cluster(resolved.cluster)
        resolved = elastic.sized_config(resolved, cluster.worker_num)
        distribution = keras_distribution.requested(strategy)
        if distribution is None and keras.distribution.distribution() is not None:
            logger.warning(
                "strategy=%r is followed; the keras.distribution %r set or in scope is not.",
                strategy,
                type(keras.distribution.distribution()).__name__,
            )
        if distribution is not None:  # keras.distribution's mesh: the run's devices
            cluster = keras_distribution.mesh_cluster(distribution, cluster)
            strategy = None
        if isinstance(model, keras.Model) and not resolved.amp.level:
            # Keras's mixed precision (a mixed dtype policy, a LossScaleOptimizer) becomes
            # the engine's AMP with Keras's loss-scale schedule, not a silent float16 run.
            amp_keys = compiled.mixed_precision_keys(model, keras_scaler)
            # The model's policy decides amp.level / amp.dtype; a loss-scaler key the user
            # set wins over Keras's schedule (amp.loss_scale=128 ran at 2**15 before).
            given = resolved.given_keys() - {"amp.level", "amp.dtype"}
            amp_keys = {key: value for key, value in amp_keys.items() if key not in given}
            if amp_keys:
                resolved = resolved.replace(amp_keys)
        if steps_per_execution is None and isinstance(model, keras.Model):
            steps_per_execution = compiled.settings(model).get("steps_per_execution")
        if jit_compile is None and isinstance(model, keras.Model):
            # Keras records its "auto" resolved (True on a GPU): only a value it would not
            # give is the user's choice.
            jit_compile = compiled.user_jit_intent(model)
        self.context = context = TrainerContext(
            config=resolved,
            cluster=cluster,
            optimizer=compiled.unwrapped_optimizer(keras.optimizers.get(optimizer)),
            steps_per_execution=_checked_steps_per_execution(steps_per_execution),
            jit_compile=jit_compile if jit_compile in (True, False) else "auto",
            params=params,
            deepspeed=deepspeed,
            distribution=distribution,
        )
        self.objectives = Objectives(context)
        self.planner = ModelPlanner(
            context, self.objectives, self._take_start_state, optimizer_given
        )
        self.runtime = EngineRuntime(context, self.objectives, self.planner.build_from_features)
        self.progress = TrainingProgress()
        self.stats = StepStats(context)
        agreement = HostAgreement(cluster, self.runtime.watch)
        self.feeder = DataFeeder(context, self.planner, self.objectives, self.progress, agreement)
        self.checkpoints = CheckpointManager(
            context, self.runtime, self.progress, agreement, self.planner, self.objectives
        )
        self.inference = InferenceRunner(context, self.runtime, self.objectives, self.feeder)
        self.fit_loop = FitLoop(
            context,
            self.runtime,
            self.objectives,
            self.feeder,
            self.checkpoints,
            self.inference,
            self.progress,
            self.stats,
        )
        self.on_batch = OnBatchRunner(
            context,
            self.runtime,
            self.objectives,
            self.feeder,
            self.inference,
            self.progress,
            self.stats,
        )
        arguments = dict(
            loss=loss,
            metrics=metrics,
            weighted_metrics=weighted_metrics,
            loss_weights=loss_weights,
            strategy=strategy,
            stages=stages,
            split=split,
        )
        self.planner.take(model, arguments)

    def _take_start_state(self) -> None:
        # The planner calls it once the model is planned; the runtime owns the agreement.
        self.runtime.take_start_state()

    # ---- the run's settings and state, as attributes -------------------------------------

    @property
    def config(self):
        """The resolved config (`epl.Config`). Settings read at run time (e.g.
        communication.timeout_seconds, at every step) follow a config set here."""
        return self.context.config

    @config.setter
    def config(self, config) -> None:
        self.context.config = config

    @property
    def cluster(self):
        """This job's cluster: workers, devices, this worker's index."""
        return self.context.cluster

    @property
    def model(self):
        """The Keras model (None until an Estimator-style model_fn is called)."""
        return self.context.model

    @property
    def optimizer(self):
        """The user's optimizer: the "master" every engine copy follows, and the holder of
        the optimizer state between uses (update/master_state.py)."""
        return self.context.optimizer

    @property
    def deepspeed(self):
        """The DeepSpeed run of a DeepSpeed config (deepspeed_run.py), or None."""
        return self.context.deepspeed

    @property
    def params(self):
        return self.context.params

    @property
    def steps_per_execution(self) -> int:
        return self.context.steps_per_execution

    @property
    def jit_compile(self):
        """True, False or "auto" (jit_choice.py)."""
        return self.context.jit_compile

    @property
    def engine_plan(self):
        """The planned engine (`core.engine.EnginePlan`)."""
        return self.context.engine_plan

    @property
    def plan(self):
        """The parallel plan: TaskGraphs x replicas x devices, micro-batches, schedule."""
        return self.context.plan

    @property
    def data_shards(self) -> int:
        """Input shards the job reads (`TrainerContext.data_shards`)."""
        return self.context.data_shards

    @property
    def data_shard(self) -> int:
        """The input shard this worker reads (`TrainerContext.data_shard`)."""
        return self.context.data_shard

    @property
    def staged(self):
        """The model cut into one sub-model per stage."""
        return self.context.engine_plan.staged

    @property
    def lanes(self):
        """This worker's lanes (one device per stage of a model replica)."""
        return self.context.engine_plan.lanes

    @property
    def engine(self):
        """The built `core.engine.Engine`, or None before the first data."""
        return self.runtime.engine

    @property
    def loss(self):
        """The compiled loss (`CompiledLoss`)."""
        return self.objectives.loss

    @property
    def metrics(self):
        """The compiled metrics (`CompiledMetrics`)."""
        return self.objectives.metrics

    @property
    def loss_tracker(self):
        return self.objectives.loss_tracker

    @property
    def epochs_done(self) -> int:
        """Every epoch this trainer ran (a resumed one: the job's), across `fit` calls."""
        return self.progress.epochs_done

    @property
    def step_stats(self) -> dict:
        """The trainer's own values of the last step, kept out of the callbacks' logs:
        throughput, and with AMP the loss scale and skipped steps."""
        return self.stats.last

    @property
    def stats_history(self) -> dict:
        """`step_stats` of the last step of each epoch of the latest `fit`."""
        return self.stats.history

    # ---- Keras's methods -------------------------------------------------------------

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
          (Keras's `BackupAndRestore` moves the start to its backup's epoch). After a
          restore, by `checkpoint.dir` or an explicit `restore_checkpoint`, the
          checkpoint's epoch count is the initial epoch and `epochs` the final one (as
          Keras documents `epochs` with `initial_epoch`, and BackupAndRestore resumes):
          the interrupted epoch is finished from the checkpoint's step and the run goes
          on to epoch `epochs`, ending where the uninterrupted run ends. To train
          further after a restore, pass `epochs=trainer.epochs_done + more`.

        With `parse_fn`, `x` is a list of file names or a glob: records are read with
        `file_format` ("tfrecord" by default, "text", or a callable `files -> Dataset`),
        parsed by `parse_fn(record) -> (features, labels)` and batched by `batch_size`
        per worker. With `io.slicing=True` each worker reads only its share of the files
        (`epl_trainer.training.io`).
        """
        return self.fit_loop.fit(
            x,
            y,
            batch_size,
            epochs,
            verbose,
            callbacks,
            validation_split,
            validation_data,
            shuffle,
            class_weight,
            sample_weight,
            initial_epoch,
            steps_per_epoch,
            validation_steps,
            validation_batch_size,
            validation_freq,
            parse_fn,
            file_format,
        )

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
        """The loss and metrics over the data (every worker's share), as `Model.evaluate`.

        Args:
          x, y: numpy inputs and labels, or a `tf.data.Dataset` of `(x, y)` or
            `(x, y, sample_weight)` batches as `x` (then y=None).
          batch_size: per-worker batch size for numpy inputs (default 32).
          verbose: 0 (silent), 1 or "auto" (progress bar), 2.
          sample_weight: numpy weights, one per sample (numpy inputs).
          steps: evaluate at most this many batches.
          callbacks: Keras callbacks; they get on_test_begin/end and, when they implement
            them, on_test_batch_begin/end for every batch, with Keras's logs.
          return_dict: False (the default, as Keras) returns Keras's list
            [loss, *metrics], or the loss alone when there are no metrics; True returns
            {"loss": ..., metric: ...}.
        """
        return self.inference.evaluate(
            x, y, batch_size, verbose, sample_weight, steps, callbacks, return_dict
        )

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """Model outputs for `x` (numpy, structured like the model's outputs), as
        `Model.predict`: every worker predicts all of `x`.

        Args:
          x: numpy inputs, or a `tf.data.Dataset` of batches (of `x`, or of `(x, y)` /
            `(x, y, sample_weight)`, whose labels and weights are ignored).
          batch_size: batch size for numpy inputs (default 32).
          verbose: 0 (silent), 1 or "auto" (progress bar), 2.
          steps: predict at most this many batches.
          callbacks: Keras callbacks; they get on_predict_begin/end and, when they
            implement them, on_predict_batch_begin/end for every batch, with the batch's
            outputs as `logs["outputs"]`.
        """
        return self.inference.predict(x, batch_size, verbose, steps, callbacks)

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
        """Runs one training step on one batch, as `Model.train_on_batch`.

        The batch is this worker's whole batch (as one batch of `fit`): it is split over
        the data-parallel lanes, and the optimizer's `iterations` advances by one. The
        Keras model holds the trained weights afterwards.

        Args:
          x: the inputs: an array or tensor, or a dict / list / tuple of them.
          y: the labels, structured as the model's outputs.
          sample_weight: one weight per sample.
          class_weight: {class index: weight}, for a model with one output.
          return_dict: False (the default, as Keras) returns [loss, *metrics], or the
            loss alone when there are no metrics; True returns {"loss": ..., metric: ...}.

        Returns:
          The loss and metrics of this batch (over every worker's batch).

        Raises:
          NonFiniteLossError: the loss or its gradients were not finite, so the step was
            not applied (unless `optimizer.nonfinite_loss="skip"`).
        """
        return self.on_batch.train_on_batch(x, y, sample_weight, class_weight, return_dict)

    def test_on_batch(self, x, y=None, sample_weight=None, return_dict=False):
        """The loss and metrics of one batch, as `Model.test_on_batch` (`evaluate` of
        this worker's batch alone; with several workers, over all their batches).

        Args:
          x, y, sample_weight: the batch, as in `train_on_batch`.
          return_dict: as in `train_on_batch`.
        """
        return self.on_batch.test_on_batch(x, y, sample_weight, return_dict)

    def predict_on_batch(self, x):
        """The model's outputs for one batch (numpy, structured like the model's
        outputs), as `Model.predict_on_batch`.

        Args:
          x: the inputs: an array or tensor, or a dict / list / tuple of them (a tuple
            is the inputs, not `(x, y)`).
        """
        return self.on_batch.predict_on_batch(x)

    def save_checkpoint(
        self, directory: str, keep_max: int | None = None, tag: str | None = None
    ) -> str | None:
        """Saves engine state (weights, optimizer slots, loss scale, step, input position).

        Every worker must call it (the trainer's periodic saves do): each writes the
        entries it owns; the chief publishes once all are in and returns the path (other
        workers return None). The `keep_max` newest `ckpt-<step>` checkpoints are kept
        (all if None). `tag` names the folder, as DeepSpeed's `save_checkpoint(save_dir,
        tag)` (default `ckpt-<step>`; the chief's names it); `keep_max` never deletes a
        tagged one, and `latest` points at it as at any other.

        With `checkpoint.async_save`, the state is snapshot into host memory and written
        by a background thread while training goes on; the returned path is where the
        checkpoint appears once written (`latest` moves only then). At most one save is in
        flight: the next save, a restore and the end of `fit` wait for it (see
        `wait_for_checkpoint`). A multi-worker job publishes it at that next point, once
        every worker has written its shard.
        """
        return self.checkpoints.save(directory, keep_max, tag)

    def wait_for_checkpoint(self) -> str | None:
        """Waits for the asynchronous save in flight (`checkpoint.async_save`) and publishes
        it; returns its path on the chief (None if no save was in flight, or on other
        workers). Raises CheckpointError if it failed. Every worker must call it. `fit`
        calls it at its end; call it after a `save_checkpoint` outside `fit` before
        relying on the checkpoint (a single worker's save publishes itself; the process's
        exit waits for the writer).
        """
        return self.checkpoints.finish_pending()

    def restore_checkpoint(
        self, directory: str, features=None, tag: str | int | None = None
    ) -> str:
        """Restores a checkpoint of `directory` into every local lane; returns its path.

        `tag` names the checkpoint as DeepSpeed's `load_checkpoint(load_dir, tag)` does:
        its folder name (`"ckpt-100"`) or the step it is named after (`100`); None
        restores the newest (`latest`). An unknown tag is a CheckpointError listing the
        directory's tags; restoring only reads the directory.

        The checkpoint may come from any layout (device or worker count, stage cut, ZeRO
        level, split width...); each worker reads only the entries its layout needs.
        A trainer that has not trained yet needs the model built (functional models are);
        for subclassed models, and for an Estimator-style model_fn, pass one batch of
        `features` to build it.

        A `fit` after it continues the restored run: `epochs` is the final epoch (see
        `fit`), so `fit(epochs=N)` finishes the checkpoint's epoch and goes on to N.
        """
        return self.checkpoints.restore(directory, features, tag)

    def placement(self) -> dict[str, int]:
        """{device: bytes of model variables it holds}: whole copies under data
        parallelism, a stage's under pipelines, the pieces under ZeRO v2, the shards of
        split layers (the parameters column of `memory_report`). Needs the engine (after
        the first `fit`, or a restore)."""
        report = self.runtime.memory_report()
        return {device: row.parameters for device, row in report.devices.items()}

    def memory_report(self, print_table: bool = True):
        """Bytes of parameters, gradients and optimizer state per device (engine state).

        Returns an `epl_trainer.training.memory.MemoryReport` (index it by device name); prints
        it as a table unless `print_table=False`.
        """
        report = self.runtime.memory_report()
        if print_table:
            print(report)
        return report


def _checked_steps_per_execution(value) -> int:
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"steps_per_execution must be an int >= 1. Received: {value!r}")
    return value
