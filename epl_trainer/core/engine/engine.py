"""The engine's entry point for the trainer: plan it, build it, run and save it.

Two phases, because a plan exists before the model has seen data (the trainer prints
it at construction) and the state only once a subclassed model is built:

* `plan_engine` (at trainer construction): checks which settings combine
  (`core/plan/rules.py`), cuts the model automatically if asked, places TaskGraphs on
  the job's devices (the `Plan`), cuts the model into stage sub-models, finds split
  layers, and lists the lanes. Returns an `EnginePlan`.
* `build_engine` (builder.py, at the first data): creates the state and the program and
  applies the passes. Returns an `Engine`, whose steps the trainer's loop calls and
  whose state it saves and restores.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

import keras
from keras import tree

from epl_trainer.core.engine import ema, jit_choice, user_steps
from epl_trainer.core.engine.gradient_check import check_stage_gradients
from epl_trainer.core.engine.program import Program
from epl_trainer.core.engine.split import (
    check_split_metrics,
    computed_blocks,
    find_split_layers,
    gathered_variables,
    laid_out_pairs,
    sparse_outputs,
    staged_megatron_pairs,
    vocabulary_parallel,
)
from epl_trainer.core.engine.state import EngineState, Lane, lanes_for_worker
from epl_trainer.core.engine.sync_batch_norm import check_sync_batch_norm, synchronized_layers
from epl_trainer.core.engine.update import MasterState
from epl_trainer.core.graph.auto_partition import auto_partition
from epl_trainer.core.graph.partition import StagedModel, partition_model, whole_model
from epl_trainer.core.plan import planner, rules
from epl_trainer.core.plan.ir import Plan, PlanError, StrategySpec

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class EnginePlan:
    """What the engine will run, decided before any state exists.

    Attributes:
      plan: TaskGraphs x replicas x devices, micro-batches and schedule; the one source
        of `num_micro_batch` and the pipeline strategy for everything built later.
      staged: the model cut into one sub-model per stage.
      lanes: this worker's lanes; `lanes_in_job`: every worker's, in lane order.
      lanes_per_worker: how many lanes each worker computes (IO slicing weights).
      split_layers: the layers sharded over a replica's lanes (split annotations).
      data_shards: (number of input shards, each worker's shard): workers holding
        stages of the same replicas read the same batches.
      jit: how the step uses XLA (jit_choice.py).
      user_steps: the step methods the model overrides (user_steps.py): its own steps
        then run on the lanes.
    """

    plan: Plan
    staged: StagedModel
    lanes: list[Lane]
    lanes_in_job: list[Lane]
    lanes_per_worker: list[int]
    split_layers: list
    data_shards: tuple[int, list[int]] = (1, [0])
    jit: jit_choice.JitChoice = jit_choice.NO_XLA
    user_steps: tuple[str, ...] = ()

    def lanes_per_data_shard(self) -> list[int]:
        """IO slicing weights: the lanes each input shard feeds."""
        count, of_worker = self.data_shards
        lanes = [0] * count
        for worker, shard in enumerate(of_worker):
            lanes[shard] = self.lanes_per_worker[worker]
        return lanes


def plan_engine(
    model: keras.Model,
    config,
    devices_by_worker: Sequence[Sequence[str]],
    worker_index: int,
    taskgraphs: Sequence | None = None,
    node_taskgraph: Mapping | None = None,
    loss=None,
    metrics: Sequence = (),
    clip_global_norm: float | None = None,
    steps_per_execution: int = 1,
    jit_compile: bool | str = False,
    gathered: Mapping[str, tuple] | None = None,
    vocabulary: Sequence[str] = (),
    blocks: Sequence = (),
    stage_width: int | None = None,
    staged_pairs: Mapping[str, tuple] | None = None,
) -> EnginePlan:
    """Plans the engine for `model`.

    Args:
      model: the user's built (or functional) Keras model.
      config: the job's `Config`.
      devices_by_worker: `devices_by_worker[w]` lists worker w's compute devices.
      worker_index: this worker.
      taskgraphs, node_taskgraph: the annotation (TaskGraph specs, and each compute
        node's TaskGraph index); None with `auto.auto_parallel`, which cuts the model.
      loss: the trainer's `CompiledLoss` (split outputs need a cross-entropy).
      metrics: the trainer's `CompiledMetrics` (split outputs allow only accuracy).
      clip_global_norm: the optimizer's `global_clipnorm`.
      steps_per_execution: training steps per call of the compiled step.
      jit_compile: True, False or "auto" (jit_choice.py).
      gathered: {variable path: (dimension sliced over each replica's lanes or None,
        dimension sliced over the replicas or None)} of trainable variables held in
        blocks and gathered whole on use (a Keras layout's sharding outside Megatron
        pairs: split/blocks.py).
      vocabulary: paths of Embedding tables held by vocabulary rows over each replica's
        lanes and looked up in place (split/layers.py `_vocab_call`).
      blocks: KerasHub blocks computed on each lane's shares
        (split/decoder_blocks.py `ComputedBlock`).
      stage_width: a Keras mesh's model axis under pipeline stages: every stage runs on
        its own group of this many devices (lane j of a replica holds device j of each
        stage), its sharded variables held and its split layers run there.
      staged_pairs: with `stage_width`, {variable path: (model-axis dimension,
        batch-axis dimension)} of the Megatron pairs a Keras layout makes: computed
        sharded inside one stage, gathered on use when a stage boundary cuts them.
    """
    gathered = dict(gathered or {})
    computed = [k.path for block in blocks for k in block.kernels if k.from_block]
    # split-like: their collectives run in the step
    in_split = [*gathered, *vocabulary, *computed, *(staged_pairs or {})]
    rules.check_config(config)
    auto = None
    if config.auto.auto_parallel:
        auto = auto_partition(model, config.pipeline.num_stages)
        logger.info("Automatic pipeline partition:\n%s", auto.describe())
        taskgraphs, node_taskgraph = auto.taskgraph_specs(), auto.node_stage
    if stage_width is not None:
        taskgraphs = stages_on_mesh(taskgraphs, stage_width)
    plan = planner.build_plan(
        taskgraphs,
        devices_by_worker,
        worker_index,
        num_micro_batch=config.pipeline.num_micro_batch,
        colocate_split_and_replicate=config.cluster.colocate_split_and_replicate,
        prefer_intra_node=config.cluster.device_place_prefer_intra_node,
        pipeline_strategy=config.pipeline.strategy,
        virtual_stages=config.pipeline.virtual_stages,
        stage_costs=auto.stage_costs if auto else None,
        cut_description=auto.cut_description if auto else None,
    )
    user = user_steps.overridden_steps(model)
    rules.check_user_steps(user, plan, config, steps_per_execution, jit_compile)
    if user:  # the user's step runs as written, in plain ops (user_steps.py)
        jit_compile = False
    synchronized = bool(synchronized_layers(model, config.batch_norm.synchronized))
    without_xla = jit_choice.layers_without_xla(model) if jit_compile == jit_choice.AUTO else []
    jit = jit_choice.choose(jit_compile, plan, config, synchronized, without_xla, in_split)
    _announce(jit, chosen_by_user=jit_compile != jit_choice.AUTO)
    rules.check_plan(plan, config, clip_global_norm, steps_per_execution, jit.compile, in_split)
    check_sync_batch_norm(
        model,
        config.batch_norm.synchronized,
        jit.compile,
        split=any(tg.kind == "split" for tg in plan.taskgraphs) or bool(in_split),
    )
    split_layers = []
    # Found on the model's own graph: cutting stages adds calls to the layers.
    pairs = laid_out_pairs(model, staged_pairs) if staged_pairs else []
    if any(tg.kind == "split" for tg in plan.taskgraphs):
        # Colocated TaskGraphs share every device of a lane: one stage, whose split
        # layers run on the lane's shards (split.py).
        staged = whole_model(model)
        split_layers = find_split_layers(
            model, node_taskgraph, plan.taskgraphs, plan.taskgraphs[0].device_count
        )
        num_outputs = len(tree.flatten(model.outputs))
        if not loss.built:  # resolved from the outputs' shapes until the data's are known
            loss.build_from_outputs(model.outputs)
        if not metrics.built:
            metrics.build(model.outputs, model.outputs)
        sparse_outputs(loss.losses_for(num_outputs), split_layers)
        check_split_metrics(metrics, split_layers)
    elif len(plan.taskgraphs) == 1:
        staged = whole_model(model)
    else:
        staged = partition_model(model, node_taskgraph, len(plan.taskgraphs))
    by_worker = [lanes_for_worker(plan, w) for w in range(len(devices_by_worker))]
    width = plan.taskgraphs[0].device_count
    if staged_pairs:
        computed, cut = staged_megatron_pairs(
            model, staged_pairs, pairs, width, _stage_finder(staged)
        )
        split_layers += computed
        gathered.update(cut)
    split_layers += gathered_variables(model, gathered, width, plan.num_replicas)
    losses, metric_pairs = (), ()
    if vocabulary and loss is not None:  # a tied table's logits may be a split output
        if not loss.built:
            loss.build_from_outputs(model.outputs)
        if not metrics.built:
            metrics.build(model.outputs, model.outputs)
        losses = loss.losses_for(len(tree.flatten(model.outputs)))
        metric_pairs = list(metrics)
    split_layers += vocabulary_parallel(model, set(vocabulary), width, losses, metric_pairs)
    split_layers += computed_blocks(model, blocks, width, plan.num_replicas)
    in_job = {lane.index: lane for lanes in by_worker for lane in lanes}  # one view of each
    return EnginePlan(
        plan=plan,
        staged=staged,
        lanes=by_worker[worker_index],
        lanes_in_job=sorted(in_job.values(), key=_index),
        lanes_per_worker=[len(lanes) for lanes in by_worker],
        split_layers=split_layers,
        data_shards=data_shards(by_worker),
        jit=jit,
        user_steps=user,
    )


def _stage_finder(staged: StagedModel):
    """layer -> the first stage whose sub-model holds it."""
    stage_of = {}
    for k, stage in enumerate(staged.stages):
        for layer in stage.model._flatten_layers(include_self=False):
            stage_of.setdefault(id(layer), k)
    return lambda layer: stage_of[id(layer)]


def stages_on_mesh(taskgraphs, width: int) -> list[StrategySpec]:
    """The pipeline stages' TaskGraphs, each on `width` devices (a Keras mesh's model
    axis): what a stage map, stage scopes or `auto.auto_parallel` asked for.

    Raises:
      PlanError: a split TaskGraph, or a stage given another device count than 1 or
        `width`.
    """
    specs = []
    for index, spec in enumerate(taskgraphs):
        name = spec.name or f"stage_{index}"
        if spec.kind != "replicate" or spec.device_count not in (None, 1, width):
            raise PlanError(
                "Under a Keras layout map, pipeline stages run on the mesh's model axis: "
                f"replicate TaskGraphs of 1 or {width} devices. Received: {name} "
                f"({spec.kind}, device_count={spec.device_count})"
            )
        specs.append(StrategySpec("replicate", width, name))
    return specs


_ANNOUNCED: set[str] = set()


def _announce(jit: jit_choice.JitChoice, chosen_by_user: bool) -> None:
    """Logs (INFO) once per process what "auto" chose for XLA, and why.

    Through `logging`, never stdout: `fit(verbose=0)` prints nothing. An absl program
    (`absl.app.run`) shows INFO by default; elsewhere
    `logging.getLogger("epl_trainer").setLevel(logging.INFO)` and a handler
    (`logging.basicConfig()`) show it.
    """
    if chosen_by_user:
        logger.info("XLA: %s", jit.reason)
    elif jit.reason not in _ANNOUNCED:
        _ANNOUNCED.add(jit.reason)
        logger.info("EPLTrainer jit_compile=%s", jit.reason)


def data_shards(by_worker: Sequence[Sequence[Lane]]) -> tuple[int, list[int]]:
    """(how many input shards the job reads, each worker's shard).

    Workers that compute the same lanes (the stages of replicas spanning them) must read
    the same batches; every other worker reads a shard of its own.

    Raises:
      PlanError: when two workers share some lanes but not all (no input split serves
        both).
    """
    shards: list[frozenset] = []
    of_worker = []
    for lanes in by_worker:
        indices = frozenset(lane.index for lane in lanes)
        for other in shards:
            if indices & other and indices != other:
                raise PlanError(
                    "Workers that share a model replica must compute the same replicas, so "
                    f"that they can read the same input. Received lanes per worker: "
                    f"{[sorted(lane.index for lane in w) for w in by_worker]}; change the "
                    "device count per replica or cluster.device_place_prefer_intra_node."
                )
        if indices not in shards:
            shards.append(indices)
        of_worker.append(shards.index(indices))
    return len(shards), of_worker


def _index(lane: Lane) -> int:
    return lane.index


class Engine:
    """A built engine: its steps and its state (checkpoint_content.py saves and restores it)."""

    def __init__(self, engine_plan: EnginePlan, state: EngineState, program: Program):
        self.plan = engine_plan.plan
        self.staged = engine_plan.staged
        self.lanes = engine_plan.lanes
        self.lanes_in_job = engine_plan.lanes_in_job
        self.state = state
        self.program = program
        self.train_on_iterator = program.train_on_iterator
        self.train_on_element = program.train_on_element
        self.train_many_on_iterator = program.train_many_on_iterator
        self.eval_step = program.eval_step
        self.eval_many_on_iterator = program.eval_many_on_iterator
        self.predict_step = program.predict_step
        self.predict_many_on_iterator = program.predict_many_on_iterator
        # The model's optimizer holds the optimizer state between the engine's uses of it
        # (update/master_state.py): the engine starts from it. The model's own steps
        # train that optimizer themselves.
        self.optimizer_state = None
        if not self.runs_user_steps:
            self.optimizer_state = MasterState(
                self.staged.model, self.update, state, self.lanes_in_job
            )
            self.optimizer_state.load()

    @property
    def update(self):
        return self.program.update

    @property
    def recomputed(self) -> dict:
        return self.program.recomputed

    @property
    def last_test_logs(self) -> dict | None:
        """The logs of the model's own test_step at the last evaluation batch, or None."""
        return self.program.last_test_logs

    @property
    def runs_user_steps(self) -> bool:
        """The model's own steps run (user_steps.py): the model and its optimizers hold
        the trained state themselves."""
        return self.program.user_steps is not None

    def write_back(self) -> None:
        """Copies the trained values into the user's Keras model, and the optimizer state
        (slots, moving averages, loss scale) into its optimizer."""
        self.state.write_back()
        if self.optimizer_state is not None:
            self.optimizer_state.write()
        if self.program.user_steps is not None:
            self.program.user_steps.write_optimizer_state()

    def load_from_model(self, optimizer: bool = True) -> None:
        """Copies the Keras model's values into every lane (e.g. after set_weights), and
        (`optimizer`) its optimizer's state into the engine's optimizers."""
        self.state.load_from_model()
        if not optimizer:
            return
        if self.optimizer_state is not None:
            self.optimizer_state.load()
        if self.program.user_steps is not None:
            self.program.user_steps.load_optimizer_state()

    def finalize_ema(self) -> None:
        """With `use_ema=True`: every lane's weights become their moving average."""
        ema.finalize(self.update)

    def check_recompute_gradients(self, features) -> dict:
        """`gradient_checkpoint.check_gradients`: recomputed vs plain gradients, once."""
        if not self.recomputed:
            return {}
        if features is None:
            raise ValueError("gradient_checkpoint.check_gradients needs a batch to compare on.")
        parts = len(self.lanes) * self.plan.num_micro_batch
        micro_batch = tree.map_structure(lambda x: x[: max(1, x.shape[0] // parts)], features)
        return check_stage_gradients(self.staged, self.recomputed, micro_batch)
