"""A model's own `train_step`, `test_step`, `predict_step`, `compute_loss` and
`compute_metrics`, run on every data-parallel lane as Keras's `MirroredStrategy` runs them.

A model that overrides one of these methods (a GAN, a VAE, a distillation or contrastive
model, the pattern of Keras's guide "Customizing what happens in fit()") says what a step
is; the engine's own step would train something else. So the step becomes the user's
method, called once per lane on the lane's rows:

* **Variables.** Lane 0 of each worker computes on the model's own variables; every other
  lane on the engine's copy (state.py). The user's code reads `self.trainable_variables`
  and records them on its own tape, so for the time a lane's step is *traced* each model
  variable is backed by that lane's `tf.Variable` (`_lane_storage`): what TensorFlow's
  `MirroredVariable` does by replica context, done here by trace. Keras's stateless
  scope cannot serve: on TensorFlow a tape records reads of the variable's handle, which
  a scope's substituted value is not.
* **Updates.** Every `apply` / `apply_gradients` of an optimizer the model holds (its
  `optimizer`, and any other optimizer attribute: a GAN's two) first reduces the gradients
  over all lanes of the job, each lane's weighted by its share of the global batch's rows,
  so a mean loss per lane gives the single-device gradient of the global batch, uneven
  lanes included. Lane 0 then applies them with the user's optimizer itself (its slots,
  iterations and moving averages stay the real ones: `model.save` and Keras's callbacks
  see them current), every other lane with a copy of that optimizer on its own variables.
  All lanes apply the same reduced gradients, so the copies never diverge.
* **Metrics** are shared by the lanes (one set of variables on the host): each lane's
  `update_state` adds its rows, so after the step the metrics hold the global batch as on
  one device. A returned value read from a metric is taken from the last lane (which reads
  after every lane's update, so it covers this worker's rows); any other returned value
  (a loss tensor) is the row-weighted mean over every lane of the job, the same on every
  worker, as Keras's `reduce_per_replica` means them.
* **Non-trainable floats** (BatchNorm's moving statistics) are averaged over the lanes
  after the step, as in the engine's own step.

* **Variables held in blocks** (a Keras layout map: `ModelParallel`, KerasHub's
  `get_layout_map`): each lane holds its block (split/blocks.py), as under the engine's
  own step. While a lane's step is traced, such a variable is backed by `_GatheredRead`:
  a read gathers the whole value from the lanes' blocks, and the tape records the read
  of the lane's block, so `tape.gradient(loss, model.trainable_variables)` gives the
  block's gradient, summed over every lane of the job by the gather's adjoint (each
  lane's upstream weighted by its row share first: the same sum `_reduce` makes). The
  lanes' optimizers are all copies of the user's (lane 0's too: it holds blocks), and
  the user's optimizer takes their state, blocks joined, at every write-back
  (`write_optimizer_state`), its `iterations` after every step. The user's code runs
  as written, so the engine's sharded computations (Megatron pairs, KerasHub blocks,
  vocabulary-parallel lookups) do not apply: every sharded variable is gathered on use.

Only data parallelism (with those layouts) runs a user's step: layouts that cut the
model or its update (pipeline stages, split layers, ZeRO, offload, micro-batches, the
engine's AMP, gradient checkpointing) are refused by name (core/plan/rules.py,
`check_user_steps`).
"""

from __future__ import annotations

import contextlib
import itertools

import keras
import tensorflow as tf
from keras import tree

from epl_trainer.core import comm
from epl_trainer.core.comm.keys import next_instance_key, ordering_token
from epl_trainer.core.engine import split
from epl_trainer.core.engine.lane_order import traced_as_lane
from epl_trainer.core.engine.step_batch import unpack_element
from epl_trainer.core.engine.update import is_factored, recording_class, slots_of

# The methods whose override makes the step the user's (keras.Model's own are Keras's
# default step, which the engine computes itself).
STEP_METHODS = ("train_step", "test_step", "predict_step", "compute_loss", "compute_metrics")


