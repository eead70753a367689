"""Plan + state -> the `tf.function` steps that train, evaluate and predict.

One training step, in this order (each phase is a method below):

1. split the per-worker batch on the host into lanes x micro-batches;
2. per lane, the forward and backward of every (stage, micro-batch) in the order of the
   pipeline schedule (pipeline.py, schedule.py): stateless forward under the stage's
   device recorded by its own tape, backward under the same device (a single tape would
   put every backward op on the device current when `gradient()` is called), boundary
   gradients routed back by tensor key;
3. gradients accumulated over micro-batches (scaled by 1/num_micro_batch, so the sum is
   the mean: one TaskGraph with num_micro_batch > 1 is gradient accumulation);
4. all-reduced per stage over every lane of the job, in fused buckets;
5. optional global-norm clipping (the optimizer's `global_clipnorm`, over all stages),
   before or after step 4 as `communication.clip_after_allreduce` says;
6. the Keras optimizer applied on every lane (one optimizer per lane and stage, built
   under the stage's device so its slots live next to the variables);
7. float non-trainable state (BatchNorm statistics) averaged over lanes.

Features are decided while the program is built (which groups, buckets, clip), never
by flags tested inside the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import keras
import tensorflow as tf
from keras import tree

from epl_trainer.core import comm
from epl_trainer.core.engine.pipeline import LaneExecutor, stateless_stage_call
from epl_trainer.core.engine.split import update_split_accuracy
from epl_trainer.core.engine.state import EngineState, Lane
from epl_trainer.core.graph.partition import StagedModel
from epl_trainer.core.plan.schedule import execution_order, make_schedule


@dataclasses.dataclass(frozen=True)
class ProgramOptions:
    """What the builder needs from the config sections."""

    num_micro_batch: int
    gradients_reduce_method: str  # "mean" | "sum"
    max_splits: int
    num_communicators: int
    clip_after_allreduce: bool = False
    pipeline_strategy: str = "PreferBackward"
    fp16_scale: float | None = None  # communication.fp16: gradients cross as float16
    # communication.sparse_as_dense=False: embedding gradients (IndexedSlices) are
    # all-gathered as slices instead of being made dense and all-reduced.
    sparse_gradients: bool = False


class Program:
    """Builds and owns the train / evaluate / predict steps for one plan."""

    def __init__(
        self,
        staged: StagedModel,
        state: EngineState,
        lanes_in_job: Sequence[Lane],
        loss_fn,
        metrics,
        loss_tracker,
        options: ProgramOptions,
        host_device: str,
        clip_global_norm: float | None = None,
        step_counter=None,
    ):
        self.staged = staged
        self.state = state
        self.lanes = state.lanes
        self.loss_fn = loss_fn
        self.metrics = metrics  # [(output index, keras metric)]
        self.loss_tracker = loss_tracker
        # Set by the builder (builder.py) before the first step: reduces and applies the
        # gradients (ReplicatedUpdate, or ZeRO's sharded update).
        self.update = None
        # Replaced by passes (recompute, AMP) before the first step; see pipeline.py.
        self.stage_calls = [stateless_stage_call(stage.model) for stage in staged.stages]
        self.eval_stage_calls = list(self.stage_calls)  # forward only: never recomputed
        # Tensor split (split.py): the SplitRuntime, set by the builder's split pass.
        self.split = None
        self.loss_scale = None
        self.recomputed = {}  # stage -> RecomputedStage (gradient checkpointing pass)
        self.output_cast = _identity  # AMP: float32 outputs/aux losses for losses and metrics
        self.extra_logs = {}  # name -> callable giving a tensor, added to every step's logs
        self.options = options
        self.host = host_device
        self.clip_global_norm = clip_global_norm
        self.step_counter = step_counter
        # Where global-norm clipping happens (communication.clip_after_allreduce): on each
        # lane's local gradients before the reduction (EPL's default), or on the reduced ones.
        clipping = clip_global_norm is not None
        self.clip_before = clipping and not options.clip_after_allreduce
        self.clip_after = clipping and options.clip_after_allreduce
        self.num_stages = len(staged.stages)
        self.stage_groups = [
            comm.CollectiveGroup(
                devices=tuple(lane.devices[k] for lane in lanes_in_job),
                local_devices=tuple(lane.devices[k] for lane in self.lanes),
            )
            for k in range(self.num_stages)
        ]
        self.trainable_idx = [state.stage_indices(k) for k in range(self.num_stages)]
        # Sharded variables (split layers) are reduced over their shard group instead.
        self.reduced_idx = [
            [i for i in idx if i not in state.sharded] for idx in self.trainable_idx
        ]
        self.non_trainable_idx = [
            state.stage_indices(k, trainable=False) for k in range(self.num_stages)
        ]
        self.sparse_gradients = options.sparse_gradients  # read by the lanes' backward
        self.schedule = make_schedule(
            options.pipeline_strategy, self.num_stages, options.num_micro_batch
        )
        order = execution_order(self.schedule)
        self.executors = [
            LaneExecutor(
                staged,
                lane.devices,
                state.trainable[li],
                self.trainable_idx,
                self.non_trainable_idx,
                order,
                options.num_micro_batch,
                loss_fn,
                hooks=self,
            )
            for li, lane in enumerate(self.lanes)
        ]
        # Pulling the batch inside the compiled step (as Keras does) saves a Python-level
        # round trip per step; it matters for small, fast steps.
        self.train_on_iterator = tf.function(self._train_on_iterator, reduce_retracing=True)
        # Multi-worker jobs take the batch outside the step, to agree on the end of data
        # first (end_of_data.py).
        self.train_on_element = tf.function(self._train_on_element, reduce_retracing=True)
        self.eval_step = tf.function(self._eval_step, reduce_retracing=True)
        self.predict_step = tf.function(self._predict_step, reduce_retracing=True)

    def _plan_buckets(self, indices: Sequence[int]) -> list[list[int]]:
        """Buckets (positions into `indices`) of at most max_splits per dtype."""
        variables = [self.state.model_trainable[i] for i in indices]
        sizes = [int(v.value.shape.num_elements()) * v.value.dtype.size for v in variables]
        return comm.plan_buckets(sizes, [v.dtype for v in variables], self.options.max_splits)

    # ---- the training step -------------------------------------------------------------

    def _train_on_iterator(self, iterator):
        features, labels = split_element(next(iterator))
        return self._train_step(features, labels)

    def _train_on_element(self, element):
        features, labels = split_element(element)
        return self._train_step(features, labels)

    def _train_step(self, features, labels):
        num_lanes, num_micro = len(self.lanes), self.options.num_micro_batch
        batch = self._checked_batch_size(features, num_lanes * num_micro)
        with tf.device(self.host), tf.control_dependencies([batch]):  # check, then split
            feature_parts = split_batch(features, num_lanes * num_micro)
            label_parts = split_batch(labels, num_lanes * num_micro)
        lane_grads, lane_non_trainable = [], []
        self._begin_trace()
        for li, executor in enumerate(self.executors):
            parts = slice(li * num_micro, (li + 1) * num_micro)
            with self.lane_scope(li):
                grads, non_trainable, micro_batches = executor.run(
                    feature_parts[parts],
                    label_parts[parts],
                    [v.value for v in self.state.non_trainable[li]],
                    task_scope=f"lane{li}",
                )
                for mb in micro_batches:
                    self._update_metrics(mb.labels, mb.y_pred, mb.loss)
            lane_grads.append(grads)
            lane_non_trainable.append(non_trainable)
        self.update(lane_grads)
        self._store_non_trainable(lane_non_trainable)
        # Depend on the data itself (a static batch size folds into a constant), so a
        # step whose input ran out increments nothing.
        with tf.device(self.host), tf.control_dependencies([batch, tree.flatten(features)[0]]):
            if self.step_counter is not None:
                self.step_counter.assign_add(1)
            return {**self._metric_results(), BATCH_SIZE_KEY: batch}

    def _checked_batch_size(self, features, parts: int):
        """The batch size, checked to split into lanes x micro-batches.

        A static batch dimension is checked while tracing (a ValueError); a dynamic one
        by an in-graph assertion whose message starts with BATCH_SPLIT_ERROR.
        """
        first = tree.flatten(features)[0]
        static = first.shape[0]
        terms = f"local_replicas={len(self.lanes)}, num_micro_batch={self.options.num_micro_batch}"
        if static is not None and static % parts:
            raise ValueError(f"{BATCH_SPLIT_ERROR} Received: batch_size={static}, {terms}")
        with tf.device(self.host):
            batch = tf.shape(first)[0]
            if static is None:
                check = tf.debugging.Assert(
                    tf.equal(batch % parts, 0),
                    [f"{BATCH_SPLIT_ERROR} Received: {terms}, batch_size=", batch],
                )
                with tf.control_dependencies([check]):
                    batch = tf.identity(batch)
        return batch

    def _metric_results(self) -> dict:
        """Running metric values, computed in the step so one call returns the logs."""
        with tf.device(self.host):
            metrics = [self.loss_tracker] + [m for _, m in self.metrics]
            logs = {m.name: m.result() for m in metrics}
            logs.update({name: value() for name, value in self.extra_logs.items()})
            return logs

    def lane_scope(self, li: int):
        """Makes lane li current for split layers (a no-op without them)."""
        return self.split.lane(li) if self.split is not None else contextlib.nullcontext()

    def _begin_trace(self) -> None:
        if self.split is not None:
            self.split.begin_trace()

    def all_reduce_gradients(self, lane_grads: list[list]) -> list[list]:
        """All-reduces each stage's gradients over every lane of the job."""
        reduced = [list(grads) for grads in lane_grads]
        if self.split is not None:
            self._reduce_sharded(lane_grads, reduced)
        for k, group in enumerate(self.stage_groups):
            idx = [i for i in self.reduced_idx[k] if not _is_slices(lane_grads[0][i])]
            for i in self.reduced_idx[k]:
                if _is_slices(lane_grads[0][i]):
                    gathered = comm.all_gather_slices(
                        group,
                        [grads[i] for grads in lane_grads],
                        self.options.gradients_reduce_method,
                    )
                    for li, g in enumerate(gathered):
                        reduced[li][i] = g
            per_member = [[grads[i] for i in idx] for grads in lane_grads]
            results = comm.fused_all_reduce(
                group,
                per_member,
                self._plan_buckets(idx),
                self.options.gradients_reduce_method,
                num_chains=self.options.num_communicators,
                wire_fp16_scale=self.options.fp16_scale,
            )
            for li, stage_grads in enumerate(results):
                for i, g in zip(idx, stage_grads):
                    reduced[li][i] = g
        return reduced

    def _reduce_sharded(self, lane_grads: list[list], reduced: list[list]) -> None:
        """Sharded gradients: summed over the lanes holding the same shard (one per
        replica), divided by the job's lane count for "mean" (see split.py)."""
        sharded = sorted(self.state.sharded)
        scale = 1.0 / self.stage_groups[0].size
        for rank in range(self.split.width):
            members = [li for li in range(len(self.lanes)) if self.split.shard_rank(li) == rank]
            job_devices = tuple(
                d
                for d in self.stage_groups[0].devices
                if self.stage_groups[0].devices.index(d) % self.split.width == rank
            )
            group = comm.CollectiveGroup(
                job_devices,
                tuple(self.lanes[li].devices[0] for li in members),
            )
            per_member = [[lane_grads[li][i] for i in sharded] for li in members]
            buckets = comm.plan_buckets(
                [_num_bytes(g) for g in per_member[0]],
                [g.dtype for g in per_member[0]],
                self.options.max_splits,
            )
            results = comm.fused_all_reduce(
                group, per_member, buckets, "sum", wire_fp16_scale=self.options.fp16_scale
            )
            for li, grads in zip(members, results):
                for i, g in zip(sharded, grads):
                    with tf.device(self.lanes[li].devices[0]):
                        mean = self.options.gradients_reduce_method == "mean"
                        reduced[li][i] = g * tf.cast(scale, g.dtype) if mean else g

    def clip(self, li: int, grads: list) -> list:
        """Global-norm clipping over all stages of a lane (the optimizer's global_clipnorm).

        With split layers the norm adds every shard's squares (a sum over the replica's
        lanes), so it is the norm of the whole model's gradient.
        """
        lane = self.lanes[li]
        squares = []
        for k in range(self.num_stages):
            with tf.device(lane.devices[k]):
                stage_grads = [grads[i] for i in self.reduced_idx[k]]
                if stage_grads:
                    squares.append(tf.add_n([_sum_of_squares(g) for g in stage_grads]))
        if self.split is not None and self.state.sharded:
            with self.lane_scope(li), tf.device(lane.devices[0]):
                shard_squares = tf.add_n(
                    [tf.reduce_sum(tf.square(grads[i])) for i in sorted(self.state.sharded)]
                )
                squares.append(self.split.active.reduce(shard_squares, "sum"))
        with tf.device(lane.devices[0]):
            norm = tf.sqrt(tf.add_n(squares))
            factor = self.clip_global_norm / tf.maximum(norm, self.clip_global_norm)
        clipped = []
        for i, g in enumerate(grads):
            with tf.device(lane.devices[self.state.trainable_stage[i]]):
                if _is_slices(g):
                    values = g.values * tf.cast(factor, g.values.dtype)
                    clipped.append(tf.IndexedSlices(values, g.indices, g.dense_shape))
                else:
                    clipped.append(g * tf.cast(factor, g.dtype))
        return clipped

    def _store_non_trainable(self, lane_values: list[list]) -> None:
        """Writes back non-trainable state; floats are first averaged over all lanes."""
        synced = set(self.state.synced_non_trainable())
        for k, group in enumerate(self.stage_groups):
            idx = [i for i in self.non_trainable_idx[k] if i in synced]
            if idx:
                per_member = [[values[i] for i in idx] for values in lane_values]
                buckets = comm.plan_buckets([1] * len(idx), [v.dtype for v in per_member[0]], 1)
                results = comm.fused_all_reduce(group, per_member, buckets, "mean")
                for li, member in enumerate(results):
                    for i, value in zip(idx, member):
                        lane_values[li][i] = value
        assigned: set[int] = set()  # under offload the lanes share one copy
        for li, values in enumerate(lane_values):
            for variable, value in zip(self.state.non_trainable[li], values):
                if id(variable) not in assigned:
                    assigned.add(id(variable))
                    variable.assign(value)

    def _update_metrics(self, labels, y_pred, loss) -> None:
        with tf.device(self.host):
            first = tree.flatten(labels)[0]
            # A static batch size is a constant: tie it to the data, so a step whose input
            # ran out does not count its samples.
            with tf.control_dependencies([first]):
                batch = tf.identity(tf.shape(first)[0])
            self.loss_tracker.update_state(loss, sample_weight=batch)
            self._update_output_metrics(labels, y_pred, None)

    def _update_output_metrics(self, labels, y_pred, sample_weight) -> None:
        flat_true, flat_pred = tree.flatten(labels), tree.flatten(y_pred)
        split_outputs = self.split.dense_outputs() if self.split is not None else {}
        for index, metric in self.metrics:
            if index in split_outputs:
                update_split_accuracy(
                    metric, flat_true[index], flat_pred[index], self.split.active, sample_weight
                )
            else:
                metric.update_state(flat_true[index], flat_pred[index], sample_weight=sample_weight)

    # ---- evaluation and prediction ---------------------------------------------------------

    def _forward(self, li: int, features):
        lane = self.lanes[li]
        staged = self.staged
        values = dict(zip(staged.input_keys, staged.flatten_inputs(features)))
        aux_total = []
        for k, stage in enumerate(staged.stages):
            with tf.device(lane.devices[k]):
                variables = [self.state.trainable[li][i].value for i in self.trainable_idx[k]]
                non_trainable = [
                    self.state.non_trainable[li][i].value for i in self.non_trainable_idx[k]
                ]
                outputs, _, aux = self.eval_stage_calls[k](
                    variables, non_trainable, staged.stage_arguments(stage, values), False
                )
                values.update(staged.stage_results(stage, outputs))
                aux_total.extend(tf.identity(a) for a in aux)
        outputs = staged.pack_outputs([values[key] for key in staged.output_keys])
        return self.output_cast(outputs), self.output_cast(aux_total)

    def _eval_step(self, features, labels):
        num_lanes = len(self.lanes)
        with tf.device(self.host):
            features, labels, mask = pad_batch((features, labels), num_lanes)
            parts = split_batch((features, labels, mask), num_lanes)
        self._begin_trace()
        for li, (f, y, w) in enumerate(parts):
            with self.lane_scope(li):
                y_pred, aux = self._forward(li, f)
                with tf.device(self.lanes[li].devices[-1]):
                    count = tf.reduce_sum(w)
                    # Keras reduces by the (padded) part size; undo that to average valid rows.
                    loss = (
                        self.loss_fn(y, y_pred, sample_weight=w)
                        * tf.cast(tf.shape(w)[0], w.dtype)
                        / tf.maximum(count, 1.0)
                    )
                    if aux:
                        loss = loss + tf.add_n(aux)
                with tf.device(self.host):
                    self.loss_tracker.update_state(loss, sample_weight=count)
                    self._update_output_metrics(y, y_pred, w)

    def _predict_step(self, features):
        num_lanes = len(self.lanes)
        with tf.device(self.host):
            batch = tf.shape(tree.flatten(features)[0])[0]
            features, _ = pad_batch((features,), num_lanes)[:2]
            parts = split_batch(features, num_lanes)
        self._begin_trace()
        outputs = []
        for li, f in enumerate(parts):
            with self.lane_scope(li):
                outputs.append(self._forward(li, f)[0])
        with tf.device(self.host):
            if self.split is not None:
                return self._join_split_predictions(outputs, batch)
            joined = tree.map_structure(lambda *xs: tf.concat(xs, axis=0), *outputs)
            return tree.map_structure(lambda x: x[:batch], joined)

    def _join_split_predictions(self, outputs: list, batch):
        """Rows of every lane, in lane order; a split output's class slices are joined
        per replica (each lane holds its classes for all of the replica's rows)."""
        width = self.split.width
        split_outputs = self.split.dense_outputs()
        flat = [tree.flatten(o) for o in outputs]
        joined = []
        for index in range(len(flat[0])):
            pieces = [f[index] for f in flat]
            if index in split_outputs:
                layer = split_outputs[index]
                replicas = [
                    tf.concat(pieces[r : r + width], axis=1) for r in range(0, len(pieces), width)
                ]
                value = tf.concat(replicas, axis=0)
                if layer.softmax:
                    value = tf.nn.softmax(value)
            else:
                value = tf.concat(pieces, axis=0)
            joined.append(value[:batch])
        return tree.pack_sequence_as(outputs[0], joined)


