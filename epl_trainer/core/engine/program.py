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
4. the update hook: reduce (reduce.py: all-reduce in fused buckets, or ZeRO's
   reduce-scatter), clip by the global norm, apply the optimizer (update.py, zero.py),
   all inside the finiteness check (finite.py);
5. float non-trainable state (BatchNorm statistics) averaged over lanes.

Features are passes that fill the step's hooks while the program is built (hooks.py,
builder.py), never flags tested inside the step.
"""

from __future__ import annotations

import tensorflow as tf
from keras import tree

from epl_trainer.core import comm
from epl_trainer.core.engine import objective
from epl_trainer.core.engine.compiled_lanes import emit_lanes_compiled
from epl_trainer.core.engine.data_divisor import correct_data_divisor
from epl_trainer.core.engine.hooks import StepHooks
from epl_trainer.core.engine.layout import StepLayout
from epl_trainer.core.engine.pipeline import Boundaries, LaneBoundaries, LaneExecutor, run_to_end
from epl_trainer.core.engine.program_loops import InferenceLoops
from epl_trainer.core.engine.state import EngineState
from epl_trainer.core.engine.step_batch import (
    StepBatch,
    adds_losses,
    open_batch_spec,
    pad_batch,
    split_batch,
    unpack_element,
)
from epl_trainer.core.plan.schedule import FORWARD, execution_order, make_schedule, stage_chains


class Program(InferenceLoops):
    """Builds and owns the train / evaluate / predict steps for one plan.

    Args:
      layout: where lanes, stages and variables live.
      hooks: the step's extension points, filled by the builder's passes before the
        first trace (hooks.py).
      metrics: the trainer's compiled metrics: iterating gives (flat output index, Keras
        metric) pairs, `.name(metric)` the metric's key in the logs (Keras's names);
        read while tracing.
      loss_tracker: the running mean of the loss.
      output_loss_trackers: Keras's running mean per output loss (`<output>_loss`), in
        the order of the loss's terms; empty for one loss. Read while tracing.
      num_micro_batch, pipeline_strategy, virtual_stages: the plan's.
      sparse_gradients: keep Embedding gradients as IndexedSlices
        (`communication.sparse_as_dense=False`).
      embedding_tables: model-order indices of the Embedding tables.
      step_counter: the optimizer's `iterations`, advanced once per step.
      weighted_metrics: ids of the metrics that get the data's sample weights (Keras's
        `weighted_metrics`); the others get only the mask of real rows. Read while
        tracing.
      data_shards: workers that read different batches (the global batch is this many
        worker batches: the loss's divisor counts all of them, objective.py).
      agree_on_batches: None, or (several workers) the end-of-data agreement as graph
        ops (`EndOfDataAgreement.in_graph`), run before each step of a loop of steps.
      compile_gradients: compile phases 1-3 (forward, backward, metrics) as one XLA
        function, as Keras's `jit_compile` compiles its step; the update stays outside,
        in the finiteness check (jit_choice.py says when).
      compile_lanes: compile each lane's phases 2-3 as one XLA function on its device
        (compiled_lanes.py; lanes of one stage and one micro-batch).
      user_steps: None, or a factory `program -> UserSteps` (user_steps.py): the model's
        own train / test / predict steps then replace the engine's.
    """

    def __init__(
        self,
        layout: StepLayout,
        hooks: StepHooks,
        metrics,
        loss_tracker,
        num_micro_batch: int,
        pipeline_strategy: str,
        sparse_gradients: bool,
        step_counter=None,
        embedding_tables: frozenset = frozenset(),
        data_shards: int = 1,
        weighted_metrics=frozenset(),
        output_loss_trackers=(),
        agree_on_batches=None,
        virtual_stages: int = 1,
        compile_gradients: bool = False,
        compile_lanes: bool = False,
        user_steps=None,
    ):
        self.layout = layout
        self._step_gradients = self._gradients
        if compile_gradients:
            self._step_gradients = tf.function(self._gradients, jit_compile=True, autograph=False)
        self.agree_on_batches = agree_on_batches
        self.output_loss_trackers = output_loss_trackers
        self.data_shards = data_shards
        self.weighted_metrics = weighted_metrics
        self.hooks = hooks
        self.metrics = metrics
        self.loss_tracker = loss_tracker
        self.num_micro_batch = num_micro_batch
        self.step_counter = step_counter
        if hooks.update_metrics is None:
            hooks.update_metrics = self.update_metrics
        self._widest_batch = None
        self._whole_copies = None  # `adds_losses`, found on the first trace
        if hooks.fixed_batch_shape:
            with tf.init_scope(), tf.device(layout.host):
                self._widest_batch = tf.Variable(0, dtype=tf.int32, trainable=False)
        # One stage's schedule (F0 B0 F1 B1 ...) runs as a loop over micro-batches in the
        # graph, so tracing does not grow with them; a pipeline's tasks keep activations
        # from one micro-batch's forward to its backward several tasks later, which a tape
        # cannot carry across loop iterations, so they are emitted one by one.
        self.loops_micro_batches = (
            layout.num_stages == 1
            and num_micro_batch > 1
            and hooks.micro_batch_loop
            and hooks.gradient_sink is None  # ZeRO reduces each micro-batch on its own
        )
        # Chosen once, from the passes: ZeRO v1 reduces each backward's gradients over the
        # lanes at once, and synchronized BatchNorm joins every lane's same task, so the
        # lanes' tasks are emitted in lockstep.
        if self.loops_micro_batches:
            self._emit_lanes = self._emit_lanes_in_loops
        elif hooks.gradient_sink is None and not hooks.lanes_in_lockstep:
            self._emit_lanes = self._emit_lanes_one_by_one
        else:
            self._emit_lanes = self._emit_lanes_in_lockstep
        if compile_lanes:
            self._emit_lanes = self._emit_lanes_compiled
        self.schedule = make_schedule(
            pipeline_strategy, layout.num_stages, num_micro_batch, virtual_stages
        )
        order = execution_order(self.schedule)
        chains = stage_chains(self.schedule)
        # Lanes whose stages live on several workers pass tensors across (boundaries.py).
        boundaries = Boundaries(layout.staged)
        self.boundaries = [
            LaneBoundaries(boundaries, lane) if lane.spans_workers else None
            for lane in layout.lanes
        ]
        self.executors = [
            LaneExecutor(
                layout.staged,
                lane.devices,
                layout.state.trainable[li],
                layout.read_idx,
                layout.non_trainable_idx,
                order,
                num_micro_batch,
                hooks,
                sparse_gradients,
                embedding_tables,
                lane=lane,
                boundaries=self.boundaries[li],
                position=li,
                stage_variables=[layout.stage_variables(li, k) for k in range(layout.num_stages)],
                chains=chains,
                unread_idx=[layout.unread_idx(k) for k in range(layout.num_stages)],
            )
            for li, lane in enumerate(layout.lanes)
        ]
        self.user_steps = None
        if user_steps is not None:
            self.user_steps = user_steps(self)
            self._train_step, self._eval_step, self._predict_step = self.user_steps.steps(
                BATCH_SIZE_KEY
            )
        # Pulling the batch inside the compiled step (as Keras does) saves a Python-level
        # round trip per step; it matters for small, fast steps.
        self.train_on_iterator = tf.function(self._train_on_iterator, reduce_retracing=True)
        # Multi-worker jobs take the batch outside the step, to agree on the end of data
        # first (end_of_data.py); traced for the data's spec (`train_on_element`).
        self._train_element = tf.function(self._train_on_element, reduce_retracing=True)
        self._element_specs_traced = []
        # steps_per_execution > 1: several steps per call, as a loop in the graph.
        self._train_many = tf.function(self._train_many_on_iterator, reduce_retracing=True)
        self.eval_step = tf.function(self._eval_step, reduce_retracing=True)
        self.eval_many_on_iterator = tf.function(self._eval_many_on_iterator, reduce_retracing=True)
        self.predict_step = tf.function(self._predict_step, reduce_retracing=True)
        self.predict_many_on_iterator = tf.function(
            self._predict_many_on_iterator, reduce_retracing=True
        )
        self.last_test_logs = None
        if self.user_steps is not None:
            self.eval_many_on_iterator = self.user_steps.evaluate_batches(self)

    @property
    def state(self) -> EngineState:
        return self.layout.state

    @property
    def lanes(self):
        return self.layout.lanes

    @property
    def update(self):
        """The update hook (replicated or ZeRO, possibly wrapped by a finiteness check)."""
        return self.hooks.update

    @property
    def recomputed(self) -> dict:
        return self.hooks.recomputed

    @property
    def extra_logs(self) -> dict:
        return self.hooks.extra_logs

    # ---- the training step -------------------------------------------------------------

    def _train_on_iterator(self, iterator):
        return self._train_step(*unpack_element(next(iterator)))

    def train_on_element(self, element, element_spec, global_rows: int):
        """One training step on a batch taken outside the step (multi-worker jobs).

        Traced once for `element_spec` (the dataset's) with the batch dimension open, as
        `train_on_iterator` is by its iterator's spec: a worker whose batch is shorter than
        its peers' (an uneven last batch) then runs the trace they run, whose collectives
        have the instance keys theirs have. Traced by the batch's own shape, it retraced
        alone, took new keys, and its peers waited for it until the watchdog ended the job.

        Args:
          global_rows: rows of the global batch (every input shard's batch), which the
            workers agreed on with the end of data; the loss is normalised by it.
        """
        spec = open_batch_spec(element_spec)
        if spec not in self._element_specs_traced:
            self._train_element.get_concrete_function(spec, tf.TensorSpec([], tf.float32))
            self._element_specs_traced.append(spec)
        return self._train_element(element, tf.constant(global_rows, tf.float32))

    def _train_on_element(self, element, global_rows):
        return self._train_step(*unpack_element(element), global_rows=global_rows)

    def train_many_on_iterator(self, iterator, steps: int):
        """`_train_many_on_iterator` compiled once for every step count: the count goes in
        as a tensor, as a Python int would trace the step again for an epoch's shorter
        last call (docs/benchmarks.md#tracing-once)."""
        return self._train_many(iterator, tf.constant(steps, tf.int32))

    def _train_many_on_iterator(self, iterator, steps):
        """Up to `steps` training steps in one call (a loop in the graph, so the host is
        visited once per `steps`); stops early when the data runs out, or after a step
        that stops training (`hooks.stopping_steps`: a non-finite step, so no later step
        of the call moves the weights the trainer's error promises). Returns the logs
        after the last step, with the number of steps run under STEPS_KEY."""
        stopping, agree = self.hooks.stopping_steps, self.agree_on_batches
        with tf.device(self.layout.host):
            batch = tf.constant(0, tf.int32)
            ran = tf.constant(0, tf.int32)
            stopped_before = stopping() if stopping is not None else None
            rows_by_worker = tf.zeros([0 if agree is None else agree.workers], tf.int32)
        for _ in tf.range(steps):
            element = iterator.get_next_as_optional()
            global_rows = None
            if agree is None:
                if not element.has_value():
                    break
            else:  # several workers: every one stops at the first step where any has no batch
                everyone, global_rows, rows_by_worker = agree(element)
                if not everyone:
                    break
            logs = self._train_step(*unpack_element(element.get_value()), global_rows=global_rows)
            batch = logs[BATCH_SIZE_KEY]
            ran += 1
            if stopping is not None:
                with tf.device(self.layout.host):
                    if stopping() > stopped_before:
                        break
        with tf.device(self.layout.host):
            results = {**self._metric_results(), BATCH_SIZE_KEY: batch, STEPS_KEY: ran}
            if agree is not None:
                results[ROWS_BY_WORKER_KEY] = rows_by_worker
            return results

    # The steps are plain graph building (explicit tf.cond / tf.while where needed), so
    # autograph does not convert them, nor the engine and Keras code they call; only the
    # loops over several steps or batches below are converted.
    @tf.autograph.experimental.do_not_convert
    def _train_step(self, features, labels, sample_weight=None, global_rows=None):
        """Args:
        global_rows: rows of the global batch, or None: this worker's rows times the
          input shards (the same batch size on every shard).
        """
        layout, hooks = self.layout, self.hooks
        lane_grads, lane_non_trainable, data_shares, rows = self._step_gradients(
            features, labels, sample_weight, global_rows
        )
        if data_shares:
            lane_grads = correct_data_divisor(
                layout, hooks, self.loss_tracker, lane_grads, data_shares, rows
            )
        hooks.update(lane_grads)
        self._store_non_trainable(lane_non_trainable)
        # Depend on the data itself (a static batch size folds into a constant), so a
        # step whose input ran out increments nothing.
        with tf.device(layout.host), tf.control_dependencies([tree.flatten(features)[0]]):
            if self.step_counter is not None:
                self.step_counter.assign_add(1)
            return {**self._metric_results(), BATCH_SIZE_KEY: tf.identity(rows)}

    @tf.autograph.experimental.do_not_convert
    def _gradients(self, features, labels, sample_weight, global_rows):
        """Phases 1-3 of the step (module doc), up to the lanes' gradients, with the
        metrics updated: (gradients per lane, non-trainable values per lane, the data
        divisors' shares (`correct_data_divisor`), the step's real rows)."""
        layout, hooks = self.layout, self.hooks
        num_lanes, num_micro = len(layout.lanes), self.num_micro_batch
        with tf.device(layout.host):
            batch = StepBatch.split(
                features,
                labels,
                sample_weight,
                num_lanes,
                num_micro,
                self._widest_batch,
                self._fills_whole_copies(features),
            )
            rows = objective.StepRows(
                real_rows=tf.cast(batch.rows, tf.float32),
                lanes=num_lanes * self.data_shards,
                data_shards=self.data_shards,
                single=num_lanes * num_micro * self.data_shards == 1,
                agreed_rows=global_rows,
            )
        lane_grads, lane_non_trainable = [], []
        hooks.lanes.begin_trace()
        hooks.batch_statistics.begin_trace()
        inputs = [
            (
                batch.lane_parts(li, num_micro),
                [None if v is None else v.value for v in layout.state.non_trainable[li]],
                rows,
            )
            for li in range(num_lanes)
        ]
        results = self._emit_lanes(inputs)
        data_shares = []
        for li, (grads, non_trainable, micro_batches) in enumerate(results):
            with hooks.lanes.lane(li):
                for mb in micro_batches:
                    if mb.y_pred is not None:  # the loss lives where the last stage runs
                        hooks.update_metrics(
                            mb.labels, mb.y_pred, mb.loss, mb.mask, mb.rows, mb.weights
                        )
                    if mb.data_share is not None:
                        data_shares.append((li, mb.data_share, mb.data_estimate))
            lane_grads.append(grads)
            lane_non_trainable.append(non_trainable)
        return lane_grads, lane_non_trainable, data_shares, batch.rows

    def _lane_runs(self, inputs) -> list:
        return [
            executor.steps(*inputs[li], task_scope=f"lane{li}")
            for li, executor in enumerate(self.executors)
        ]

    def _emit_lanes_one_by_one(self, inputs) -> list:
        """Emits each lane's whole schedule in turn; per lane, what `LaneExecutor.run`
        returns."""
        results = []
        for li, run in enumerate(self._lane_runs(inputs)):
            with self.hooks.lanes.lane(li):
                results.append(run_to_end(run))
        return results

    def _emit_lanes_compiled(self, inputs) -> list:
        devices = [lane.devices[0] for lane in self.layout.lanes]
        return emit_lanes_compiled(self._lane_runs(inputs), devices, self.hooks)

    def _emit_lanes_in_loops(self, inputs) -> list:
        """Each lane's micro-batches as a loop in the graph (one stage); the loop
        updates the metrics of all but the last micro-batch, returned for the caller."""
        results = []
        for li, executor in enumerate(self.executors):
            with self.hooks.lanes.lane(li):
                grads, non_trainable, last = executor.run_in_loop(*inputs[li], f"lane{li}")
            results.append((grads, non_trainable, [last]))
        return results

    def _emit_lanes_in_lockstep(self, inputs) -> list:
        """Emits the lanes' schedules task by task, all lanes at once, so each backward's
        gradients can be reduced over the lanes right away (`sink.flush`, ZeRO v1) and
        the stage's next task waits for that reduction: no micro-batch's gradients
        outlive their reduce-scatter, and none accumulates in full.

        Without a gradient sink (`StepHooks.lanes_in_lockstep`), it only fixes the
        program order: every lane's task t comes before any lane's task t+1. TF runs
        stateful ops that use no resource (the asserts of transfers' length keys) in
        program order; emitted lane by lane, lane 0's gradient send would wait for lane
        1's forward receive while lane 0's forward waits for lane 1's at a synchronized
        BatchNorm: a deadlock (measured: replicas spanning 2 workers hung)."""
        sink = self.hooks.gradient_sink
        if sink is not None:
            sink.clear()  # a trace given up half-way leaves nothing behind
        runs = self._lane_runs(inputs)
        sent: list = [None] * len(runs)
        results: list = [None] * len(runs)
        while any(result is None for result in results):
            tasks = []
            for li, run in enumerate(runs):
                if results[li] is not None:
                    continue
                with self.hooks.lanes.lane(li):
                    try:
                        tasks.append(run.send(sent[li]))
                    except StopIteration as done:
                        results[li] = done.value
            sent = [None] * len(runs)
            stage, task = tasks[0] if tasks else (None, None)
            if sink is not None and task is not None and task.kind != FORWARD:
                flushed = sink.flush(stage)  # once: it reduces every lane's gradients
                sent = [flushed.get(li) for li in range(len(runs))]
        return results

    def _metric_results(self) -> dict:
        """Running metric values, computed in the step so one call returns the logs."""
        with tf.device(self.layout.host):
            logs = {name: m.result() for name, m in self.named_metrics()}
            logs.update({name: value() for name, value in self.hooks.extra_logs.items()})
            return logs

    def _store_non_trainable(self, lane_values: list[list]) -> None:
        """Writes back non-trainable state; floats are first averaged over all lanes."""
        layout = self.layout
        synced = set(layout.state.synced_non_trainable())
        for k, group in enumerate(layout.stage_groups):
            idx = [i for i in layout.non_trainable_idx[k] if i in synced]
            members = layout.stage_lanes[k]
            if idx and members:
                per_member = [[lane_values[li][i] for i in idx] for li in members]
                buckets = comm.plan_buckets([1] * len(idx), [v.dtype for v in per_member[0]], 1)
                results = comm.fused_all_reduce(group, per_member, buckets, "mean")
                for li, member in zip(members, results):
                    for i, value in zip(idx, member):
                        lane_values[li][i] = value
        assigned: set[int] = set()  # under offload the lanes share one copy
        for li, values in enumerate(lane_values):
            for variable, value in zip(layout.state.non_trainable[li], values):
                if variable is not None and id(variable) not in assigned:
                    assigned.add(id(variable))
                    variable.assign(value)

    def update_metrics(self, labels, y_pred, loss, mask=None, rows=None, weights=None) -> None:
        """The default `update_metrics` hook: one micro-batch's loss and metrics.

        Args:
          loss: the micro-batch's reported loss, per real row (objective.py).
          mask: 1 on real rows, 0 on rows added to fill the batch (None: all real). As in
            Keras, `metrics` get only this, `weighted_metrics` the data's sample weights.
          rows: real rows of the micro-batch (None: all of them).
          weights: the sample weights (0 on added rows), or None: the mask.
        """
        with tf.device(self.layout.host):
            first = tree.flatten(labels)[0]
            # A static batch size is a constant: tie it to the data, so a step whose input
            # ran out does not count its samples.
            with tf.control_dependencies([first]):
                batch = tf.identity(tf.shape(first)[0] if rows is None else rows)
            if loss is not None:  # None: reported once for the step (a data divisor)
                self._update_loss_trackers(loss, batch)
            self._update_output_metrics(labels, y_pred, mask, weights)

    def named_metrics(self) -> list:
        """[(log key, metric)] in Keras's order: the loss, the compiled metrics, each
        output's loss."""
        return [
            (self.loss_tracker.name, self.loss_tracker),
            *((self.metrics.name(m), m) for _, m in self.metrics),
            *((t.name, t) for t in self.output_loss_trackers),
        ]

    def _fills_whole_copies(self, features) -> bool:
        """Whether a batch that must be filled up gets whole copies of each part's real
        rows (`objective.fill_rows`): the model adds losses of its own, which Keras
        computes over the batch's real rows. Found on the first trace, from its features."""
        if self._whole_copies is None:
            self._whole_copies = adds_losses(self.layout.staged.model, features)
        return self._whole_copies

    def _update_loss_trackers(self, reported, batch) -> None:
        """`reported`: [the loss, the micro-batch's share of the step's rows (over all
        workers), each output's own loss] (pipeline.py's `_loss`).

        The loss is averaged over rows; each output's loss over steps, each step's
        counting once whatever its rows, as Keras's `CompileLoss` trackers average them
        (their weight, the batch's static row count, is unknown in Keras's traced step).
        """
        self.loss_tracker.update_state(reported[0], sample_weight=batch)
        for i, tracker in enumerate(self.output_loss_trackers):
            tracker.update_state(reported[2 + i], sample_weight=reported[1])

    def _update_output_metrics(self, labels, y_pred, mask, weights=None) -> None:
        if not len(self.metrics):
            return
        flat_true = self.hooks.loss_fn.flat_labels(labels, y_pred)
        flat_pred = tree.flatten(y_pred)
        for index, metric in self.metrics:
            y_true, y = flat_true[index], flat_pred[index]
            weight = mask
            if id(metric) in self.weighted_metrics and weights is not None:
                weight = weights
            if not self.hooks.lanes.update_output_metric(index, metric, y_true, y, weight):
                metric.update_state(y_true, y, sample_weight=weight)

    # ---- evaluation and prediction ---------------------------------------------------------

    @property
    def _eval_pieces(self) -> int:
        """Micro-batches of a lane's evaluation or prediction batch: with several stages,
        the stages work on different micro-batches at once (a forward-only pipeline)."""
        return self.num_micro_batch if self.layout.num_stages > 1 else 1

    def _forward(self, li: int, features, share_outputs: bool = False, mask=None):
        """The lane's outputs and auxiliary losses (averaged over micro-batches, as the
        training objective weighs them) for `features`, in `_eval_pieces` micro-batches:
        stage k of micro-batch j needs only stage k-1 of micro-batch j, so stages on
        different devices overlap.

        When the lane's last stage runs on another worker, the outputs are (None, [])
        here, unless `share_outputs` (predict): then that worker sends them over.
        """
        layout, hooks = self.layout, self.hooks
        lane, staged, state = layout.lanes[li], layout.staged, layout.state
        boundaries = self.boundaries[li]
        pieces = split_batch(features, self._eval_pieces)
        values = [dict(zip(staged.input_keys, staged.flatten_inputs(f))) for f in pieces]
        # Each piece's auxiliary losses are its real rows' mean: weighed by its real rows.
        shares = [1.0 / len(values)] * len(values)
        if mask is not None and len(values) > 1:
            rows = [tf.reduce_sum(m) for m in split_batch(mask, len(values))]
            shares = [tf.math.divide_no_nan(r, tf.add_n(rows)) for r in rows]
        aux_total = []
        for k, stage in enumerate(staged.stages):
            if not lane.is_local(k):
                for piece in values:
                    boundaries.forward_receives(k, piece)
                continue
            with tf.device(lane.devices[k]):
                variables = [v.value for v in layout.stage_variables(li, k)]
                non_trainable = [
                    state.non_trainable[li][i].value for i in layout.non_trainable_idx[k]
                ]
                for piece, scale in zip(values, shares):
                    outputs, _, aux = hooks.eval_stage_calls[k](
                        variables, non_trainable, staged.stage_arguments(stage, piece), False
                    )
                    piece.update(staged.stage_results(stage, outputs))
                    if boundaries is not None:
                        boundaries.forward_sends(k, piece)
                    aux_total.extend(
                        tf.identity(a) if isinstance(scale, float) and scale == 1
                        else tf.identity(a) * tf.cast(scale, a.dtype)
                        for a in aux
                    )  # fmt: skip
        if boundaries is not None and share_outputs:
            for piece in values:
                if lane.is_local(layout.num_stages - 1):
                    boundaries.output_sends(piece)
                else:
                    boundaries.output_receives(piece)
        elif not lane.is_local(layout.num_stages - 1):
            return None, []
        outputs = [staged.pack_outputs([v[key] for key in staged.output_keys]) for v in values]
        if len(outputs) > 1:
            outputs = [tree.map_structure(lambda *xs: tf.concat(xs, axis=0), *outputs)]
        return hooks.output_cast(outputs[0]), hooks.output_cast(aux_total)

    @tf.autograph.experimental.do_not_convert
    def _eval_step(self, features, labels, sample_weight=None, pad_to: int = 0):
        layout, hooks = self.layout, self.hooks
        num_lanes = len(layout.lanes)
        with tf.device(layout.host):
            real_rows = tf.cast(tf.shape(tree.flatten(features)[0])[0], tf.float32)
            structures = (features, labels) if sample_weight is None else (
                features, labels, tf.cast(sample_weight, tf.float32))  # fmt: skip
            # The full batches' shape only where collectives fix it (split layers, a lane
            # across workers): a batch filled up to it cannot always hold whole copies.
            fixed = self.hooks.fixed_batch_shape or any(b is not None for b in self.boundaries)
            whole = self._fills_whole_copies(features)
            *padded, mask = pad_batch(
                structures,
                num_lanes * self._eval_pieces,
                minimum=pad_to if fixed or not whole else 0,
                whole_copies=whole,
            )
            parts = split_batch((*padded, mask), num_lanes)
            if sample_weight is None:
                parts = [(f, y, None, w) for f, y, w in parts]
            rows = objective.StepRows(real_rows, num_lanes * self.data_shards, self.data_shards)
        hooks.lanes.begin_trace()
        for li, (f, y, sw, w) in enumerate(parts):
            with hooks.lanes.lane(li):
                y_pred, aux = self._forward(li, f, mask=w)
                if y_pred is None:  # the loss and metrics are computed where y_pred is
                    continue
                with tf.device(layout.lanes[li].devices[-1]):
                    count = tf.reduce_sum(w)
                    # (copies that fill the batch up carry their row's sample weight)
                    weights = w if sw is None else sw * objective.per_row(w, sw)
                    real_rows = tf.cast(count, tf.int32)
                    terms = hooks.loss_fn.terms(y, y_pred, weights, real_rows=real_rows)
                    if not (terms or aux):
                        raise ValueError(objective.NO_LOSS_MESSAGE)
                    padded = tf.shape(w)[0]
                    loss = objective.micro_batch_report(terms, padded, count, rows)
                    if aux:
                        loss = loss + tf.add_n(aux)
                    outputs = objective.output_reports(terms, padded, count, rows)
                    share = count / rows.global_rows
                with tf.device(layout.host):
                    self._update_loss_trackers(tf.stack([loss, share, *outputs]), count)
                    weighted = None if sw is None else sw * objective.per_row(w, sw)
                    self._update_output_metrics(y, y_pred, w, weighted)

    @tf.autograph.experimental.do_not_convert
    def _predict_step(self, features, pad_to: int = 0):
        layout, hooks = self.layout, self.hooks
        num_lanes = len(layout.lanes)
        with tf.device(layout.host):
            batch = tf.shape(tree.flatten(features)[0])[0]
            features, _ = pad_batch((features,), num_lanes * self._eval_pieces, pad_to)[:2]
            parts = split_batch(features, num_lanes)
        hooks.lanes.begin_trace()
        outputs = []
        for li, f in enumerate(parts):
            with hooks.lanes.lane(li):
                outputs.append(self._forward(li, f, share_outputs=True)[0])
        with tf.device(layout.host):
            return hooks.lanes.join_predictions(outputs, batch)


BATCH_SIZE_KEY = "_batch_size"
STEPS_KEY = "_steps"  # steps run by one call of train_many_on_iterator
# ... and, in a multi-worker job, each worker's rows at its last agreement (0: no batch)
ROWS_BY_WORKER_KEY = "_rows_by_worker"