def overridden_steps(model) -> tuple[str, ...]:
    """The step methods `model`'s class overrides (empty for Keras's defaults)."""
    if not isinstance(model, keras.Model):
        return ()
    return tuple(
        name
        for name in STEP_METHODS
        if getattr(type(model), name, None) is not getattr(keras.Model, name)
    )


def model_optimizers(model) -> list:
    """The optimizers a model holds as attributes (`optimizer`, a GAN's `d_optimizer`...),
    each once, in attribute order."""
    found = {}
    for value in [getattr(model, "optimizer", None), *vars(model).values()]:
        if isinstance(value, keras.optimizers.Optimizer):
            found.setdefault(id(value), value)
    return list(found.values())


def finalize_moving_averages(model) -> None:
    """As Keras's fit ends: each optimizer with `use_ema=True` of a model running its own
    steps (it holds its own moving averages) sets the weights to their averages."""
    for optimizer in model_optimizers(model):
        if getattr(optimizer, "use_ema", False):
            optimizer.finalize_variable_values(model.trainable_weights)


@contextlib.contextmanager
def _lane_storage(pairs):
    """Backs each Keras variable of `pairs` [(keras.Variable, tf.Variable)] by the given
    `tf.Variable` for the block (see the module doc); always restored."""
    saved = [(variable, variable._value) for variable, _ in pairs]
    try:
        for variable, storage in pairs:
            variable._value = storage
        yield
    finally:
        for variable, storage in saved:
            variable._value = storage


class _GatheredRead:
    """A lane's storage of a variable held in blocks, while the lane's step is traced
    (module doc): reads give the whole value, gathered from the lanes' blocks; the
    tape sees the block's handle, so gradients are the block's."""

    def __init__(self, block: tf.Variable, read_whole, cut, original: tf.Variable):
        self._block = block
        self._read_whole = read_whole  # () -> the whole value, gathered
        self._cut = cut  # whole value -> this lane's block
        self._original = original  # the model variable's own storage

    @property
    def handle(self):
        return self._block.handle

    @property
    def _unique_id(self):
        """The user's optimizer keys its per-variable settings (weight decay exclusions)
        by the model variable's own storage."""
        return self._original._unique_id

    @property
    def dtype(self):
        return self._block.dtype

    def __tf_tensor__(self, dtype=None, name=None):
        return tf.convert_to_tensor(self._read_whole(), dtype=dtype, name=name)

    def read_value(self):
        return self._read_whole()

    def value(self):
        return self._read_whole()

    def assign(self, value, **kwargs):
        """The user's step assigned the whole variable: this lane keeps its block."""
        return self._block.assign(self._cut(tf.convert_to_tensor(value, self._block.dtype)))


def _weighted_upstream(whole, share):
    """`whole`, whose gradient is multiplied by `share` (a lane's row share, 0 for a
    lane without rows even when its loss is NaN) before the gather's adjoint sums the
    lanes'."""

    @tf.custom_gradient
    def weigh(x):
        def grad(upstream):
            if isinstance(upstream, tf.IndexedSlices):
                values = tf.math.multiply_no_nan(upstream.values, tf.cast(share, x.dtype))
                return tf.IndexedSlices(values, upstream.indices, upstream.dense_shape)
            return tf.math.multiply_no_nan(upstream, tf.cast(share, upstream.dtype))

        return tf.identity(x), grad

    return weigh(whole)


