"""The trainer's engine at run time: built at the first data, kept in step with the
Keras model, and every collective of the trainer bounded by the lost-worker check.

The engine (`core/engine`) holds the trained state on the devices; the user's Keras model
and optimizer hold it for Keras (saving, callbacks, a later `model.fit`). This part
builds the engine from the plan once a batch is known (a subclassed model is built by
that batch), copies the state to the model (`write_back`) and from it
(`load_from_model`), and runs callback hooks that may set the weights between the two.
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from epl_trainer.annotations import checkpoints
from epl_trainer.core import engine
from epl_trainer.runtime.watchdog import bounded
from epl_trainer.training import compiled, fit_inputs, model_setup, optimizers, start_state
from epl_trainer.training import data as data_lib
from epl_trainer.training.context import TrainerContext
from epl_trainer.training.memory import build_report
from epl_trainer.training.objectives import Objectives


class EngineRuntime:
    """Owns the `Engine` (None until built) and the start-state agreement.

    Args:
      context: the run's settings.
      objectives: the loss and metrics the engine computes.
      build_model_from: `build_model_from(features)`, which plans a model that waits for
        data (model_planning.py) before the engine is built from one batch.
    """

    def __init__(self, context: TrainerContext, objectives: Objectives, build_model_from):
        self._context = context
        self._objectives = objectives
        self._build_model_from = build_model_from
        self.engine: engine.Engine | None = None
        self._start_state: start_state.StartState | None = None
        self._trained: set[int] = set()  # ids of the model's trainable variables at the build

    def take_start_state(self) -> None:
        """Every worker takes worker 0's model and optimizer (start_state.py): as the
        trainer takes the model, and again at the build if one batch built it."""
        context = self._context
        if self._start_state is None:
            self._start_state = start_state.StartState(context.cluster, self.watch)
        self._start_state.take(context.model, context.optimizer)

    # ---- building (lazily: a subclassed model is built by its first batch) -------------

    def ensure_for(self, dataset) -> engine.Engine:
        """The engine, built for `dataset` if it is not yet (from its first batch when the
        model is not built or the recomputed gradients are checked)."""
        model, config = self._context.model, self._context.config
        needs_batch = not model.built or config.gradient_checkpoint.check_gradients
        if self.engine is None and needs_batch:
            element = next(iter(dataset.take(1)))
            return self.ensure(data_lib.split_element(element, with_labels=False)[0])
        return self.ensure(None)

    def ensure(self, features) -> engine.Engine:
        """The engine, built (with `features`, one batch, if the model needs it) if it is
        not yet."""
        if self.engine is not None:
            return self.engine
        self._build_model_from(features)  # restore_checkpoint(features=...) before fit
        context = self._context
        if not context.model.built:
            model_setup.build_model(context.model, features)
        self._objectives.build()
        with tf.device(context.cluster.host_device):
            self._objectives.loss_tracker.reset_state()
        self.take_start_state()  # if the batch above built the model
        end_of_data = context.end_of_data
        self.engine = engine.build_engine(
            context.engine_plan,
            context.config,
            context.cluster.host_device,
            self._objectives.loss,
            self._objectives.metrics,
            self._objectives.loss_tracker,
            self._replica_optimizer,
            clip_global_norm=context.optimizer.global_clipnorm,
            step_counter=context.optimizer.iterations,
            checkpoint_marks=checkpoints.get_collection(),
            agree_on_batches=None
            if end_of_data is None
            else end_of_data.in_graph(context.engine_plan.data_shards[1]),
        )
        self._trained = {id(v) for v in context.model.trainable_variables}
        if context.config.gradient_checkpoint.check_gradients:
            self.engine.check_recompute_gradients(features)
        return self.engine

    def _replica_optimizer(self, device: str, variables: list, originals: list):
        """A copy of the user's optimizer for engine-owned copies of `originals`, on `device`."""
        master = self._context.optimizer
        with tf.device(device):
            # Global-norm clipping is done over all stages by the program.
            replica = optimizers.replica(master, variables, originals, global_clipnorm=None)
            if isinstance(master._learning_rate, keras.Variable):
                replica._learning_rate = master._learning_rate  # LR callbacks reach all
            replica.build(variables)
        return replica

    # ---- the Keras model in step with the engine -----------------------------------------

    def check_model_unchanged(self, call: str) -> None:
        """Refuses to train when `model.optimizer` is no longer the trainer's optimizer
        (`model.compile(optimizer=...)` or an assignment after the trainer took the
        model): the engine would go on with the old one while Keras's callbacks set the
        new one's learning rate and `model.save` saved its untouched state. Refuses too
        when the model's trainable variables changed since the engine was built (a layer
        frozen or unfrozen): the engine would go on training what it was built to."""
        context = self._context
        model = context.model
        if context.engine_plan is None or not isinstance(model, keras.Model):
            return
        if self.engine is not None and {id(v) for v in model.trainable_variables} != (
            self._trained
        ):
            raise ValueError(
                f"{call}: the model's trainable variables changed since this EPLTrainer "
                "built its engine (a layer's `trainable` set), and the engine trains what "
                "it was built to. Build a new `EPLTrainer(model)` to train the model as it "
                f"is now. Received: {len(model.trainable_variables)} trainable variables, "
                f"{len(self._trained)} at the build."
            )
        current = compiled.unwrapped_optimizer(getattr(model, "optimizer", None))
        if current is context.optimizer:
            return
        raise ValueError(
            f"{call}: the model's optimizer is not the one this EPLTrainer trains with "
            "(the model was compiled again, or `model.optimizer` assigned, after the "
            "trainer took it). Build a new `EPLTrainer(model)` to train with the model's "
            "optimizer (it takes the compiled model's), or give the model back the "
            f"trainer's (`model.optimizer = trainer.optimizer`). Received: "
            f"model.optimizer={current!r}, trainer.optimizer={context.optimizer!r}"
        )

    def write_back(self) -> None:
        """The Keras model gets the trained values. With a replica whose stages are on
        several workers this exchanges them with the peers: a lost peer there is named
        within communication.timeout_seconds, as in a step, instead of hanging."""
        with self.watch("writing the weights back to the Keras model"):
            self.engine.write_back()

    def load_from_model(self, optimizer: bool = True) -> None:
        """The engine takes the Keras model's current values (and, with `optimizer`, its
        optimizer's state), if it is built (a new engine starts from them anyway)."""
        if self.engine is not None:
            self.engine.load_from_model(optimizer=optimizer)

    def run_hook(self, callbacks, hook: str, *args) -> None:
        """Runs a callback hook; where a callback may set the weights (SwapEMAWeights, a
        set_weights), the model (and its optimizer's state, the moving averages included:
        update/master_state.py) get the trainer's state before it and the trainer takes
        them back after it."""
        sync = self.engine is not None and fit_inputs.may_set_weights(callbacks, hook)
        if sync:
            self.write_back()
        getattr(callbacks, hook)(*args)
        if sync:
            self.engine.load_from_model()

    @contextlib.contextmanager
    def watch(self, what: str = "a training step"):
        """Bounds the collectives inside the block and names a lost peer if one failed;
        one worker's step is bounded too when it spans several of its devices (their
        collectives could wait on each other forever: watchdog.py)."""
        timeout = self._context.config.communication.timeout_seconds
        planned = self._context.engine_plan
        local = planned is not None and (
            len({device for lane in planned.lanes for device in lane.devices}) > 1
        )
        with bounded(self._context.cluster, timeout, what, local_collectives=local):
            yield

    def memory_report(self):
        """Bytes of parameters, gradients and optimizer state per device (engine state)."""
        if self.engine is None:
            raise ValueError("memory_report() needs the engine: call fit() or restore first.")
        return build_report(self.engine.state, self.engine.update, self._context.engine_plan.lanes)
