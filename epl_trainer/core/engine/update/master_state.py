"""The user's optimizer is the one home of the optimizer state: in before training, back
after it, as the Keras model is of the weights.

The engine trains with copies of the user's optimizer (one per lane and stage, apply
group, ZeRO shard or split shard: training/optimizers.py) whose slots live with their
variables. Keras reads the optimizer of the model, `model.optimizer` (the "master"):
`model.save`, `ModelCheckpoint(save_weights_only=False)`, `BackupAndRestore`, a
`tf.train.Checkpoint` of it, and a later `model.fit` all take its variables. So:

* `load` (the engine's build, `Engine.load_from_model`): every engine slot takes its part
  of the master's slot (a ZeRO piece its elements, a split shard its slice), and every
  engine optimizer the master's update count, so Adam's bias correction, SGD's momentum
  and a learning-rate schedule continue where Keras left them. A master that was never
  built holds no state: the engine keeps its own.
* `write` (`Engine.write_back`: after each epoch and `fit`, before callback hooks that may
  read the model, after every step when a callback may then read it): every master slot
  takes the engine's whole slot, joined from its shards or pieces. A master never built
  is built first, on `model.trainable_variables`, as Keras's `fit` builds it. With
  `use_ema=True` the moving averages are slots too ("average"), so they travel the same
  way (and `SwapEMAWeights`, which swaps the model's weights with the master's averages,
  sees the engine's).
* The master's `iterations` is the engine's step counter already (program.py). The
  engine's optimizers count the updates they applied, fewer after skipped non-finite
  steps: the difference is kept from a write to the next load.
* A `LossScaleOptimizer` around the master (Keras's mixed_float16) holds the engine's
  dynamic loss scale: its `dynamic_scale`, and in `step_counter` the clean steps since
  the scale last changed.

Slots are matched to the master's by their model variable and slot name: the engine's
copies record both as they make each slot (slots.py), and Keras names the master's
`<variable path with "_" for "/">_<slot name>` (`add_variable_from_reference`), in the
order of the variables it is built on, which tells apart the slots of variables sharing a
path (`master_slot`); Adafactor's factored moments are found in its lists
(slots.FACTORED_STATE). A slot the master has no counterpart for is named once in a
warning and left out.

Cost: a write copies the optimizer state once (Adam: twice the weights' bytes), as one
compiled function, about ten times faster than eager ops
(docs/benchmarks.md#optimizer-state-write-back); a write after every step (a callback
with batch hooks that may read the model, docs/reference/semantics.md) pays it every
step. The master
holds the whole state in host memory, as Keras's optimizer does: ZeRO shards the
engine's copy only (docs/reference/memory.md). When some slots live only on
other workers (ZeRO over several workers, a replica's stages on several workers), a
write is one summing all-reduce of the whole optimizer state over the workers' hosts, in
which each part is contributed by the lowest lane holding it: a collective, run at the
same points of `fit` on every worker, as the weights' exchange (pipeline/exchange.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import keras
import tensorflow as tf

from epl_trainer.core import comm
from epl_trainer.core.engine.update.slots import (
    factored_attribute,
    is_factored,
    slot_shape,
    slots_of,
)

logger = logging.getLogger(__name__)

_WARNED: set[tuple] = set()


@dataclasses.dataclass(frozen=True)
class SlotPart:
    """One engine slot variable and the part of the whole slot it holds.

    Attributes:
      variable: the engine's slot variable.
      lane: the global index of the lane holding it.
      owner: the lowest global lane holding the same part (its copy is the one a write
        over several workers sums).
      shard: (block id, the variable's ShardedVariable / LaidOutVariable) for a sharded
        variable's slot (split/blocks.py); None otherwise.
      elements: [start, stop) of the flattened whole slot for a ZeRO piece's; None
        otherwise.
    """

    variable: object
    lane: int
    owner: int
    shard: tuple[int, object] | None = None
    elements: tuple[int, int] | None = None

    @property
    def place(self) -> tuple:
        """Which part of the whole slot: copies of the same part share it."""
        return (None if self.shard is None else self.shard[0], self.elements)

    def of_whole(self, whole: tf.Tensor) -> tf.Tensor:
        """This part's value, cut from the whole slot's."""
        if self.shard is not None:
            block, spec = self.shard
            return spec.block_of_id(whole, block)
        if self.elements is not None:
            start, stop = self.elements
            return tf.reshape(tf.reshape(whole, [-1])[start:stop], self.variable.shape)
        return whole


@dataclasses.dataclass
class SlotParts:
    """The engine's parts of slot `name` of trainable variable `index`."""

    index: int
    name: str
    parts: list[SlotPart]

    def distinct(self, owned_only: bool) -> list[SlotPart]:
        """One part per place (the lowest lane's copy), or only the parts this worker
        owns."""
        chosen: dict[tuple, SlotPart] = {}
        for part in sorted(self.parts, key=lambda p: p.lane):
            if owned_only and part.lane != part.owner:
                continue
            chosen.setdefault(part.place, part)
        return list(chosen.values())


def engine_slots(update, state, lanes_in_job: Sequence) -> list[SlotParts]:
    """Every slot of this worker's engine optimizers, grouped by (variable, slot name).

    Args:
      update: the engine's update (`ReplicatedUpdate` / `ZeroUpdate`, maybe wrapped).
      state: the engine state.
      lanes_in_job: every lane of the job, in lane order.
    """
    copy_of: dict[int, tuple[int, int]] = {}  # id(engine copy) -> (local lane, index)
    for li, lane_vars in enumerate(state.trainable):
        for i, v in enumerate(lane_vars):
            if v is not None:
                copy_of.setdefault(id(v), (li, i))
    piece_spans = update.piece_spans()
    first_lane = lanes_in_job[0].index
    grouped: dict[tuple[int, str], SlotParts] = {}
    for _, optimizer, _ in update.local_optimizers():
        for slot, reference, name in slots_of(optimizer):
            if id(reference) in piece_spans:  # a ZeRO piece: held by one lane only
                position, i, start, stop = piece_spans[id(reference)]
                lane = state.lanes[position].index
                elements = None if start is None else (start, stop)
                part = SlotPart(slot, lane, owner=lane, elements=elements)
            else:
                position, i = copy_of[id(reference)]
                lane = state.lanes[position].index
                if i in state.sharded:
                    spec = state.sharded[i]
                    block = spec.block_id(lane)
                    owner = spec.holder_of_id(block, lanes_in_job[0].index)
                    part = SlotPart(slot, lane, owner=owner, shard=(block, spec))
                else:
                    part = SlotPart(slot, lane, owner=first_lane)
            grouped.setdefault((i, name), SlotParts(i, name, [])).parts.append(part)
    return list(grouped.values())


def joined(parts: Sequence[SlotPart], shape, dtype) -> tf.Tensor:
    """The whole slot from `parts` (one per place), zeros where a part is missing."""
    first = parts[0]
    if first.shard is not None:
        spec = first.shard[1]
        by_block = {p.shard[0]: p.variable.value for p in parts}
        missing = tf.zeros(first.variable.shape, dtype)  # every block has one shape
        return spec.join([by_block.get(k, missing) for k in range(spec.block_count)])
    if first.elements is not None:
        flat, end = [], 0
        for part in sorted(parts, key=lambda p: p.elements[0]):
            start, stop = part.elements
            if start > end:
                flat.append(tf.zeros([start - end], dtype))
            flat.append(tf.reshape(part.variable.value, [-1]))
            end = stop
        total = int(tf.TensorShape(shape).num_elements())
        if end < total:
            flat.append(tf.zeros([total - end], dtype))
        return tf.reshape(tf.concat(flat, axis=0), shape)
    return first.variable.value


def covers_whole(slot: SlotParts, shape) -> bool:
    """Whether this worker's parts of `slot` make the whole slot."""
    parts = slot.distinct(owned_only=False)
    first = parts[0]
    if first.shard is not None:
        return len({p.shard[0] for p in parts}) == first.shard[1].block_count
    if first.elements is not None:
        held = sum(p.elements[1] - p.elements[0] for p in parts)
        return held == tf.TensorShape(shape).num_elements()
    return True


def master_of(model) -> tuple[keras.optimizers.Optimizer | None, object | None]:
    """(the optimizer holding the slots, the `LossScaleOptimizer` around it or None) of
    the model's optimizer."""
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer, optimizer
    return optimizer, None


def build_master(model) -> None:
    """Builds the model's optimizer on `model.trainable_variables` if it is not built, as
    Keras's fit does before training: the engine's state has somewhere to go."""
    master, scaler_holder = master_of(model)
    if master is not None and not master.built:
        (scaler_holder or master).build(model.trainable_variables)
    elif scaler_holder is not None and not scaler_holder.built:
        # A LossScaleOptimizer compiled around an optimizer already built (a model
        # compiled again under a mixed policy): Keras's fit builds the wrapper, whose
        # build leaves the built optimizer inside as it is; its loss scale needs a home.
        scaler_holder.build(model.trainable_variables)


def _slot_prefix(variable) -> str:
    """What Keras's `add_variable_from_reference` names a variable's slots after."""
    return variable.path.replace("/", "_")


def master_slot(master, model_variables: Sequence, position: int, name: str, by_name: dict):
    """The master's slot `name` of `model_variables[position]` (the variables the master
    was built on), or None if it has none.

    `by_name`: the master's variables by name, each name's in the order the master made
    them. Keras names a slot `<prefix>_<slot name>`, and variables may share a prefix
    (two nested models with the same layer names: twin towers, T5's encoder and decoder
    attention-bias tables), so a name may be several slots' name. The master makes each
    slot name's variables in the order of the variables it is built on, so among the
    variables sharing a prefix the k-th (by position) has the k-th slot of that name;
    when the counts differ (not every one of them has such a slot) which is whose is not
    known, and None is returned."""
    attribute = factored_attribute(type(master), name)
    if attribute is not None:
        return getattr(master, attribute)[position]
    prefix = _slot_prefix(model_variables[position])
    found = by_name.get(f"{prefix}_{name}", [])
    sharing = [i for i, v in enumerate(model_variables) if _slot_prefix(v) == prefix]
    if len(found) != len(sharing):
        return None
    return found[sharing.index(position)]


class MasterState:
    """Moves the optimizer state between the engine's optimizers and the model's.

    Args:
      model: the user's Keras model; its `optimizer` is the master.
      update: the engine's update.
      state: the engine state.
      lanes_in_job: every lane of the job, in lane order.
    """

    def __init__(self, model, update, state, lanes_in_job: Sequence):
        self.model = model
        self.update = update
        self.state = state
        # A split shard's factored moment (Adafactor's) is its own part's, not a slice of
        # the whole variable's: no join makes the master's (checkpoints refuse it too).
        self.slots, self.unjoinable = [], []
        for slot in engine_slots(update, state, lanes_in_job):
            if is_factored(slot.name) and slot.index in state.sharded:
                path = state.model_trainable[slot.index].path
                self.unjoinable.append(f"{path} ({slot.name})")
            else:
                self.slots.append(slot)
        self.optimizers = [optimizer for _, optimizer, _ in update.local_optimizers()]
        self.scaler = getattr(update, "scaler", None)
        # Steps the engine's optimizers did not apply (skipped non-finite steps), kept from
        # a write to the next load.
        with tf.init_scope(), tf.device(update.layout.host):
            self.skipped_steps = tf.Variable(0, dtype=tf.int64, trainable=False)
        self.exchanged = update.state_spans_workers
        self._writer = None  # (master, its write function), at the first write
        self._targets = None  # [(SlotParts, the master's slot)], at the first use
        self._targets_of = None  # the master they were found on
        if not self.exchanged:
            for slot in self.slots:
                shape = state.model_trainable[slot.index].shape
                assert covers_whole(slot, shape), (slot.index, slot.name)

    # ---- master -> engine --------------------------------------------------------------

    def load(self) -> None:
        """The engine's optimizers take the master's state (none if it was never built)."""
        master, scaler_holder = master_of(self.model)
        if master is None:
            return
        applied = max(0, int(master.iterations.numpy()) - int(self.skipped_steps.numpy()))
        for optimizer in self.optimizers:
            optimizer.iterations.assign(applied)
        if not master.built:
            return
        for slot, target in self._master_targets(master):
            for part in slot.parts:
                part.variable.assign(part.of_whole(target.value))
        if scaler_holder is not None and scaler_holder.built:
            self._load_loss_scale(scaler_holder)

    def _load_loss_scale(self, holder) -> None:
        variables = getattr(self.scaler, "named_variables", {})
        if "scale" not in variables:  # a fixed scale has nothing to take
            return
        variables["scale"].assign(float(holder.dynamic_scale.numpy()))
        clean = int(holder.step_counter.numpy())
        # The engine grows the scale when (step - last overflow) % window == 0, Keras when
        # its counter of clean steps reaches window - 1: the same clock.
        variables["last_overflow_iter"].assign(int(variables["cur_iter"].numpy()) - 1 - clean)

    # ---- engine -> master --------------------------------------------------------------

    def write(self) -> None:
        """The master takes the engine's state; built first if it never was."""
        master, scaler_holder = master_of(self.model)
        if master is None:
            return
        build_master(self.model)
        if self.unjoinable:
            _warn_once(
                (id(master), "unjoinable"),
                "The factored moments of split variables stay as they are in %s: each split "
                "shard factors its own part, not the whole variable's (%s). EPLTrainer's "
                "own checkpoints refuse them too; an element-wise optimizer (Adam, AdamW, "
                "Lion, ...) travels whole.",
                type(master).__name__,
                self.unjoinable[:5],
            )
        if self._writer is None or self._writer[0] is not master:
            self._writer = (master, self._make_writer(master, scaler_holder))
        self._writer[1]()

    def _make_writer(self, master, scaler_holder):
        """The write as one compiled function: after every step when a callback may read
        the model, ops run one by one cost more than the copies."""
        layout = self.update.layout
        targets = self._master_targets(master)
        exchange = _exchange(layout, master, targets) if self.exchanged else None
        applied = self.optimizers[0].iterations if self.optimizers else None
        scaler = getattr(self.scaler, "named_variables", {})
        holder = scaler_holder if "scale" in scaler else None  # a fixed scale has no state

        @tf.function(autograph=False)
        def write():
            with tf.device(layout.host):
                if exchange is not None:
                    exchange()
                else:
                    done = []
                    for slot, target in targets:
                        # One slot after the other: joined all at once, their temporaries
                        # would add a whole copy of the optimizer state to the peak.
                        with tf.control_dependencies(done):
                            parts = slot.distinct(owned_only=False)
                            done = [target.assign(joined(parts, target.shape, target.dtype))]
                if applied is not None:
                    self.skipped_steps.assign(master.iterations.value - applied.value)
                if holder is not None:
                    holder.dynamic_scale.assign(scaler["scale"].read_value())
                    since = scaler["cur_iter"].read_value() - scaler["last_overflow_iter"]
                    clean = tf.math.floormod(since - 1, self.scaler.window)
                    holder.step_counter.assign(tf.cast(clean, holder.step_counter.dtype))

        return write

    # ---- matching the master's slots -----------------------------------------------------

    def _master_targets(self, master) -> list[tuple[SlotParts, object]]:
        if self._targets_of is master:
            return self._targets
        model_trainable = self.state.model_trainable
        # Built on more variables than the model trains now (a layer frozen since Keras
        # built it) is fine: Keras's optimizer goes on with the slots of the others.
        built_on = {id(v) for v in getattr(master, "_trainable_variables", [])}
        if not all(id(v) in built_on for v in model_trainable):
            _warn_once(
                (id(master), "variables"),
                "%s was built on other variables than the model's trainable ones, so it "
                "cannot hold the engine's optimizer state: model.save and ModelCheckpoint "
                "keep its own. Build it on model.trainable_variables (Keras's fit does).",
                type(master).__name__,
            )
            targets = []
        else:
            targets = self._match(master, model_trainable)
        self._targets, self._targets_of = targets, master
        return targets

    def _match(self, master, model_trainable) -> list[tuple[SlotParts, object]]:
        by_name: dict[str, list] = {}
        for v in master.variables:
            by_name.setdefault(v.name, []).append(v)
        # Positions index the variables the master was built on (its own list: a master
        # built by Keras before may order them otherwise than the model does now).
        built_on = master._trainable_variables
        targets, missing = [], []
        for slot in self.slots:
            variable = model_trainable[slot.index]
            position = master._get_variable_index(variable)
            target = master_slot(master, built_on, position, slot.name, by_name)
            if target is None or list(target.shape) != slot_shape(slot.name, variable.shape):
                missing.append(f"{variable.path} ({slot.name})")
                continue
            targets.append((slot, target))
        if missing:
            _warn_once(
                (id(master), "slots"),
                "%s has no slot matching the engine's for %s: those stay as they are in the "
                "user's optimizer (model.save and ModelCheckpoint do not hold the trained "
                "ones; EPLTrainer's own checkpoints do).",
                type(master).__name__,
                missing[:5],
            )
        return targets


def _exchange(layout, master, targets):
    """A function, to run inside a compiled one, that sums every worker's owned parts
    into its master's variables.

    The sum runs over all the master's variables but its step counter and learning rate,
    in the master's order (the same on every worker, which builds the same master on the
    same model), not over this worker's slots: a worker holding stage 0 only has none of
    stage 1's. A second sum counts the workers contributing to each variable; one no
    worker contributes to (a slot the engine has none of) keeps its value.
    """
    group = comm.CollectiveGroup(tuple(layout.hosts), (layout.host,))
    comm.ordering_token(layout.host)  # made now: made while tracing, it would trace twice
    skip = {id(master.iterations), id(master._learning_rate)}
    variables = [v for v in master.variables if id(v) not in skip]
    parts_of = {id(target): slot for slot, target in targets}
    sizes = [int(tf.TensorShape(v.shape).num_elements()) for v in variables]
    # The contributions' count travels as one more int32 tensor.
    dtypes = [*(v.dtype for v in variables), "int32"]
    buckets = comm.plan_buckets([*sizes, len(variables)], dtypes, 1)

    def exchange():
        values, contributes = [], []
        for v in variables:
            slot = parts_of.get(id(v))
            owned = slot.distinct(owned_only=True) if slot is not None else []
            shape = list(v.shape)
            values.append(joined(owned, shape, v.dtype) if owned else tf.zeros(shape, v.dtype))
            contributes.append(1 if owned else 0)
        values.append(tf.constant(contributes, tf.int32))
        summed = comm.fused_all_reduce(group, [values], buckets, "sum")[0]
        counts = summed[-1]
        for position, (v, value) in enumerate(zip(variables, summed[:-1])):
            v.assign(tf.where(counts[position] > 0, value, v.value))

    return exchange


def _warn_once(key: tuple, message: str, *args) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(message, *args)