BATCH_SIZE_KEY = "_batch_size"
BATCH_SPLIT_ERROR = "The per-worker batch must split evenly into local replicas x micro-batches."


def _identity(x):
    return x


def _is_slices(gradient) -> bool:
    return isinstance(gradient, tf.IndexedSlices)


def _sum_of_squares(gradient):
    """Squared norm of a gradient. Slices count row by row (repeated indices are not
    summed first), as Keras's `global_norm` does, so clipping matches `Model.fit`."""
    values = gradient.values if _is_slices(gradient) else gradient
    return tf.reduce_sum(tf.square(values))


def _num_bytes(tensor) -> int:
    return int(tensor.shape.num_elements()) * tensor.dtype.size


def split_element(element):
    """(features, labels) from a training dataset element, checked while tracing."""
    if not isinstance(element, tuple) or len(element) != 2:
        raise ValueError(
            "Training and evaluation datasets must yield (features, labels) pairs. Received "
            f"an element with structure {tree.map_structure(lambda x: x.shape, element)}"
        )
    return element


def split_batch(structure, parts: int) -> list:
    """Splits every tensor of a nested structure into `parts` equal slices on axis 0."""
    if parts == 1:
        return [structure]
    flat = tree.flatten(structure)
    sliced = [tf.split(x, parts, axis=0) for x in flat]
    return [tree.pack_sequence_as(structure, [s[p] for s in sliced]) for p in range(parts)]


def pad_batch(structures: tuple, multiple: int):
    """Pads axis 0 to a multiple of `multiple`; returns the padded structures and a mask."""
    flat = tree.flatten(structures)
    batch = tf.shape(flat[0])[0]
    pad = (multiple - batch % multiple) % multiple
    padded = tree.map_structure(
        lambda x: tf.pad(x, [[0, pad]] + [[0, 0]] * (len(x.shape) - 1)), structures
    )
    mask = tf.cast(tf.sequence_mask(batch, batch + pad), keras.backend.floatx())
    return (*padded, mask)
