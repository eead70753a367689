"""The user's model taken and planned: from the constructor, or from the first data.

A functional model (or a `model_fn` returning one) is planned as the trainer is made. Two
kinds wait for data: an unbuilt Sequential (no layer graph to cut until it sees its
input shape) and an Estimator-style `model_fn(features, labels, mode, params)` (called
with symbolic inputs made from the data's element spec). Planning resolves the loss,
metrics and optimizer (arguments over a model_fn's `ModelSpec` over `model.compile`),
the parallel annotation, and the engine plan, into the trainer's context.
"""

from __future__ import annotations

import dataclasses
import logging
import re

import keras
import tensorflow as tf
from keras import tree

from epl_trainer.annotations import strategies
from epl_trainer.annotations.strategies import Strategy, replicate
from epl_trainer.core import engine
from epl_trainer.core.engine import ema, user_steps
from epl_trainer.core.plan import rules
from epl_trainer.training import compiled, keras_distribution
from epl_trainer.training import data as data_lib
from epl_trainer.training import model_fn as model_fn_lib
from epl_trainer.training.context import TrainerContext
from epl_trainer.training.objectives import Objectives

logger = logging.getLogger(__name__)


class ModelPlanner:
    """Owns what waits to be planned (a model or a model_fn, with the trainer's
    arguments) and plans it once.

    Args:
      context: the run's settings; planning fills `model`, `optimizer` and `engine_plan`.
      objectives: take the resolved loss and metrics.
      take_start_state: called once the model is planned (every worker takes worker 0's
        model and optimizer: start_state.py).
      optimizer_given: the trainer was given an optimizer (or the model compiled one),
        which a model_fn's `ModelSpec` then does not replace.
    """

    def __init__(
        self,
        context: TrainerContext,
        objectives: Objectives,
        take_start_state,
        optimizer_given: bool,
    ):
        self._context = context
        self._objectives = objectives
        self._take_start_state = take_start_state
        self._optimizer_given = optimizer_given
        self._pending_model = None  # (ModelSpec, arguments) of an unbuilt Sequential
        self._pending_model_fn = None  # (Estimator-style model_fn, arguments)

    def take(self, model, arguments: dict) -> None:
        """Takes the trainer's `model` (a model or a model_fn) and its arguments (loss,
        metrics, weighted_metrics, loss_weights, strategy, stages, split): planned now,
        or at the first data if it waits for it."""
        if model_fn_lib.is_estimator_model_fn(model):
            self._pending_model_fn = (model, arguments)
            return
        spec = model_fn_lib.ModelSpec(model) if isinstance(model, keras.Model) else None
        if spec is None:
            if not callable(model):
                raise TypeError(
                    f"model must be a keras.Model or a model_fn. Received: {type(model).__name__}"
                )
            spec = model_fn_lib.call_model_fn(model)
        if needs_data_to_build(spec.model):
            # Planning cuts the layer graph, which an unbuilt Sequential does not have
            # yet: it is built from the first data's shapes (`build_from_data`).
            self._context.model, self._pending_model = spec.model, (spec, arguments)
            return
        self._plan(spec, **arguments)

    @property
    def waits_for_data(self) -> bool:
        """Whether the model is built (and planned) only from the first data."""
        return self._pending_model_fn is not None or self._pending_model is not None

    @property
    def waits_for_model_fn(self) -> bool:
        """An Estimator-style model_fn has not been called yet (there is no model)."""
        return self._pending_model_fn is not None

    def build_from_data(self, dataset, mode: str) -> None:
        """Builds an Estimator-style model_fn's model, or an unbuilt Sequential, from the
        data's element spec, and plans it (once)."""
        if self._pending_model is not None:
            (spec, arguments), self._pending_model = self._pending_model, None
            with_labels = mode != model_fn_lib.INFER
            features = data_lib.unpack_element(dataset.element_spec, with_labels)[0]
            build_sequential(spec.model, features)
            self._plan(spec, **arguments)
        if self._pending_model_fn is None:
            return
        fn, arguments = self._pending_model_fn
        self._pending_model_fn = None
        mode_spec = dataset.element_spec
        spec = model_fn_lib.call_estimator_model_fn(fn, mode_spec, mode, self._context.params)
        self._plan(spec, **arguments)

    def build_from_features(self, features) -> None:
        """An unbuilt Sequential built from one batch of features (a restore before the
        first fit); nothing for a planned model."""
        if self._pending_model is not None:
            self.build_from_data(tf.data.Dataset.from_tensors(features), model_fn_lib.INFER)

    def _plan(
        self, spec, loss, metrics, loss_weights, strategy, stages, split, weighted_metrics=None
    ) -> None:
        """Takes the model and cuts and plans it."""
        context = self._context
        model = spec.model
        given = compiled.settings(model)
        first = compiled.first_given
        if not self._optimizer_given and context.deepspeed is None:
            chosen = first(spec.optimizer, given.get("optimizer"))
            if chosen is not None:
                context.optimizer = keras.optimizers.get(chosen)
        context.model = model
        gathered, tensor_parallel, staged = {}, None, False
        if context.distribution is not None:  # Keras's layouts: data or tensor parallel
            strategy, tensor_parallel, staged = self._tensor_parallel_strategy(
                model, strategy, stages
            )
            gathered = tensor_parallel.gathered if tensor_parallel else {}
        objectives = dict(
            loss=first(loss, spec.loss, given.get("loss")),
            metrics=first(metrics, spec.metrics, given.get("metrics")),
            loss_weights=first(loss_weights, spec.loss_weights, given.get("loss_weights")),
            weighted_metrics=first(weighted_metrics, given.get("weighted_metrics")),
        )
        self._objectives.set(model, **objectives)
        annotation = strategies.resolve_trainer_annotation(
            model, context.config.auto.auto_parallel, strategy, stages, split
        )
        optimizer = context.optimizer
        context.engine_plan = engine.plan_engine(
            model,
            context.config,
            context.cluster.devices_by_worker,
            context.cluster.worker_index,
            taskgraphs=annotation.taskgraphs if annotation else None,
            node_taskgraph=annotation.node_taskgraph if annotation else None,
            loss=self._objectives.loss,
            metrics=self._objectives.metrics,
            clip_global_norm=optimizer.global_clipnorm,
            steps_per_execution=context.steps_per_execution,
            jit_compile=context.jit_compile,
            gathered=gathered,
            vocabulary=tensor_parallel.vocabulary if tensor_parallel else (),
            blocks=tensor_parallel.blocks if tensor_parallel else (),
            stage_width=tensor_parallel.width if staged else None,
            staged_pairs=tensor_parallel.pair_storage if staged else None,
        )
        if tensor_parallel is not None:  # the plan says what the layouts run as
            description = tensor_parallel.describe()
            logits = [  # decided by the engine: the output's loss must be a cross-entropy
                s.layer.embeddings.path
                for s in context.engine_plan.split_layers
                if s.kind == "vocab" and s.output_index is not None
            ]
            if logits:
                description += "; vocabulary-parallel logits (sharded cross-entropy): " + ", ".join(
                    logits
                )
            if staged:
                description += _staged_description(tensor_parallel, context.engine_plan)
            context.engine_plan.plan = dataclasses.replace(
                context.engine_plan.plan, layouts_description=description
            )
        if context.deepspeed is not None:  # accumulation steps may follow from the lane count
            context.config, context.engine_plan.plan = context.deepspeed.resolve_plan(
                context.config, context.engine_plan.plan, len(context.engine_plan.lanes_in_job)
            )
        if context.engine_plan.user_steps:  # its own steps read compile()'s settings
            passed = (loss, metrics, loss_weights, weighted_metrics)
            compiled.compile_for_own_steps(model, optimizer, objectives, passed)
        if compiled.unwrapped_optimizer(getattr(model, "optimizer", None)) is not optimizer:
            # What Keras callbacks read (LR, iterations) and Keras saves. A LossScaleOptimizer
            # around it stays: it holds the loss scale (update/master_state.py).
            model.optimizer = optimizer
        if ema.uses_ema(optimizer):
            rules.check_ema(context.config.zero)
        self._take_start_state()  # worker 0's values (start_state.py)

    def _tensor_parallel_strategy(self, model, strategy, stages):
        """(`strategy` (None: data parallelism over the mesh), None, False), or the
        Strategy a Keras layout map makes, its `TensorParallel` (keras_distribution.py)
        and whether pipeline stages cut the model.

        Without stages each replica is as wide as the model axis, its Megatron pairs
        split layers, whose lanes share the devices of the replicated layers. With
        stages (a stage map, stage scopes, or `auto.auto_parallel`) the stages stay the
        annotation's, each on its own group of model-axis devices (the run's devices
        become batch x model x stages: `keras_distribution.stage_cluster`)."""
        context = self._context
        own_steps = bool(user_steps.overridden_steps(model))
        unmatched = keras_distribution.unmatched_keys(context.distribution, model)
        if unmatched:
            logger.warning(
                "Layout map keys %s lay out no variable of model %r (no path equals or fully "
                "matches them): what they name trains replicated. Its variables: %s",
                unmatched,
                model.name,
                [v.path for v in model.variables][:12],
            )
        tensor_parallel = keras_distribution.plan(context.distribution, model, own_steps)
        if tensor_parallel is None:
            return strategy, None, False
        logger.info("Keras layouts: %s", tensor_parallel.describe())
        num_stages = _stage_count(model, stages, context.config)
        if num_stages > 1:
            config = context.config
            context.cluster = keras_distribution.stage_cluster(
                context.distribution,
                context.cluster,
                num_stages,
                tensor_parallel.width,
                {
                    "pipeline.virtual_stages": config.pipeline.virtual_stages > 1
                    and config.pipeline.virtual_stages,
                    "zero.level": config.zero.level,
                    "amp.level": config.amp.level,
                    "global_clipnorm": context.optimizer.global_clipnorm,
                },
            )
            return strategy, tensor_parallel, True
        context.config = context.config.replace({"cluster.colocate_split_and_replicate": True})
        patterns = [re.escape(name) for name in tensor_parallel.layers]
        width = tensor_parallel.width
        chosen = Strategy(default=replicate(width), split=patterns or None)
        return chosen, tensor_parallel, False


