"""Engine-owned training state: one copy of the model's variables per compute lane.

The user's Keras model is only used as a pure function (`stateless_call`); the engine
decides where every variable lives. A *lane* is one device per stage of one model
replica: with `replicate(n)` a replica has n lanes that split its micro-batch (EPL
semantics), so every lane holds a full copy of each stage's variables on that stage's
device. Gradients of a stage are reduced over the lane copies of the whole job.

Non-trainable state rule (documented in docs/reference/semantics.md):
* floating-point non-trainable variables (BatchNorm moving statistics) are averaged over
  all lanes after every step, so every copy stays identical;
* random-seed state (Keras `SeedGenerator`) is per lane and offset by the lane's global
  index, so dropout draws a different mask on each lane; lane 0 keeps the model's seed.

Tied weights (a trainable weight several stages use: tied input and output embeddings)
are placed as Megatron-LM places its word embeddings: the first stage using the weight
owns it (`trainable[l][i]`, reduced, clipped and updated there); every other stage using
it holds its own copy on its device (`stage_copies[l][(i, k)]`). Stage k reads its copy;
its gradient is added to the owner's in the lane (pipeline.py), so the gradient reduced,
clipped and applied is the sum over both uses, as on one device; after the update, each
copy is set to the owner's new value (`sync_stage_copies`), so they never diverge.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.common.stateless_scope import StatelessScope

from epl_trainer.core.engine.zero import eager_reads, is_gathered
from epl_trainer.core.graph.partition import StagedModel
from epl_trainer.core.plan.ir import Plan

_SEED_STRIDE = 1_000_003  # a prime: seeds of different lanes never coincide


@dataclasses.dataclass(frozen=True)
class Lane:
    """One compute lane, as seen from one worker: global index, one device per stage.

    A lane whose stages live on several workers (a pipeline replica spanning worker
    processes) is a lane of each of those workers; each computes only its own stages
    (`is_local`) and passes activations and gradients across (pipeline.py).
    """

    index: int  # global lane index in the job
    devices: tuple[str, ...]  # devices[k] hosts stage k
    workers: tuple[int, ...] = ()  # workers[k] holds devices[k]; () = all on `worker`
    worker: int = 0  # the worker this view of the lane belongs to

    def is_local(self, stage: int) -> bool:
        return not self.workers or self.workers[stage] == self.worker

    @property
    def spans_workers(self) -> bool:
        return len(set(self.workers)) > 1


def lanes_for_worker(plan: Plan, worker: int) -> list[Lane]:
    """The lanes with at least one stage on this worker, in global lane order
    (`rules.check_plan` has checked that every TaskGraph has the same width)."""
    width = plan.taskgraphs[0].device_count
    lanes = []
    for replica in range(plan.num_replicas):
        for j in range(width):
            placed = [plan.placement[replica][k][j] for k in range(len(plan.taskgraphs))]
            workers = tuple(d.worker for d in placed)
            if worker in workers:
                lanes.append(
                    Lane(replica * width + j, tuple(d.name for d in placed), workers, worker)
                )
    return lanes


def total_lanes(plan: Plan) -> int:
    return plan.num_replicas * plan.taskgraphs[0].device_count


class EngineState:
    """Per-lane copies of the model's variables, placed on the stage devices.

    Attributes:
      trainable[l][i]: lane l's copy of `model.trainable_variables[i]`.
      non_trainable[l][i]: lane l's copy of `model.non_trainable_variables[i]`.
      trainable_stage[i], non_trainable_stage[i]: the stage that owns variable i.
      tied: {trainable index: the stages using it}, for the weights several stages use.
      stage_copies[l][(i, k)]: lane l's copy of tied weight i for stage k (not its owner).
    """

    def __init__(
        self,
        staged: StagedModel,
        lanes: Sequence[Lane],
        host_device: str | None = None,
        sharded: Mapping[int, object] | None = None,
        own_first_lane: bool = False,
    ):
        """Args:
        own_first_lane: this worker's first lane computes on the model's own variables
          instead of a copy (a model's own train_step: user_steps.py), so the model and
          its optimizer always hold the trained state.
        """
        model = staged.model
        self.lanes = list(lanes)
        self.host_device = host_device
        # Set by the builder when replicas span workers (exchange.py): completes the
        # Keras model with the stages this worker does not hold.
        self.exchange = None
        self.stage_gathers = []  # ZeRO v2 stages across workers (StageGather)
        # Split layers and variables laid out sharded (split/blocks.py): trainable index
        # -> ShardedVariable / LaidOutVariable. Lane l holds block `spec.block_id(l)`.
        self.sharded = dict(sharded or {})
        self._originals: dict[int, keras.Variable] = {}  # id(copy) -> the model's variable
        self.model_trainable = list(model.trainable_variables)
        self.model_non_trainable = list(model.non_trainable_variables)
        stages = _stages_of_variables(staged, self.model_trainable)
        self.trainable_stage = [used[0] for used in stages]
        self.tied = {i: used for i, used in enumerate(stages) if len(used) > 1}
        self.non_trainable_stage = _stage_of_variables(staged, self.model_non_trainable)
        if host_device is None:
            self.trainable = [
                self._copy(lane, self.model_trainable, self.trainable_stage) for lane in self.lanes
            ]
            self.non_trainable = [
                self._copy(lane, self.model_non_trainable, self.non_trainable_stage)
                for lane in self.lanes
            ]
            if own_first_lane:
                self._own_first_lane()
        else:
            self._share_on_host()
        # With offload the one host copy serves every stage (the builder refuses it).
        self.stage_copies = [
            self._stage_copies(lane) if host_device is None else {} for lane in self.lanes
        ]

    def _own_first_lane(self) -> None:
        """The first local lane's copies become the model's variables; its seed state
        takes that lane's seed (only worker 0's first lane keeps the model's own). A
        variable held in blocks keeps the lane's block: the model's variable gets the
        joined value at the write-back."""
        for copies, originals, sharded in (
            (self.trainable[0], self.model_trainable, self.sharded),
            (self.non_trainable[0], self.model_non_trainable, {}),
        ):
            for i, (copy, original) in enumerate(zip(copies, originals)):
                if copy is None or i in sharded:
                    continue
                if is_seed_state(original):
                    original.assign(copy.value)
                self._originals.pop(id(copy), None)
                self._originals[id(original)] = original
                copies[i] = original

    def _stage_copies(self, lane: Lane) -> dict:
        copies = {}
        for i, used in self.tied.items():
            variable = self.model_trainable[i]  # the owner stage may be on another worker
            for stage in used[1:]:
                if lane.is_local(stage):
                    with tf.device(lane.devices[stage]):
                        copies[(i, stage)] = keras.Variable(
                            tf.identity(variable.value), dtype=variable.dtype, name=variable.name
                        )
        return copies

    def stage_variables(self, li: int, stage: int, indices) -> list:
        """Local lane li's variables that stage `stage` reads (its copies of tied ones)."""
        copies = self.stage_copies[li]
        return [copies.get((i, stage), self.trainable[li][i]) for i in indices]

    def sync_stage_copies(self) -> None:
        """Sets every stage copy of a tied weight to its owner's value (after an update,
        a restore or `set_weights`); in a step, ordered after the update by TF's
        automatic control dependencies on the variables."""
        for li, copies in enumerate(self.stage_copies):
            for (i, stage), copy in copies.items():
                with tf.device(self.lanes[li].devices[stage]):
                    copy.assign(self.trainable[li][i].value)

    def _share_on_host(self) -> None:
        """Offload: one copy on the host for all local lanes; compute devices read each
        weight when they use it. Seed state stays per lane (different dropout masks)."""
        first = self.lanes[0]
        host_lane = Lane(first.index, (self.host_device,) * len(first.devices))
        host_stages = [0] * len(self.model_trainable)
        shared = self._copy(host_lane, self.model_trainable, host_stages)
        self.trainable = [shared for _ in self.lanes]
        nt_stages = [0] * len(self.model_non_trainable)
        shared_nt = self._copy(host_lane, self.model_non_trainable, nt_stages)
        self.non_trainable = []
        for lane in self.lanes:
            own = self._copy(
                Lane(lane.index, host_lane.devices), self.model_non_trainable, nt_stages
            )
            self.non_trainable.append(
                [
                    own[i] if is_seed_state(v) else shared_nt[i]
                    for i, v in enumerate(self.model_non_trainable)
                ]
            )

    def _copy(self, lane: Lane, variables, stages) -> list[keras.Variable | None]:
        """Lane copies of `variables` on their stages' devices; None for the variables of
        stages on another worker."""
        copies = []
        for position, (variable, stage) in enumerate(zip(variables, stages)):
            if not lane.is_local(stage):
                copies.append(None)
                continue
            value = variable.value
            if variable.trainable and position in self.sharded:
                value = self._shard_of(position, value, lane)
            if is_seed_state(variable):
                value = seed_of_lane(value, lane.index)
            with tf.device(lane.devices[stage]):
                copy = keras.Variable(
                    tf.identity(value),
                    dtype=variable.dtype,
                    trainable=variable.trainable,
                    name=variable.name,
                )
            if position not in self.sharded or not variable.trainable:
                # The optimizer applies it after each update (Keras's `apply`), as to
                # the user's variable; a shard's is refused (rules.check_constraints).
                copy.constraint = variable.constraint
            self._originals[id(copy)] = variable
            copies.append(copy)
        return copies

    def adopt(self, copy: keras.Variable, original: keras.Variable) -> None:
        """Records that an engine variable made elsewhere (a ZeRO piece) stands for
        `original`, so the user's optimizer settings for it apply (`original_of`)."""
        self._originals[id(copy)] = original

    def hold_in_pieces(self, views: Mapping[int, object], stage_gathers=()) -> None:
        """ZeRO v2 (zero_params.py): trainable variable i is held only as pieces; every
        local lane's copy is replaced by `views[i]`, which gathers them when read (for a
        stage group across workers, `views[i][lane]`, read by `stage_gathers`)."""
        self.stage_gathers = list(stage_gathers)
        for li, lane_vars in enumerate(self.trainable):
            for i, view in views.items():
                if isinstance(view, dict):  # a stage group across workers: one per lane
                    view = view.get(li)
                if view is None or lane_vars[i] is None or lane_vars[i] is view:
                    continue
                self._originals.pop(id(lane_vars[i]), None)
                lane_vars[i] = view
                self._originals[id(view)] = self.model_trainable[i]

    def original_of(self, copy: keras.Variable) -> keras.Variable:
        """The user's model variable that an engine-owned copy (or shard) stands for."""
        return self._originals[id(copy)]

    def stage_indices(self, stage: int, trainable: bool = True) -> list[int]:
        owners = self.trainable_stage if trainable else self.non_trainable_stage
        return [i for i, s in enumerate(owners) if s == stage]

    def synced_non_trainable(self) -> list[int]:
        """Indices of non-trainable variables averaged across lanes (see module doc)."""
        return [
            i
            for i, v in enumerate(self.model_non_trainable)
            if v.dtype.startswith("float") or v.dtype.startswith("bfloat")
        ]

    def _shard_of(self, index: int, value, lane: Lane):
        spec = self.sharded[index]
        return spec.block_of_id(value, spec.block_id(lane.index))

    def local_copy(self, index: int, trainable: bool = True):
        """This worker's first copy of variable `index`, or None if another worker holds
        its stage."""
        return self._first_local_copy(index, trainable)[0]

    def _first_local_copy(self, index: int, trainable: bool = False):
        """(`local_copy(index, trainable)`, the lane holding it), or (None, None)."""
        for lane, copies in zip(self.lanes, self.trainable if trainable else self.non_trainable):
            if copies[index] is not None:
                return copies[index], lane
        return None, None

    def full_value(self, index: int):
        """Trainable variable `index` as the model sees it: sharded ones are joined from
        the lanes of this worker's first replica (laid out over the batch axis too: from
        the replicas'); None if another worker holds it. A variable with blocks on other
        workers (`blocks_elsewhere`) is joined from the blocks held here, zeros for the
        others: the write-back's exchange sums the workers' parts (pipeline/exchange.py)."""
        if index not in self.sharded:
            copy = self.local_copy(index)
            return None if copy is None else copy.value
        spec = self.sharded[index]
        position = {lane.index: p for p, lane in enumerate(self.lanes)}
        holders = spec.holders(self.lanes[0].index)
        local = next(self.trainable[position[h]][index] for h in holders if h in position)
        blocks = [
            self.trainable[position[lane]][index].value
            if lane in position
            else tf.zeros(local.shape, local.dtype)
            for lane in holders
        ]
        with tf.device(self.model_trainable[index].value.device):
            return spec.join(blocks)

    def blocks_elsewhere(self) -> list[int]:
        """Trainable indices held in blocks some of which are on other workers only (a
        Keras layout over a batch axis whose replicas sit on several workers)."""
        if not self.lanes:
            return []
        local = {lane.index for lane in self.lanes}
        first = self.lanes[0].index
        return [i for i, spec in self.sharded.items() if not set(spec.holders(first)) <= local]

    @contextlib.contextmanager
    def gathered_reads(self):
        """Eager reads of ZeRO v2 parameters whose stage group spans workers: every stage
        gathered once, on every worker in the same order (each must enter this block at
        the same point: the write-back, a checkpoint save)."""
        with eager_reads():
            for reads in self.stage_gathers:
                reads.prefetch()
            yield

    def write_back(self) -> None:
        """Copies the first local lane's values (sharded ones joined) into the user's
        Keras model; with replicas spanning workers, then the other workers' stages."""
        with self.gathered_reads():
            for i, target in enumerate(self.model_trainable):
                value = self.full_value(i)
                if value is not None:
                    target.assign(value)
        for i, target in enumerate(self.model_non_trainable):
            source, lane = self._first_local_copy(i)
            if source is None or source is target:  # target: the lane computes on it
                continue
            if is_seed_state(target):
                # The model's seed, the lane's counter: a Keras save of the model
                # (BackupAndRestore, ModelCheckpoint) goes on drawing where training is.
                target.assign(seed_of_lane(source.numpy(), lane.index, sign=-1))
            else:
                target.assign(source.value)
        if self.exchange is not None:
            self.exchange()

    def load_from_model(self) -> None:
        """Copies the Keras model's current values into every lane (e.g. after set_weights)."""
        for lane, lane_vars in zip(self.lanes, self.trainable):
            for i, (target, source) in enumerate(zip(lane_vars, self.model_trainable)):
                if target is None:
                    continue
                value = source.value
                target.assign(self._shard_of(i, value, lane) if i in self.sharded else value)
        for i, source in enumerate(self.model_non_trainable):
            copies = [
                (lane, lane_vars[i]) for lane, lane_vars in zip(self.lanes, self.non_trainable)
            ]
            seed = is_seed_state(source)
            if seed and any(copy is source for _, copy in copies):
                continue  # a lane computes on the model's seed state (own_first_lane)
            for lane, copy in copies:
                if copy is None or copy is source:
                    continue
                if seed:  # e.g. BackupAndRestore's loaded state: each lane its offset
                    copy.assign(seed_of_lane(source.numpy(), lane.index))
                else:
                    copy.assign(source.value)
        self.sync_stage_copies()

    def load_sharded_from_model(self) -> None:
        """Slices the Keras model's values of sharded variables into every lane."""
        for lane, lane_vars in zip(self.lanes, self.trainable):
            for i in self.sharded:
                lane_vars[i].assign(self._shard_of(i, self.model_trainable[i].value, lane))

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of variables per device, from the engine's own state (shared copies once;
        ZeRO v2's gathered stand-ins hold nothing)."""
        usage: dict[str, int] = {}
        seen: set[int] = set()
        stage_copies = [list(copies.values()) for copies in self.stage_copies]
        for lane_vars in self.trainable + self.non_trainable + stage_copies:
            for v in lane_vars:
                if v is None or id(v) in seen or is_gathered(v):
                    continue
                seen.add(id(v))
                device = v.value.device
                usage[device] = usage.get(device, 0) + variable_bytes(v)
        return usage


def variable_bytes(variable) -> int:
    return int(np.prod(variable.shape)) * variable.value.dtype.size


def seed_of_lane(model_seed_state, lane_index: int, sign: int = 1) -> np.ndarray:
    """Lane `lane_index`'s seed state from the model's (or back, with `sign=-1`): the
    seed, element 0, offset by the lane's global index; the counter unchanged."""
    # np.asarray, then a copy: np.array(variable) passes `copy=` to TF's __array__, which
    # does not take it (a DeprecationWarning under numpy 2).
    value = np.asarray(model_seed_state).copy()
    value[0] += sign * lane_index * _SEED_STRIDE
    return value


def is_seed_state(variable) -> bool:
    return "seed_generator_state" in variable.path


def _stages_of_variables(staged: StagedModel, variables) -> list[tuple[int, ...]]:
    """Per variable, the stages whose sub-models use it (stage 0 if none does).

    A layer several stages call holds variables each call may not read: KerasHub's
    untied `ReversibleEmbedding` reads `embeddings` to look tokens up (in the backbone's
    stage) and `reverse_embeddings` for the logits (in the last). A variable in several
    sub-models belongs to the stages whose forward reads it (`_variables_read`), so only
    a weight used by several stages is tied (state.py's module doc)."""
    users: dict[int, list[int]] = {}
    for stage in staged.stages:
        for v in stage.model.variables:
            stages = users.setdefault(id(v), [])
            if stage.index not in stages:
                stages.append(stage.index)
    shared = {id(v) for v in variables if len(users.get(id(v), ())) > 1}
    if shared:
        reads = [_variables_read(stage.model) for stage in staged.stages]
        for key in shared:
            readers = [k for k in users[key] if key in reads[k]]
            users[key] = readers or users[key]
    return [tuple(users.get(id(v), [0])) for v in variables]


class _RecordedReads(StatelessScope):
    """A stateless scope that records which variables are read (and changes none)."""

    def __init__(self):
        super().__init__()
        self.read: set[int] = set()

    def get_current_value(self, variable):
        self.read.add(id(variable))
        return super().get_current_value(variable)


def _variables_read(model) -> set[int]:
    """The ids of the variables a stage's sub-model reads in a training forward, traced
    once on placeholders of its inputs' shapes (nothing runs)."""
    with tf.__internal__.FuncGraph("stage_reads").as_default(), _RecordedReads() as reads:
        inputs = [tf.compat.v1.placeholder(x.dtype, x.shape) for x in model.inputs]
        model(inputs, training=True)
    return reads.read


def _stage_of_variables(staged: StagedModel, variables) -> list[int]:
    owner = {}
    for stage in staged.stages:
        for v in stage.model.variables:  # .weights leaves out SeedGenerator states
            owner.setdefault(id(v), stage.index)
    # Variables no stage uses (e.g. a layer outside the graph) stay with stage 0.
    return [owner.get(id(v), 0) for v in variables]
