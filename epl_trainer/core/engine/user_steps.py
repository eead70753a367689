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
  after every lane's update); any other returned value (a loss tensor) is the lanes'
  row-weighted mean, as Keras's `reduce_per_replica` means them.
* **Non-trainable floats** (BatchNorm's moving statistics) are averaged over the lanes
  after the step, as in the engine's own step.

Only plain data parallelism runs a user's step: layouts that cut the model or its update
(pipeline stages, split layers, ZeRO, offload, micro-batches, the engine's AMP, gradient
checkpointing) are refused by name (core/plan/rules.py, `check_user_steps`).
"""

from __future__ import annotations

import contextlib
import itertools

import keras
import tensorflow as tf
from keras import tree

from epl_trainer.core import comm
from epl_trainer.core.comm.keys import next_instance_key, ordering_token
from epl_trainer.core.engine.step_batch import unpack_element

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
    """

    def __init__(self, model, state, lanes, group, host, store_non_trainable):
        self.model = model
        self.state = state
        self.lanes = list(lanes)
        self.host = host
        self._store_non_trainable = store_non_trainable
        self._reduction = _LaneReduction(group)
        self._index = {id(v): i for i, v in enumerate(state.model_trainable)}
        # (id(user optimizer), lane position) -> that lane's copy of it.
        # (id(user optimizer), lane position) -> (that lane's copy of it, the pairs of
        # (user's variable, the copy's) that hold state: all but the shared learning rate).
        self._replicas: dict[tuple[int, int], tuple] = {}
        self._optimizers = model_optimizers(model)
        self._applying = False  # inside a reduced apply (a wrapper's inner optimizer)

    # ---- lanes' storage ----------------------------------------------------------------

    def _variable_pairs(self, li: int) -> list:
        state = self.state
        pairs = []
        for originals, copies in (
            (state.model_trainable, state.trainable[li]),
            (state.model_non_trainable, state.non_trainable[li]),
        ):
            pairs.extend(
                (original, copy._value)
                for original, copy in zip(originals, copies)
                if copy is not None and copy is not original
            )
        return pairs

    def _optimizer_pairs(self, li: int) -> list:
        pairs = []
        for optimizer in self._optimizers:
            _, state_pairs = self._replicas.get((id(optimizer), li), (None, ()))
            pairs.extend((mine, theirs._value) for mine, theirs in state_pairs)
        return pairs

    @contextlib.contextmanager
    def _on_lane(self, li: int, share):
        """Lane li's variables, device and reducing optimizers for the block."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(tf.device(self.lanes[li].devices[0]))
            if li > 0:
                stack.enter_context(_lane_storage(self._variable_pairs(li)))
                stack.enter_context(_lane_storage(self._optimizer_pairs(li)))
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
                with tf.init_scope():
                    optimizer.build(variables)
            reduced = self._reduce(li, grads, share)
            self._applying = True
            try:
                if li == 0:
                    return user_apply(reduced, variables)
                return self._replica(optimizer, li, variables).apply(
                    reduced, [self._lane_copy(li, v) for v in variables]
                )
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
                for theirs, mine in pairs:
                    mine.assign(theirs)
            self._replicas[key] = (replica, pairs)
        return self._replicas[key][0]

    def load_optimizer_state(self) -> None:
        """Every lane's optimizer copy takes the user's optimizer's state (after the user
        or a callback changed it between steps)."""
        for _, pairs in self._replicas.values():
            for theirs, mine in pairs:
                mine.assign(theirs)

    def _reduce(self, li: int, grads, share):
        """The gradients summed over the lanes, each lane's weighted by its row share."""
        device = self.lanes[li].devices[0]
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return grads
        with tf.device(device):
            dense = [tf.convert_to_tensor(grads[i]) for i in present]
            by_dtype: dict = {}
            for position, g in zip(present, dense):
                by_dtype.setdefault(g.dtype, []).append((position, g))
            reduced = list(grads)
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
        with tf.device(self.host):
            for name, last in flat[-1].items():
                if reads_metric(last):
                    logs[name] = last
                    continue
                values = [tf.cast(lane[name], tf.float32) for lane in flat]
                logs[name] = tf.add_n([v * s for v, s in zip(values, shares)])
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
    with tf.device(device):
        replica = type(optimizer).from_config(optimizer.get_config())
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