def _staged_description(tensor_parallel, engine_plan) -> str:
    """What pipeline stages add to the layouts' description: each stage's devices, and
    the pairs a stage boundary cuts (gathered on use instead)."""
    plan = engine_plan.plan
    computed = {s.layer.name for s in engine_plan.split_layers if s.kind in ("column", "row")}
    cut = [name for name in tensor_parallel.layers if name not in computed]
    text = (
        f"; {len(plan.taskgraphs)} pipeline stages, each on its own {tensor_parallel.width} devices"
    )
    if cut:
        text += "; Megatron pairs cut by a stage boundary, gathered on use: " + ", ".join(cut)
    return text


def _stage_count(model, stages, config) -> int:
    """The pipeline stages the run cuts the model in: `auto.auto_parallel`'s
    `pipeline.num_stages`, a stage map's, or the stage scopes' (`epl.replicate` scopes
    the model was built in); 1 without any."""
    if config.auto.auto_parallel:
        return config.pipeline.num_stages
    if stages is not None:
        return Strategy(stages=stages).num_stages
    if not isinstance(model, keras.Model) or needs_data_to_build(model):
        return 1
    annotation = strategies.resolve_annotation(model)  # a subclassed model: the default
    return len(annotation.taskgraphs) if annotation.source == "scopes" else 1


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
