"""`fit`: epochs of training steps with Keras's callbacks, logs and validation.

Each step runs in the engine (`train_on_iterator`, or `steps_per_execution` steps per
call); the Keras model gets the trained values at each epoch's end (and after every
step when a callback's batch hook may read it); `checkpoint.dir` gets its periodic
checkpoints; a run resumed from a checkpoint continues at the step and input position
it was saved at (progress.py).
"""

from __future__ import annotations

import logging
import time

from epl_trainer.core import engine
from epl_trainer.core.engine import ema, user_steps
from epl_trainer.training import data as data_lib
from epl_trainer.training import fit_inputs as fit_lib
from epl_trainer.training import model_fn as model_fn_lib
from epl_trainer.training import model_inputs
from epl_trainer.training import monitors as monitors_lib
from epl_trainer.training.checkpoint_manager import CheckpointManager
from epl_trainer.training.context import TrainerContext
from epl_trainer.training.data_feeder import DataFeeder
from epl_trainer.training.end_of_data import warn_if_out_of_data
from epl_trainer.training.engine_runtime import EngineRuntime
from epl_trainer.training.inference import InferenceRunner
from epl_trainer.training.objectives import Objectives
from epl_trainer.training.progress import TrainingProgress
from epl_trainer.training.step_errors import nonfinite_loss_error, run_checked
from epl_trainer.training.step_stats import StepStats

logger = logging.getLogger(__name__)