def _row_ranges(rows, num_lanes: int):
    """[(start, end)] of each lane's rows: as even as the batch allows, in order."""
    bounds = [(rows * i) // num_lanes for i in range(num_lanes + 1)]
    return list(itertools.pairwise(bounds))


def _take_rows(data, start, end):
    def take(x):
        if x is None or not hasattr(x, "shape") or x.shape.rank == 0:
            return x
        return x[start:end]

    return tree.map_structure(take, data)


def _element(features, labels, sample_weight):
    """The batch as Keras hands it to a step: (x, y) or (x, y, sample_weight)."""
    return (features, labels) if sample_weight is None else (features, labels, sample_weight)


def _first_rows(data):
    first = next(x for x in tree.flatten(data) if x is not None and hasattr(x, "shape"))
    return tf.shape(first)[0]


class _LaneReduction:
    """The reductions one step's lanes issue at each optimizer apply: the t-th of every
    lane shares an instance key (allocated by the first lane traced), as the members of
    one collective must."""

    def __init__(self, group: comm.CollectiveGroup):
        self.group = group
        self._keys: list[int] = []
        self._issued: dict[int, int] = {}

    def begin_trace(self) -> None:
        self._keys, self._issued = [], {}

    def sum(self, position: int, device: str, value):
        """`value` (on `device`, lane `position`'s) summed over every lane of the job."""
        if self.group.size == 1:
            return value
        t = self._issued.get(position, 0)
        self._issued[position] = t + 1
        if t == len(self._keys):
            self._keys.append(next_instance_key(self.group.key))
        with tf.device(device):
            return tf.raw_ops.CollectiveReduceV2(
                input=value,
                group_size=self.group.size,
                group_key=self.group.key,
                instance_key=self._keys[t],
                ordering_token=[ordering_token(device, 0)],
                merge_op="Add",
                final_op="Id",
                communication_hint="auto",
            )


class UserSteps:
    """The model's own steps on this worker's lanes (module doc).

    Args:
      model: the user's model.
      state: the engine state; `state.trainable[0]` / `non_trainable[0]` are the model's
        own variables (`EngineState(own_first_lane=True)`).
      lanes: this worker's lanes (one device each).
      group: the collective group of every lane of the job.
      host: this worker's host device (the metrics live there).
      store_non_trainable: averages lanes' float non-trainable values and assigns them
        (`Program._store_non_trainable`).
      runtime: the split runtime (split/layers.py `SplitRuntime`: each lane's
        collectives) when a Keras layout holds variables in blocks (`state.sharded`),
        else None.
    """

    def __init__(self, model, state, lanes, group, host, store_non_trainable, runtime=None):
        self.model = model
        self.state = state
        self.lanes = list(lanes)
        self.host = host
        self._store_non_trainable = store_non_trainable
        self._reduction = _LaneReduction(group)
        self._index = {id(v): i for i, v in enumerate(state.model_trainable)}
        # (id(user optimizer), lane position) -> (that lane's copy of it, the pairs of
        # (user's variable, the copy's, the cut of the user's value the copy holds: None
        # for the whole) that hold state: all but the shared learning rate).
        self._replicas: dict[tuple[int, int], tuple] = {}
        self._optimizers = model_optimizers(model)
        self._applying = False  # inside a reduced apply (a wrapper's inner optimizer)
        self._runtime = runtime
        self._sharded = dict(state.sharded) if runtime is not None else {}
        # (model variable, its own storage) of the variables held in blocks.
        self._own_storage = [
            (state.model_trainable[i], state.model_trainable[i]._value) for i in self._sharded
        ]
        if state.sharded and runtime is None:
            raise ValueError("Variables held in blocks need the split runtime (internal error).")
        if state.blocks_elsewhere():
            raise ValueError(
                "A model's own train_step with a Keras layout whose blocks sit on other "
                "workers (sharded over a batch axis that spans workers) is not trained in this "
                "version. Received: variables "
                f"{[state.model_trainable[i].path for i in state.blocks_elsewhere()][:4]}; lay "
                "them out over the model axis only, or train on one worker."
            )
        # Variables sliced over a replica's lanes only: their gather's adjoint sums the
        # replica's lanes, and these groups (the lanes of one rank in every replica) the
        # replicas'.
        self._rank_reductions = {}
        if any(not spec.summed_over_job for spec in self._sharded.values()):
            width = runtime.width
            for rank in sorted({lane.index % width for lane in self.lanes}):
                members = tuple(d for p, d in enumerate(group.devices) if p % width == rank)
                local = tuple(lane.devices[0] for lane in self.lanes if lane.index % width == rank)
                self._rank_reductions[rank] = _LaneReduction(comm.CollectiveGroup(members, local))

    # ---- lanes' storage ----------------------------------------------------------------

    def _variable_pairs(self, li: int) -> list:
        state = self.state
        pairs = []
        for originals, copies, sharded in (
            (state.model_trainable, state.trainable[li], self._sharded),
            (state.model_non_trainable, state.non_trainable[li], {}),
        ):
            pairs.extend(
                (original, copy._value)
                for i, (original, copy) in enumerate(zip(originals, copies))
                if copy is not None and copy is not original and i not in sharded
            )
        return pairs

    def _optimizer_pairs(self, li: int) -> list:
        pairs = []
        for optimizer in self._optimizers:
            _, state_pairs = self._replicas.get((id(optimizer), li), (None, ()))
            pairs.extend((mine, theirs._value) for mine, theirs, cut in state_pairs if cut is None)
        return pairs

    def _gathered_pairs(self, li: int, share) -> list:
        """(the model's variable, a `_GatheredRead` of lane li's block) for each variable
        held in blocks."""
        device = self.lanes[li].devices[0]
        runtime = self._runtime
        lane_comm = runtime.comms[li][0]  # a model's own steps run as one stage
        batch_comm = runtime.batch_comms[li][0] if runtime.batch_comms else None
        pairs = []
        for i, spec in self._sharded.items():
            block = self.state.trainable[li][i]._value

            def read_whole(block=block, spec=spec):
                with tf.device(device):
                    value = tf.convert_to_tensor(block)  # the tape records this read
                    whole = split.gather_whole(value, spec, lane_comm, batch_comm)
                    return _weighted_upstream(whole, share)

            def cut(whole, spec=spec, lane=self.lanes[li].index):
                return spec.block_of_id(whole, spec.block_id(lane))

            variable = self.state.model_trainable[i]
            pairs.append((variable, _GatheredRead(block, read_whole, cut, variable._value)))
        return pairs

    @contextlib.contextmanager
    def _on_lane(self, li: int, share):
        """Lane li's variables, device and reducing optimizers for the block."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(tf.device(self.lanes[li].devices[0]))
            stack.enter_context(traced_as_lane(li))  # its asserts wait for its own alone
            if li > 0:
                stack.enter_context(_lane_storage(self._variable_pairs(li)))
                stack.enter_context(_lane_storage(self._optimizer_pairs(li)))
            if self._sharded:
                stack.enter_context(_lane_storage(self._gathered_pairs(li, share)))
            for optimizer in self._optimizers:
                stack.enter_context(self._reducing(optimizer, li, share))
            yield

    @contextlib.contextmanager
    def _reducing(self, optimizer, li: int, share):
        """`optimizer.apply` (and so `apply_gradients`) reduces over the lanes first."""
        user_apply = optimizer.apply

        def apply(grads, trainable_variables=None):
            if self._applying:  # a wrapper's inner optimizer: reduced already
                return user_apply(grads, trainable_variables)
            grads = list(grads)
            variables = list(trainable_variables or optimizer._trainable_variables)
            if not optimizer.built:  # its slots made outside the step, as Keras's fit does
                # on the variables' own storage: Keras places each slot with its variable,
                # and reading a block's whole value there would gather on one lane alone.
                with tf.init_scope(), _lane_storage(self._own_storage):
                    optimizer.build(variables)
            reduced = self._reduce(li, grads, share, variables)
            self._applying = True
            try:
                if li == 0 and not self._sharded:
                    return user_apply(reduced, variables)
                replica = self._replica(optimizer, li, variables)
                applied = replica.apply(reduced, [self._lane_copy(li, v) for v in variables])
                if li == 0:  # the user's optimizer counts the steps (schedules, callbacks)
                    optimizer.iterations.assign(replica.iterations)
                return applied
            finally:
                self._applying = False

        optimizer.apply = apply
        try:
            yield
        finally:
            del optimizer.apply  # the class's method again

    def _lane_copy(self, li: int, variable):
        index = self._index.get(id(variable))
        if index is None:
            raise ValueError(
                "The model's train_step applied gradients to a variable that is not one of "
                f"the model's trainable variables. Received: {variable.path}"
            )
        return self.state.trainable[li][index]

    def _replica(self, optimizer, li: int, variables):
        """Lane li's copy of `optimizer`, made (in the first trace) on the lane copies of
        the variables the user's optimizer is built on, starting from its state."""
        key = (id(optimizer), li)
        if key not in self._replicas:
            with tf.init_scope():
                originals = list(optimizer._trainable_variables)
                copies = [self._lane_copy(li, v) for v in originals]
                replica, pairs = _replica(optimizer, self.lanes[li].devices[0], copies, originals)
                pairs = [(theirs, mine, self._cut_of(li, replica, mine)) for theirs, mine in pairs]
                for theirs, mine, cut in pairs:
                    mine.assign(theirs.value if cut is None else cut(theirs.value))
            self._replicas[key] = (replica, pairs)
        return self._replicas[key][0]

    def _cut_of(self, li: int, replica, state_variable):
        """None when lane li's optimizer copy holds `state_variable` whole, else the cut
        of the user's value it holds: the block of a slot of a variable held in blocks."""
        if not self._sharded:
            return None
        of_copy = {id(copy): i for i, copy in enumerate(self.state.trainable[li])}
        for slot, reference, name in slots_of(replica):
            if slot is not state_variable:
                continue
            i = of_copy.get(id(reference))
            if i not in self._sharded:
                return None
            if is_factored(name):
                raise ValueError(
                    f"{type(replica).__name__} keeps factored moments ({name}) of "
                    f"{self.state.model_trainable[i].path}, which a Keras layout holds in "
                    "blocks: a block's factors are not a block of the whole variable's. Use an "
                    "element-wise optimizer (Adam, AdamW, SGD, Lion, ...) with the model's own "
                    "train_step, or lay the variable out replicated."
                )
            spec, lane = self._sharded[i], self.lanes[li].index
            return lambda whole: spec.block_of_id(whole, spec.block_id(lane))
        return None

    def load_optimizer_state(self) -> None:
        """Every lane's optimizer copy takes the user's optimizer's state (after the user
        or a callback changed it between steps)."""
        for _, pairs in self._replicas.values():
            for theirs, mine, cut in pairs:
                mine.assign(theirs.value if cut is None else cut(theirs.value))

    def write_optimizer_state(self) -> None:
        """With variables held in blocks: each user optimizer takes its lane copies' state
        (the first lane's, a block variable's slots joined from their holders'), as
        `model.save` and Keras's callbacks read it. Without, lane 0 applies with the user's
        optimizer itself, which holds the state already."""
        if not self._sharded:
            return
        position = {lane.index: li for li, lane in enumerate(self.lanes)}
        for optimizer in self._optimizers:
            first = self._replicas.get((id(optimizer), 0))
            if first is None:  # never applied yet
                continue
            of_copy = {id(copy): i for i, copy in enumerate(self.state.trainable[0])}
            owner = {id(slot): of_copy.get(id(ref)) for slot, ref, _ in slots_of(first[0])}
            for p, (theirs, mine, cut) in enumerate(first[1]):
                if cut is None:
                    theirs.assign(mine.value)
                    continue
                spec = self._sharded[owner[id(mine)]]
                blocks = [
                    self._replicas[(id(optimizer), position[h])][1][p][1].value
                    for h in spec.holders(self.lanes[0].index)
                ]
                with tf.device(self.host):
                    theirs.assign(spec.join(blocks))

    def _reduce(self, li: int, grads, share, variables):
        """The gradients summed over the lanes, each lane's weighted by its row share.
        A variable held in blocks arrives as its block's, weighted and summed by the
        gather's adjoint (over the replica's lanes only for one sliced over them: summed
        over the replicas here)."""
        device = self.lanes[li].devices[0]
        present = []
        reduced = list(grads)
        for position, (g, v) in enumerate(zip(grads, variables)):
            spec = self._sharded.get(self._index.get(id(v)))
            if g is None:
                continue
            if spec is None:
                present.append(position)
            elif not spec.summed_over_job and self._rank_reductions:
                rank = self.lanes[li].index % self._runtime.width
                with tf.device(device):
                    dense = tf.convert_to_tensor(g)
                    reduced[position] = self._rank_reductions[rank].sum(li, device, dense)
        if not present:
            return reduced
        with tf.device(device):
            dense = [tf.convert_to_tensor(grads[i]) for i in present]
            by_dtype: dict = {}
            for position, g in zip(present, dense):
                by_dtype.setdefault(g.dtype, []).append((position, g))
            for dtype, members in sorted(by_dtype.items(), key=lambda item: item[0].name):
                flat = tf.concat([tf.reshape(g, [-1]) for _, g in members], axis=0)
                # multiply_no_nan: a lane without rows contributes 0, even a NaN mean.
                flat = tf.math.multiply_no_nan(flat, tf.cast(share, dtype))
                total = self._reduction.sum(li, device, flat)
                sizes = [tf.size(g) for _, g in members]
                for (position, g), piece in zip(members, tf.split(total, sizes)):
                    reduced[position] = tf.reshape(piece, tf.shape(g))
        return reduced

    # ---- the steps -----------------------------------------------------------------------

    def steps(self, batch_size_key: str) -> tuple:
        """The program's (train, eval, predict) step functions, with the engine's step
        signatures (`Program._train_step` and friends), over this object's steps."""

        @tf.autograph.experimental.do_not_convert
        def train(features, labels, sample_weight=None, global_rows=None):
            logs = self.train_step(_element(features, labels, sample_weight))
            with tf.device(self.host):
                return {**logs, batch_size_key: _first_rows(features)}

        @tf.autograph.experimental.do_not_convert
        def evaluate(features, labels, sample_weight=None, pad_to: int = 0):
            return self.test_step(_element(features, labels, sample_weight))

        @tf.autograph.experimental.do_not_convert
        def predict(features, pad_to: int = 0):
            return self.predict_step((features,))

        return train, evaluate, predict

    def evaluate_batches(self, program):
        """`program.eval_many_on_iterator` for the model's own test_step: one call per
        batch, keeping the last batch's logs in `program.last_test_logs` (Keras's
        evaluate reports them when they do not name exactly the model's metrics)."""

        def run(iterator, steps: int, batch_size: int) -> int:
            ran = 0
            for _ in range(int(steps)):
                element = iterator.get_next_as_optional()
                if not element.has_value():
                    break
                features, labels, weights = unpack_element(element.get_value())
                program.last_test_logs = program.eval_step(features, labels, weights)
                ran += 1
            return ran

        return run

    def _lane_shares(self, data):
        """Each lane's rows, and its share of the job's rows (the lanes of every worker)."""
        with tf.device(self.host):
            rows = _first_rows(data)
            ranges = _row_ranges(rows, len(self.lanes))
        shares = []
        for li, (start, end) in enumerate(ranges):
            device = self.lanes[li].devices[0]
            with tf.device(device):
                mine = tf.cast(end - start, tf.float32)
                total = self._reduction.sum(li, device, mine)
                shares.append(tf.math.divide_no_nan(mine, total))
        return ranges, shares

    def _run_lanes(self, method: str, data) -> tuple[list, list]:
        """Each lane's row share and what the model's `method` returned on its rows."""
        self._reduction.begin_trace()
        for reduction in self._rank_reductions.values():
            reduction.begin_trace()
        if self._runtime is not None:
            self._runtime.begin_trace()
        ranges, shares = self._lane_shares(data)
        outputs = []
        for li, (start, end) in enumerate(ranges):
            with self._on_lane(li, shares[li]):
                outputs.append(getattr(self.model, method)(_take_rows(data, start, end)))
        return shares, outputs

    def train_step(self, data) -> dict:
        """The model's `train_step` on every lane; returns its logs (module doc)."""
        shares, outputs = self._run_lanes("train_step", data)
        state = self.state
        lane_values = [
            [None if v is None else v.value for v in state.non_trainable[li]]
            for li in range(len(self.lanes))
        ]
        self._store_non_trainable(lane_values)
        return self._logs(outputs, shares)

    def test_step(self, data) -> dict:
        shares, outputs = self._run_lanes("test_step", data)
        return self._logs(outputs, shares)

    def predict_step(self, data):
        """The model's `predict_step` on every lane, its outputs joined in row order."""
        _, outputs = self._run_lanes("predict_step", data)
        with tf.device(self.host):
            return tree.map_structure(lambda *xs: tf.concat(xs, axis=0), *outputs)

    def _logs(self, outputs: list, shares: list) -> dict:
        """One dict of logs from the lanes' returned dicts (module doc), flattened as
        Keras flattens logs (`pythonify_logs`: a dict value's items join the top level)."""
        flat = [_flat_logs(out) for out in outputs]
        metric_handles = {id(v.value.handle) for m in self.model.metrics for v in m.variables}
        reads_metric = _reads_variables(metric_handles)
        logs = {}
        # The shares are of the job's rows: with lanes on other workers, the weighted
        # values are summed over the job's lanes (a local sum was this worker's part of
        # the mean only: half the loss on each of 2 workers, different on each).
        across_job = len(self._reduction.group.devices) > len(self.lanes)
        with tf.device(self.host):
            for name, last in flat[-1].items():
                if reads_metric(last):
                    logs[name] = last
                    continue
                values = [tf.cast(lane[name], tf.float32) for lane in flat]
                if not across_job:
                    logs[name] = tf.add_n([v * s for v, s in zip(values, shares)])
                    continue
                summed = []
                for li, (value, share) in enumerate(zip(values, shares)):
                    device = self.lanes[li].devices[0]
                    with tf.device(device):
                        summed.append(self._reduction.sum(li, device, value * share))
                logs[name] = tf.identity(summed[0])
        return logs


def _flat_logs(logs) -> dict:
    if not isinstance(logs, dict):
        raise TypeError(
            "A model's train_step / test_step must return a dict of logs (as Keras's fit "
            f"requires). Received: {type(logs).__name__}"
        )
    flat = {}
    for name, value in sorted(logs.items()):
        flat.update(_flat_logs(value) if isinstance(value, dict) else {name: value})
    return flat


def _replica(optimizer, device: str, copies: list, originals: list):
    """A built copy of `optimizer` on a lane's `copies` of its `originals`: the same
    settings, the user's weight-decay decisions per original, and the user's
    learning-rate variable itself (a callback that sets it reaches every lane).

    Returns:
      (the copy, [(user's variable, the copy's variable)] for every variable holding
      state: iterations, slots, moving averages; both built on corresponding variables,
      in the same order).
    """
    with tf.device(device):  # recording: which variable each slot is of (`slots_of`)
        replica = recording_class(type(optimizer)).from_config(optimizer.get_config())
        excluded = [c for c, o in zip(copies, originals) if not optimizer._use_weight_decay(o)]
        replica.exclude_from_weight_decay(var_list=excluded)
        replica.build(copies)
    rates = {id(optimizer._learning_rate), id(replica._learning_rate)}
    if isinstance(optimizer._learning_rate, keras.Variable):
        replica._learning_rate = optimizer._learning_rate
    pairs = list(
        zip(
            [v for v in optimizer.variables if id(v) not in rates],
            [v for v in replica.variables if id(v) not in rates],
        )
    )
    return replica, pairs


def _reads_variables(handles: set):
    """A test of whether a tensor of the graph being traced reads one of the variables
    whose (eager) handles' ids are `handles`."""
    graph = tf.compat.v1.get_default_graph()
    captured = {
        id(internal)
        for external, internal in getattr(graph, "captures", [])
        if id(external) in handles
    }

    def reads(tensor) -> bool:
        if not isinstance(tensor, tf.Tensor) or not captured:
            return False
        seen, todo = set(), [tensor.op]
        while todo:
            op = todo.pop()
            if id(op) in seen:
                continue
            seen.add(id(op))
            if op.type == "ReadVariableOp" and id(op.inputs[0]) in captured:
                return True
            todo.extend(t.op for t in op.inputs)
            todo.extend(op.control_inputs)
        return False

    return reads
