"""What a checkpoint holds, keyed by the user's model, whatever layout trains it.

Entries (the "universal" content, as DeepSpeed's universal checkpoints):

  trainable/<i>             model.trainable_variables[i], whole (split shards joined)
  non_trainable/<i>         model.non_trainable_variables[i] (a seed state as the model's,
                            without the writing lane's offset)
  slot/<i>/<slot name>      the optimizer slot made for trainable variable i, whole,
                            whatever grouping, ZeRO shard or split shard held it
  slot/<i>/<slot name>@elements=<a>:<b>
                            elements [a, b) of that slot (flattened), when ZeRO cut
                            variable i into pieces held by different lanes (the reader
                            joins the pieces)
  trainable/<i>@dim<d>=<a>:<b>, slot/<i>/<slot name>@dim<d>=<a>:<b>
                            the slab [a, b) along dimension d of a variable (or its
                            slot) that a Keras layout lays out over the batch axis when
                            the replicas sit on several workers: each worker writes its
                            replicas' slabs (their model-axis blocks joined), and the
                            reader joins the slabs
  optimizer/iterations      the training step (the user's optimizer's counter)
  optimizer/applied_steps   updates the optimizers applied (less than the step after
                            skipped non-finite steps; Adam's bias correction counts these)
  optimizer/learning_rate   the learning-rate variable, if the optimizer has one
  amp/<name>                the loss scaler's state (`amp.level`)

Saving: each worker writes the entries it *owns* (`owner_lane`, `local_position`);
restoring: each worker reads the entries its own layout needs and assigns them to its
copies, shards and slots (`CheckpointContent.targets`). Slots are found through the
replica optimizers' record of `add_variable_from_reference` (slots.py), so this
works for any Keras optimizer whose per-variable state is made that way, and for
Adafactor's factored moments (`slot/<i>/velocity_row`, `slot/<i>/velocity_col`: shaped
as the variable without its last / second last axis), which slots.py records by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import keras
import numpy as np
import tensorflow as tf

from epl_trainer.core.engine.state import Lane, is_seed_state, seed_of_lane
from epl_trainer.core.engine.update import is_factored, slot_shape, slots_of, unrecorded_state


@dataclasses.dataclass
class Entry:
    """One checkpoint entry this worker writes: `read()` gives its whole value."""

    key: str
    name: str  # readable: the variable path, slot name
    read: Callable[[], tf.Tensor]


@dataclasses.dataclass
class Target:
    """A variable of this worker that an entry fills: `variable.assign(place(value))`."""

    variable: object
    place: Callable[[np.ndarray], object]


@dataclasses.dataclass
class Expected:
    """What this worker needs of an entry: its whole shape and dtype, and where it goes."""

    name: str
    shape: list[int]
    dtype: str
    targets: list[Target]
    optional: bool = False  # kept as it is when the checkpoint lacks it (e.g. AMP state)


def owner_lane(lanes_in_job: Sequence[Lane], owner_device: str | None, stage: int) -> Lane:
    """The lane whose copy of an entry is saved: the lowest global lane, or, for state
    only one lane holds (a ZeRO shard's slots), the lane whose stage device is
    `owner_device`. Deterministic on every worker, so each entry has one writer."""
    if owner_device is None:
        return lanes_in_job[0]
    return next(lane for lane in lanes_in_job if lane.devices[stage] == owner_device)


def local_position(local_lanes: Sequence[Lane], lane: Lane, stage: int) -> int | None:
    """This worker's position of `lane` if it holds that lane's copy of `stage` here.

    A lane whose stages span workers is a lane of each of them; only the worker holding
    the stage answers."""
    for li, local in enumerate(local_lanes):
        if local.index == lane.index and local.is_local(stage):
            return li
    return None


PIECE_MARK = "@elements="  # slot/<i>/<name>@elements=<a>:<b>: a ZeRO piece of a slot
SLAB_MARK = "@dim"  # <entry>@dim<d>=<a>:<b>: a slab along dimension d (batch-axis blocks)


def entry_of(key: str) -> str:
    """The whole entry a saved key holds (itself, or the entry a piece or slab is of)."""
    return key.split(PIECE_MARK)[0].split(SLAB_MARK)[0]


def slab_key(entry: str, dim: int, start: int, stop: int) -> str:
    return f"{entry}{SLAB_MARK}{dim}={start}:{stop}"


def _whole(value):
    return value


def _piece_placer(start: int, stop: int, shape) -> Callable:
    """Elements [start, stop) of a whole value, in a piece variable's shape."""
    return lambda value: np.reshape(np.reshape(value, [-1])[start:stop], shape)


class CheckpointContent:
    """The checkpoint entries of one built engine (this worker's part of the job)."""

    def __init__(self, engine, optimizer, is_chief: bool):
        self.state = engine.state
        self.update = engine.update
        self.lanes_in_job = list(engine.lanes_in_job)
        self.optimizer = optimizer
        self.is_chief = is_chief
        self.slot_owners = self.update.slot_owners()
        # id(ZeRO piece variable) -> (local lane position, trainable index, rows a, b)
        self._piece_spans = getattr(self.update, "piece_spans", dict)()
        # id(engine copy or shard) -> (local lane position, trainable index)
        # Trainables held in blocks some of which are only on other workers: saved as
        # this worker's slabs.
        self._elsewhere = set(self.state.blocks_elsewhere())
        self._copy_of = {}
        for li, lane_vars in enumerate(self.state.trainable):
            for i, v in enumerate(lane_vars):
                if v is not None:  # None: a stage on another worker
                    self._copy_of.setdefault(id(v), (li, i))

    # ---- saving -------------------------------------------------------------------------

    def entries_to_write(self) -> list[Entry]:
        """The entries this worker owns, in a fixed order."""
        state = self.state
        entries = []
        for i, v in enumerate(state.model_trainable):
            if i in self._elsewhere:
                entries += self._slabs(f"trainable/{i}", v.path, i, state.trainable)
                continue
            read = self._owned_read(i, state.trainable_stage[i], state.trainable)
            if read is not None:
                entries.append(Entry(f"trainable/{i}", v.path, read))
        for i, v in enumerate(state.model_non_trainable):
            read = self._owned_non_trainable(i)
            if read is not None:
                entries.append(Entry(f"non_trainable/{i}", v.path, read))
        entries += self._owned_slots()
        if self.is_chief:
            entries += [Entry(k, name, lambda v=v: _read(v)) for k, (name, v) in self._globals()]
        return entries

    def _owner(self, i: int, stage: int, owner_device=None) -> tuple[Lane, int | None]:
        lane = owner_lane(self.lanes_in_job, owner_device, stage)
        return lane, local_position(self.state.lanes, lane, stage)

    def _owned_read(self, i: int, stage: int, copies) -> Callable | None:
        """Reads trainable i whole from the owner lane's copy (and its replica's shards)."""
        _, li = self._owner(i, stage)
        if li is None:
            return None
        if i not in self.state.sharded:
            return lambda: copies[li][i].value
        spec = self.state.sharded[i]
        shards = self._holder_positions(li, spec)
        return lambda: spec.join([copies[p][i].value for p in shards])

    def _slabs(self, key: str, name: str, i: int, copies) -> list[Entry]:
        """Trainable i's slabs of this worker's replicas (`copies[p][i]`: local lane p's
        block)."""
        spec = self.state.sharded[i]
        parts = spec.width if spec.model_axis is not None else 1
        position = {lane.index: p for p, lane in enumerate(self.state.lanes)}
        by_replica = {
            replica: [copies[position[replica * spec.width + rank]][i] for rank in range(parts)]
            for replica in {lane.index // spec.width for lane in self.state.lanes}
        }
        return self._slab_entries(key, name, i, by_replica)

    def _slab_entries(self, key: str, name: str, i: int, by_replica: dict) -> list[Entry]:
        """One entry per replica: the slab along trainable i's batch-axis dimension that
        its variables (its model-axis blocks, or their slots, in rank order) make."""
        spec = self.state.sharded[i]
        rows = int(self.state.model_trainable[i].shape[spec.batch_axis]) // spec.replicas
        entries = []
        for replica, held in sorted(by_replica.items()):

            def read(held=held):
                blocks = [v.value for v in held]
                return tf.concat(blocks, spec.model_axis) if len(blocks) > 1 else blocks[0]

            start = replica * rows
            slab = slab_key(key, spec.batch_axis, start, start + rows)
            entries.append(Entry(slab, f"{name} (rows {start}:{start + rows})", read))
        return entries

    def _holder_positions(self, li: int, spec) -> list[int]:
        """Local positions of the lanes holding `spec`'s blocks that lane li joins with,
        by block id."""
        lanes = self.state.lanes
        position = {lane.index: p for p, lane in enumerate(lanes)}
        holders = spec.holders(lanes[li].index)
        assert all(h in position for h in holders), "a sharded variable's lanes are local"
        return [position[h] for h in holders]

    def _owned_non_trainable(self, i: int) -> Callable | None:
        lane, li = self._owner(i, self.state.non_trainable_stage[i])
        if li is None:
            return None
        variable = self.state.non_trainable[li][i]
        if is_seed_state(variable):
            return lambda: tf.constant(seed_of_lane(variable.numpy(), lane.index, sign=-1))
        return lambda: variable.value

    def _owned_slots(self) -> list[Entry]:
        """Slots of the variables whose owner lane is local, joined across split shards."""
        by_key: dict[str, list] = {}
        applied = self._applied_steps_owner()
        applied_read = None
        for li, optimizer, _ in self.update.local_optimizers():
            lane = self.state.lanes[li]
            # One writer: the owner lane's copy on the worker holding the owner stage (a
            # lane spanning workers is a lane of each of them).
            if applied and lane.index == applied[0] and lane.is_local(applied[1]):
                applied_read = optimizer.iterations if applied_read is None else applied_read
            self._check_slots_recorded(optimizer)
            for slot, reference, name in slots_of(optimizer):
                if id(reference) in self._piece_spans:  # held by this lane only
                    lane_position, i, start, stop = self._piece_spans[id(reference)]
                    # ZeRO cuts only element-wise optimizers' variables (zero_layout.py).
                    assert start is None or not is_factored(name), name
                    rows = "" if start is None else f"{PIECE_MARK}{start}:{stop}"
                    key = f"slot/{i}/{name}{rows}"
                    by_key[key] = [(self.state.lanes[lane_position].index, slot, i)]
                    continue
                lane_position, i = self._copy_of[id(reference)]
                self._check_factored_whole(optimizer, i, name)
                stage = self.state.trainable_stage[i]
                owner, _ = self._owner(i, stage, self.slot_owners.get(i))
                lane = self.state.lanes[lane_position]
                if i in self.state.sharded:  # the owner joins with the lowest holders
                    spec = self.state.sharded[i]
                    holder = spec.holder_of_id(spec.block_id(lane.index), owner.index)
                    mine = lane.index == holder
                else:
                    mine = lane.index == owner.index
                if mine:
                    by_key.setdefault(f"slot/{i}/{name}", []).append((lane.index, slot, i))
        entries = []
        for key, held in by_key.items():
            held.sort(key=lambda item: item[0])
            i = held[0][2]
            if i in self._elsewhere:  # this worker's replicas' slabs
                entries += self._slot_slabs(key, held, i)
                continue
            slots = [slot for _, slot, _ in held]
            slot_name, _, span = key.split("/", 2)[2].partition(PIECE_MARK)
            span = f", elements {span}" if span else ""
            path = f"{self.state.model_trainable[i].path} ({slot_name}{span})"
            if i in self.state.sharded:  # held by lane index: block id order
                spec = self.state.sharded[i]
                read = lambda slots=slots, spec=spec: spec.join([s.value for s in slots])  # noqa: E731
            else:
                read = lambda slot=slots[0]: slot.value  # noqa: E731
            entries.append(Entry(key, path, read))
        if applied_read is not None:
            entries.append(
                Entry("optimizer/applied_steps", "updates applied", lambda: applied_read.value)
            )
        return entries

    def _slot_slabs(self, key: str, held: list, i: int) -> list[Entry]:
        """A slot's slabs, one per local replica (`held`: (lane, slot, i) by lane)."""
        spec = self.state.sharded[i]
        by_replica: dict[int, list] = {}
        for lane_index, slot, _ in held:
            by_replica.setdefault(lane_index // spec.width, []).append(slot)
        path = f"{self.state.model_trainable[i].path} ({key.split('/', 2)[2]})"
        return self._slab_entries(key, path, i, by_replica)

    def _applied_steps_owner(self) -> tuple[int, int] | None:
        """(lane, stage): the lowest global lane that holds an optimizer (ZeRO: owns some
        variable), and the stage of that optimizer."""
        if not self.state.model_trainable:
            return None
        stages = self.state.trainable_stage
        if not self.slot_owners:
            return self.lanes_in_job[0].index, min(stages)
        return min(
            (owner_lane(self.lanes_in_job, device, stages[i]).index, stages[i])
            for i, device in self.slot_owners.items()
        )

    def _check_slots_recorded(self, optimizer) -> None:
        unrecorded = unrecorded_state(optimizer)
        if unrecorded:
            raise ValueError(
                f"{type(optimizer).__name__} keeps state that is not made per variable with "
                "`add_variable_from_reference`, so a checkpoint cannot key it by model "
                f"variable (and restore it into another layout). Received: "
                f"{[v.path for v in unrecorded][:5]}"
            )

    def _check_factored_whole(self, optimizer, i: int, name: str) -> None:
        """A factored slot (Adafactor's row / column moment) is saved as the whole
        variable's; a split shard's is its own part's (its row moment averages only the
        shard's columns), which no join turns into the whole variable's."""
        if is_factored(name) and i in self.state.sharded:
            raise ValueError(
                f"{type(optimizer).__name__}'s factored moments of a split variable "
                f"({self.state.model_trainable[i].path}) cannot be checkpointed: each "
                "split shard factors its own part, not the whole variable's. Checkpoint "
                f"{type(optimizer).__name__} without `split` (data parallel, ZeRO, "
                "pipelines), or use an element-wise optimizer (Adam, AdamW, Lion, ...) "
                "with `split`."
            )

    def _globals(self) -> list[tuple[str, tuple[str, object]]]:
        """Entries every worker holds identically: the chief writes them."""
        items = [("optimizer/iterations", ("training step", self.optimizer.iterations))]
        if isinstance(self.optimizer._learning_rate, keras.Variable):
            items.append(
                ("optimizer/learning_rate", ("learning rate", self.optimizer._learning_rate))
            )
        scaler = getattr(self.update, "scaler", None)
        if scaler is not None:
            for name, v in scaler.named_variables.items():
                items.append((f"amp/{name}", (f"loss scaler {name}", v)))
        return items

    # ---- restoring ----------------------------------------------------------------------

    def expected(self) -> dict[str, Expected]:
        """{key: Expected} for every entry this worker's layout needs."""
        state, needed = self.state, {}

        def add(key, name, model_variable_or_shape, dtype, target):
            shape = list(getattr(model_variable_or_shape, "shape", model_variable_or_shape))
            entry = needed.setdefault(key, Expected(name, shape, dtype, []))
            if all(t.variable is not target.variable for t in entry.targets):
                entry.targets.append(target)

        for li, lane in enumerate(state.lanes):
            for i, v in enumerate(state.model_trainable):
                if state.trainable[li][i] is None:  # a stage on another worker
                    continue
                place = self._shard_placer(i, lane)
                add(f"trainable/{i}", v.path, v, v.dtype, Target(state.trainable[li][i], place))
            for i, v in enumerate(state.model_non_trainable):
                if state.non_trainable[li][i] is None:
                    continue
                place = _whole
                if is_seed_state(v):
                    place = lambda value, index=lane.index: seed_of_lane(value, index)  # noqa: E731
                target = Target(state.non_trainable[li][i], place)
                add(f"non_trainable/{i}", v.path, v, v.dtype, target)
        applied = []
        for li, optimizer, _ in self.update.local_optimizers():
            self._check_slots_recorded(optimizer)
            applied.append(Target(optimizer.iterations, _whole))
            for slot, reference, name in slots_of(optimizer):
                if id(reference) in self._piece_spans:
                    _, i, start, stop = self._piece_spans[id(reference)]
                    place = _whole if start is None else _piece_placer(start, stop, slot.shape)
                else:
                    _, i = self._copy_of[id(reference)]
                    self._check_factored_whole(optimizer, i, name)
                    place = self._shard_placer(i, state.lanes[li])
                model_variable = state.model_trainable[i]
                path = f"{model_variable.path} ({name})"
                shape = slot_shape(name, model_variable.shape)
                add(f"slot/{i}/{name}", path, shape, slot.dtype, Target(slot, place))
        if applied:
            needed["optimizer/applied_steps"] = Expected("updates applied", [], "int64", applied)
        for key, (name, v) in self._globals():
            add(key, name, v, v.dtype, Target(v, _whole))
            needed[key].optional = key != "optimizer/iterations"
        return needed

    def unexpected(self, saved_keys, expected: dict[str, Expected]) -> list[str]:
        """Saved entries this layout would have to hold but has no place for: a bigger
        model, or slots of another optimizer for the variables this worker updates.
        Variables of stages on other workers are not this worker's to hold."""
        updated = {
            str(self._index_of(v))
            for _, _, variables in self.update.local_optimizers()
            for v in variables
        }
        in_model = {
            "trainable": len(self.state.model_trainable),
            "non_trainable": len(self.state.model_non_trainable),
        }
        extra = []
        for key in saved_keys:
            kind, _, rest = key.partition("/")
            if key in expected or entry_of(key) in expected:
                continue
            if kind in in_model:
                if not rest.isdigit() or int(rest) >= in_model[kind]:
                    extra.append(key)
            elif kind == "slot" and rest.split("/")[0] in updated:
                extra.append(key)
        return extra

    def _index_of(self, variable) -> int:
        """The trainable index an engine copy, split shard or ZeRO piece stands for."""
        held = self._piece_spans.get(id(variable)) or self._copy_of[id(variable)]
        return held[1]

    def _shard_placer(self, i: int, lane: Lane) -> Callable:
        if i not in self.state.sharded:
            return _whole
        spec = self.state.sharded[i]
        return lambda value: spec.block_of_id(tf.constant(value), spec.block_id(lane.index))

    def assign(self, values: dict, expected: dict[str, Expected]) -> None:
        """Assigns every read entry to its targets; then the Keras model gets the result."""
        for key, entry in expected.items():
            if key not in values:
                continue
            for target in entry.targets:
                target.variable.assign(target.place(values[key]))
        self.state.sync_stage_copies()  # tied weights: one entry, every stage's copy
        self.state.write_back()


def _read(variable):
    # The loss scaler's state is plain tf.Variables, whose `value` is a method.
    return variable.value if isinstance(variable, keras.Variable) else variable.read_value()