class FitLoop:
    """Runs `fit`. Its state is the progress (shared with the checkpoints) and the step
    statistics; everything else it reaches through the parts it is given."""

    def __init__(
        self,
        context: TrainerContext,
        runtime: EngineRuntime,
        objectives: Objectives,
        feeder: DataFeeder,
        checkpoints: CheckpointManager,
        inference: InferenceRunner,
        progress: TrainingProgress,
        stats: StepStats,
    ):
        self._context = context
        self._runtime = runtime
        self._objectives = objectives
        self._feeder = feeder
        self._checkpoints = checkpoints
        self._inference = inference
        self._progress = progress
        self._stats = stats

    def fit(
        self,
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
    ):
        """`EPLTrainer.fit` (its docstring has the arguments' meaning)."""
        context, feeder = self._context, self._feeder
        x = model_inputs.python_source_dataset(x, shuffle)
        if validation_split and validation_data is None:
            (x, y, sample_weight), validation_data = fit_lib.train_validation_split(
                x, y, sample_weight, validation_split
            )
        files = parse_fn is not None or file_format is not None
        if not files:
            x, sample_weight = fit_lib.with_class_weight(x, y, sample_weight, class_weight)
        feeder.plan_from(x, y, sample_weight, model_fn_lib.TRAIN, parse_fn, file_format)
        self._objectives.require_loss("fit")
        self._runtime.check_model_unchanged("fit")
        model = context.model
        if not files:
            x = model_inputs.arrays_for_model(model, x)
        if context.deepspeed is not None:  # batch sizes, monitors and steps_per_print
            lanes = len(context.engine_plan.lanes)
            batch_size = context.deepspeed.fit_batch_size(x, batch_size, context.plan, lanes)
            extra = context.deepspeed.callbacks(
                self._objectives.loss_tracker, context.cluster.is_chief, self._stats.last
            )
            callbacks = [*(callbacks or []), *extra]
        if files:
            dataset = feeder.files_dataset(x, y, batch_size, parse_fn, file_format, steps_per_epoch)
            dataset, passes = fit_lib.with_class_weight(dataset, None, None, class_weight)[0], None
        else:
            dataset, passes = feeder.fit_dataset(x, y, sample_weight, batch_size, shuffle)
        dataset = model_inputs.fitted_to_model(dataset, model, with_labels=True)
        self._objectives.build(dataset.element_spec)
        validation = None
        if validation_data is not None:
            fit_lib.should_validate(0, validation_freq)  # a bad value fails before training
            validation = feeder.validation_dataset(
                validation_data, validation_batch_size or batch_size, validation_steps
            )
        verbose = fit_lib.verbosity(verbose)
        # A fresh trainer with checkpoint.dir resumes its newest checkpoint; `epochs` then
        # counts from the job's first epoch (Keras's initial_epoch), so a restarted script
        # finishes the run it was doing instead of adding epochs.
        resumed = self._checkpoints.auto_resume(dataset)
        (first_step, position), restored = self._progress.take_resume()
        if passes is not None and (resumed or restored):  # the checkpoint's order
            passes.seed = feeder.agreed_seed()
        start = "resumed" if resumed else "restored" if restored else "given"
        fit_lib.check_epochs(epochs, initial_epoch)
        profiled = monitors_lib.with_flops_profiler(
            callbacks,
            dataset,
            config=context.config,
            model=model,
            loss=self._objectives.loss,
            optimizer=context.optimizer,
            stages=context.engine_plan.staged.stages,
            step_stats=self._stats.last,
            cluster=context.cluster,
        )
        callback_list = fit_lib.callback_list(
            profiled,
            model,
            verbose,
            epochs=epochs,
            steps=steps_per_epoch or fit_lib.num_batches(dataset),
            add_history=True,
        )
        write_back_each_step = fit_lib.needs_fresh_weights_per_step(callback_list)
        # A batch-begin hook that may set the weights (set_weights before a step): the
        # step computes on them, as Keras's does.
        reload_after_begin = write_back_each_step and fit_lib.may_set_weights_at_batch_begin(
            callback_list
        )
        model.stop_training = False
        self._stats.history = {}
        callback_list.on_train_begin()
        # The model holds the trainer's state here; a callback may have set weights
        # (Keras's BackupAndRestore loads its backup and sets model._initial_epoch).
        self._runtime.load_from_model()
        initial_epoch = getattr(model, "_initial_epoch", None) or initial_epoch
        progress = self._progress
        epochs_run = fit_lib.epoch_range(epochs, initial_epoch, progress.epochs_done, start)
        if start != "given" and not epochs_run:
            logger.warning(
                "fit(epochs=%d) has no epoch to run: the %s checkpoint has %d epoch(s) "
                "done, and after a restore `epochs` is the final epoch (Keras's meaning "
                "with initial_epoch). Pass epochs > %d to train further.",
                epochs,
                start,
                progress.epochs_done,
                progress.epochs_done,
            )
        # Workers that agree on the end of the data (end_of_data.py) all take each step.
        known = fit_lib.num_batches(dataset) if context.end_of_data is None else None
        restore_input = progress.take_resume_input()
        # A checkpoint mid-epoch holds the epoch's running metrics: the resumed epoch's
        # logs then cover its batches before the checkpoint too, as the uninterrupted run's.
        resume_metrics = progress.take_resume_metrics() if first_step else None
        if isinstance(restore_input, str):  # why the checkpoint has no input state for it
            if passes is None and (position or progress.epochs_done):
                logger.warning(
                    "Resuming without the input pipeline's saved state (%s): skipping the "
                    "%d batch(es) already taken of this pass instead, which reads the same "
                    "samples only if the pipeline gives the same batches in a fresh process.",
                    restore_input,
                    position,
                )
            restore_input = None
        progress.batches = batches = data_lib.EpochBatches(
            dataset,
            steps_per_epoch,
            position,
            passes,
            progress.epochs_done,
            known,
            restore_input=restore_input,
        )
        logs = {}
        try:
            for epoch in epochs_run:
                batches.last_epoch = epoch == epochs_run[-1]
                self._runtime.run_hook(callback_list, "on_epoch_begin", epoch)
                logs = self._run_epoch(
                    batches,
                    callback_list,
                    write_back_each_step,
                    first_step,
                    resume_metrics,
                    reload_after_begin,
                )
                first_step, resume_metrics = 0, None
                if validation is not None and fit_lib.should_validate(epoch, validation_freq):
                    val_logs = self._inference.evaluate_dataset(validation, callback_list)
                    logs.update({f"val_{k}": v for k, v in val_logs.items()})
                self._end_epoch()
                self._runtime.run_hook(callback_list, "on_epoch_end", epoch, logs)
                if model.stop_training:
                    break
        except BaseException:
            self._checkpoints.wait_for_writer()  # no asynchronous save outlives fit
            raise
        finally:  # the last pass's iterator is deleted off this thread (iterators.py)
            progress.batches = batches.close()
        self._checkpoints.finish_pending()  # fit's last asynchronous save is published
        built = self._runtime.engine
        if built is not None:
            if len(epochs_run) and built.runs_user_steps:
                user_steps.finalize_moving_averages(model)
            elif len(epochs_run) and ema.uses_ema(context.optimizer):
                built.finalize_ema()  # as Keras's fit: the weights := their averages
            self._runtime.write_back()
        callback_list.on_train_end(logs)
        self._runtime.load_from_model()  # e.g. EarlyStopping(restore_best_weights=True)
        return model.history

    def _end_epoch(self) -> None:
        """The epoch is done: the Keras model gets the weights, checkpoint.dir a checkpoint."""
        self._progress.end_epoch()
        self._runtime.write_back()
        if self._context.config.checkpoint.dir:
            self._checkpoints.save_periodic()

    def _run_epoch(
        self,
        batches,
        callback_list,
        write_back_each_step,
        first_step=0,
        resume_metrics=None,
        reload_after_begin=False,
    ) -> dict:
        context, runtime, progress = self._context, self._runtime, self._progress
        program = runtime.ensure_for(batches.dataset)
        self._objectives.reset()
        if resume_metrics:
            self._objectives.load_state(resume_metrics)
        log_names = None if context.runs_user_steps else self._objectives.log_names()
        chunk = {"last": -1, "end": 0, "ran": 0}  # the last call's step indices and iterations
        end_of_data, per_call = context.end_of_data, context.steps_per_execution

        def step(index, iterator, count):
            callback_list.on_train_batch_begin(index)
            if reload_after_begin:  # the model's variables, as the hook left them
                runtime.load_from_model(optimizer=False)
            start = time.perf_counter()
            with runtime.watch():
                if end_of_data is not None and per_call == 1:
                    # StopIteration on every worker once any ran out
                    shards = context.engine_plan.data_shards[1]
                    element, rows = end_of_data.next_batch(iterator, index, shards)
                    spec = batches.dataset.element_spec
                    results = run_checked(program.train_on_element, element, spec, rows)
                elif per_call == 1:
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
            logs, stats = self._stats.split(results, log_names)
            chunk["logs"] = logs
            elapsed = max(time.perf_counter() - start, 1e-9)
            stats["samples_per_sec"] = ran * batch * context.data_shards / elapsed
            stats.update(call_steps=ran, call_seconds=elapsed)  # FlopsProfiler's
            self._stats.record(stats)
            nonfinite_at = self._stats.nonfinite_step(progress.epochs_done, index + ran - 1)
            if write_back_each_step:
                runtime.write_back()
            iterations = int(context.optimizer.iterations.numpy())
            chunk.update(last=index + ran - 1, end=iterations, ran=ran)
            # Keras's convention with steps_per_execution: one batch callback per call,
            # with the index of its last step.
            callback_list.on_train_batch_end(index + ran - 1, logs)
            if write_back_each_step:  # the model's variables, as a batch hook left them
                runtime.load_from_model(optimizer=False)
            if nonfinite_at is not None and not context.model.stop_training:
                # The callbacks saw the NaN loss first (TerminateOnNaN stops or raises).
                raise nonfinite_loss_error(nonfinite_at, context.config.communication)
            return ran, context.model.stop_training

        def after_step(index):
            progress.step_in_epoch = index + 1
            directory, every = context.config.checkpoint.dir, context.config.checkpoint.save_steps
            if not (directory and every) or index != chunk["last"]:
                return  # a checkpoint holds the state after a whole call
            end = chunk["end"]
            if end // every > (end - chunk["ran"]) // every:  # a multiple of every was reached
                self._checkpoints.save_periodic()

        # A resumed epoch may have no step left (killed between its last step's
        # checkpoint and the epoch-end one).
        ran = batches.run_epoch(step, first_step, after_step, per_call)
        if ran == 0 and first_step == 0:
            raise ValueError(
                "The training data yielded no batch. Check the dataset, batch_size "
                "and steps_per_epoch."
            )
        # Epoch logs: the metrics reduced over all workers; the last step's own values
        # (throughput, AMP loss scale and skipped steps) join `stats_history`.
        self._stats.end_epoch()
        with runtime.watch("the epoch's metric sync"):
            return self._objectives.logs(chunk.get("logs"))
