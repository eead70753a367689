"""One lane's micro-batches through its stages, in pipeline-schedule order.

A lane is one device per stage (see state.py). Each (stage, micro-batch) forward is a
stateless call of the stage's sub-model recorded by its own tape; each backward is that
tape's `gradient()` called under the stage's device, with the gradients of the stage's
outputs routed back by tensor key; a zero-bubble schedule's W runs the part of that call
only the weight gradients need (split_backward.py). The schedule (schedule.py) is data;
here it becomes control dependencies: every task of a stage waits for the previous task
of the same stage (of the same device, when a device runs several stages: interleaved
1F1B), so the runtime follows the schedule and frees a micro-batch's activations as soon
as its backward has run. With stages on other workers, a W (which no stage waits for)
also waits for its stage's sends since its previous W, so that its ops do not delay
them (docs/reference/pipelines.md).

A stage adds each micro-batch's weight gradients to running sums, and its next backward
(W of a split one) waits for those sums. Without that wait, grappler's arithmetic
optimizer rewrites the chain of adds into one AddN over every micro-batch's gradients,
which runs after the last backward: the stage would hold a full set of gradients per
micro-batch until then. An add that drives a control dependency is left as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import typing

import tensorflow as tf
from keras import tree

from epl_trainer.core import comm
from epl_trainer.core.engine import objective as objective_lib
from epl_trainer.core.engine.pipeline.split_backward import release, split_gradient
from epl_trainer.core.graph.partition import StagedModel
from epl_trainer.core.plan.schedule import BACKWARD, FORWARD, WEIGHT, Task

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _StageRun:
    """What the forward of one (stage, micro-batch) leaves for its backward."""

    tape: tf.GradientTape
    variables: list  # the values the forward read, the gradient's sources
    input_keys: list
    inputs: list
    outputs: dict
    objective: tf.Tensor | None  # loss (last stage) or auxiliary losses, already scaled
    # ZeRO v2 gathered per segment: each source's position among the stage's variables
    # (a variable two segments use has two sources); None: `variables` is in stage order.
    positions: list | None = None


class MicroBatchInput(typing.NamedTuple):
    """One micro-batch of the step's batch (program.py's `StepBatch`).

    Attributes:
      weights: per-row loss weights (the data's sample weights, 0 on rows added to fill
        the batch), or None: all 1.
      mask: 1 on real rows, 0 on added ones, or None: all real.
      rows: real rows (int32), or None: all.
    """

    features: typing.Any
    labels: typing.Any
    weights: tf.Tensor | None
    mask: tf.Tensor | None
    rows: tf.Tensor | None


@dataclasses.dataclass
class MicroBatch:
    """The tensors of one micro-batch while it moves through the stages."""

    values: dict  # tensor key -> tensor: model inputs and stage outputs
    labels: object
    index: int | None  # position among the lane's micro-batches (None: a loop's step)
    weights: tf.Tensor | None = None  # as MicroBatchInput's
    mask: tf.Tensor | None = None
    rows: tf.Tensor | None = None
    # A loss divisor known only from the data (objective.py): [divisor, weighted loss
    # sum] of this micro-batch, and the global divisor its objective assumed. Its loss is
    # then reported once per step (program.py), not per micro-batch (`loss` is None).
    data_share: tf.Tensor | None = None
    data_estimate: tf.Tensor | None = None
    runs: dict = dataclasses.field(default_factory=dict)  # stage -> _StageRun
    # A split backward's W: stage -> (its _StageRun, split_backward.PendingWeights)
    pending_weights: dict = dataclasses.field(default_factory=dict)
    upstream: dict = dataclasses.field(default_factory=dict)  # key -> gradient of the loss
    # Reported: [the loss plus every stage's auxiliary losses, the micro-batch's share of
    # the step's rows, each output's own loss] (program.py's `_update_loss_trackers`).
    loss: tf.Tensor | None = None
    y_pred: object = None
    earlier_aux: list = dataclasses.field(default_factory=list)  # aux losses of earlier stages


class LaneExecutor:
    """Builds one lane's forward and backward ops for a training step.

    Args:
      staged: the model cut into stages.
      devices: the lane's device per stage.
      variables: the lane's trainable variable copies (model order).
      trainable_idx, non_trainable_idx: per stage, the model-order indices it reads, in
        its sub-model's variable order (layout.py's `read_idx`).
      order: (stage, Task) pairs in a dependency-respecting order (schedule.py).
      num_micro_batch: micro-batches per step (losses are scaled by its inverse).
      hooks: the step's `StepHooks`, read while tracing: `stage_calls[k]` (how stage k's
        forward runs), `loss_fn`, `output_cast` and `loss_scale` (AMP).
      sparse_gradients: keep Embedding gradients as IndexedSlices.
      embedding_tables: model-order indices of Embedding tables (their gradients are
        the IndexedSlices `run_in_loop` carries as rows).
      lane: this worker's view of the lane; stages on other workers are not computed
        here, their transfers are (boundaries.py).
      boundaries: the lane's cross-worker transfers, or None when all stages are local.
      position: the lane's position among this worker's lanes (for `gradient_sink`).
      stage_variables: per stage, the variables it reads (`trainable_idx[k]` of
        `variables`, but a stage's own copy of a tied weight, state.py); None: those of
        `variables`. A tied weight's gradients from its stages add up in `grads`.
      chains: per stage, whose order its tasks follow (`schedule.stage_chains`: the
        schedule's device of the stage); None: each stage its own.
      unread_idx: per stage, the indices of `trainable_idx[k]` the stage does not read
        (layout.py `unread_idx`): their zero gradient is not accumulated, so a table's
        rows (IndexedSlices) from the stage that reads it stay rows.
    """

    def __init__(
        self,
        staged: StagedModel,
        devices,
        variables,
        trainable_idx,
        non_trainable_idx,
        order: list[tuple[int, Task]],
        num_micro_batch: int,
        hooks,
        sparse_gradients: bool = False,
        embedding_tables: frozenset = frozenset(),
        lane=None,
        boundaries=None,
        position: int = 0,
        stage_variables=None,
        chains=None,
        unread_idx=None,
    ):
        self.staged = staged
        self.unread_idx = unread_idx or [frozenset()] * len(staged.stages)
        self.chains = tuple(chains) if chains is not None else tuple(range(len(staged.stages)))
        self.stage_variables = stage_variables or [
            [variables[i] for i in idx] for idx in trainable_idx
        ]
        self.position = position
        self.lane = lane
        self.boundaries = boundaries
        self.devices = devices
        self.variables = variables
        self.trainable_idx = trainable_idx
        self.non_trainable_idx = non_trainable_idx
        self.order = order
        self.num_micro_batch = num_micro_batch
        self.hooks = hooks
        self.sparse_gradients = sparse_gradients
        self.embedding_tables = embedding_tables
        self.num_stages = len(staged.stages)
        self.splits_backward = any(task.kind == WEIGHT for _, task in order)
        self.one_chain_idx = _accumulated_by_one_chain(
            self.trainable_idx, self.unread_idx, self.chains
        )
        # Read by one stage: each gradient added to the running sum is the same lookups'
        # of another micro-batch (a tied weight's are summed per stage: _TiedSums).
        self.one_stage_idx = _accumulated_by_one_chain(
            self.trainable_idx, self.unread_idx, range(len(staged.stages))
        )

    def run(self, parts: list, non_trainable: list, rows, task_scope=None):
        """Emits every task of the schedule for this lane.

        Args:
          parts: the lane's `MicroBatchInput`s.
          rows: the step's `objective.StepRows` (what the loss is divided by).

        Returns:
          (gradients summed over micro-batches, one per trainable variable on its stage
          device; the updated non-trainable values; the micro-batches, for metrics).
        """
        return run_to_end(self.steps(parts, non_trainable, rows, task_scope))

    def _micro_batch(self, part: MicroBatchInput, index: int | None) -> MicroBatch:
        values = dict(zip(self.staged.input_keys, self.staged.flatten_inputs(part.features)))
        return MicroBatch(values, part.labels, index, part.weights, part.mask, part.rows)

    def steps(self, parts: list, non_trainable: list, rows, task_scope=None):
        """`run` one task at a time: a generator that yields (stage, task) after emitting
        each task of the schedule and returns what `run` returns. The program can then
        walk all lanes in lockstep and `send` back tensors the stage's next task must
        wait for (ZeRO v1: the reduce-scatter of the micro-batch's gradients)."""
        self.rows = rows
        micro_batches = [self._micro_batch(part, j) for j, part in enumerate(parts)]
        non_trainable = list(non_trainable)
        # Per stage, its variables' values, read once per step and shared by its
        # micro-batches (ZeRO v2: the gather of the stage's parameters).
        self._read_values: dict[int, list] = {}
        grads: list = [None] * len(self.variables)
        # Per chain: the running sums its last accumulation made, which its next one
        # waits for (the module docstring: no AddN over every micro-batch's gradients).
        self._running_sums: dict = {}
        self._tied_sums: dict = {}  # variable -> _TiedSums (a weight several stages read)
        previous: dict = {}  # per chain (a device of the schedule): tensors ending its last task
        sent_since_w: dict = {}  # per chain: its sends to other workers since its last W
        collecting = self.boundaries is not None and self.splits_backward  # for Ws to wait
        collect_sends = self.boundaries.collecting_sends if collecting else contextlib.nullcontext
        clock = self.hooks.task_clock
        if clock is not None:
            clock.begin(self.position)
        for stage, task in self.order:
            mb = micro_batches[task.micro_batch]
            chain = self.chains[stage]
            after = previous.get(chain, [])
            if task.kind == WEIGHT:
                after = [*after, *sent_since_w.pop(chain, [])]
            if self._accumulates(task):
                after = [*after, *self._running_sums.pop(chain, [])]
            name = f"{task_scope or 'lane'}_stage{stage}_{task.kind}{task.micro_batch}"
            if self.lane is not None and not self.lane.is_local(stage):
                # Another worker computes this task; build this side of its transfers.
                with tf.name_scope(name + "_remote"):
                    if task.kind == FORWARD:
                        self.boundaries.forward_receives(stage, mb.values)
                    elif task.kind == BACKWARD:  # a W sends nothing
                        self.boundaries.gradient_receives(stage, mb.values, mb.upstream)
                yield stage, task
                continue
            with tf.name_scope(name), tf.control_dependencies(after), collect_sends() as sent:
                if clock is not None:
                    waits = [*after, *self._task_inputs(stage, task, mb)]
                    clock.start(self.position, stage, waits, chain=chain)
                if task.kind == FORWARD:
                    previous[chain] = self._forward(stage, mb, non_trainable)
                elif task.kind == WEIGHT:
                    previous[chain] = self._weights(stage, mb, grads, after)
                else:
                    # B of stage 0 in a split backward computes nothing (no input
                    # gradient): the stage's next task then waits for the one before it.
                    markers = self._backward(stage, mb, grads, self.splits_backward)
                    previous[chain] = markers or after
                if clock is not None:
                    clock.end(self.position, stage, task, previous[chain], chain=chain)
            sent_since_w.setdefault(chain, []).extend(sent or [])
            wait_for = yield stage, task
            if wait_for:
                previous[chain] = list(previous[chain]) + list(wait_for)
        if clock is not None:
            clock.finish(self.position)
        return grads, non_trainable, micro_batches

    def _accumulates(self, task: Task) -> bool:
        """Whether the task adds weight gradients to the running sums (W of a split
        backward, else B)."""
        return task.kind == WEIGHT or (task.kind == BACKWARD and not self.splits_backward)

    def _task_inputs(self, k: int, task: Task, mb: MicroBatch) -> list:
        """What a task reads from other stages (F: activations; B: output gradients)."""
        if task.kind == FORWARD:
            return [mb.values[key] for key in self.staged.stages[k].input_keys if k > 0]
        if task.kind == BACKWARD:
            return [mb.upstream[key] for key in mb.runs[k].outputs if key in mb.upstream]
        return []

    def run_in_loop(self, parts: list, non_trainable: list, rows, task_scope=None):
        """`run` for a lane of one stage, its micro-batches as a loop in the graph.

        One stage's schedule is F0 B0 F1 B1 ...: each iteration runs one micro-batch's
        forward and backward and adds its gradients to the running sums (loop variables), so
        the traced step holds the micro-batch twice whatever the micro-batch count, where
        unrolled each micro-batch adds its own copy (docs/benchmarks.md#trace-cost). The
        last micro-batch runs after the loop, as the unrolled step runs it, so the gradient
        reductions that follow can start while its backward still computes the earlier
        layers. An Embedding's sparse gradient is carried as rows in TensorArrays: the step
        gets the same IndexedSlices as unrolled (Keras's global norm counts repeated rows
        separately, so merging them would change the clipping); rows looked up at constant
        indices (a position embedding) are summed over the micro-batches after the loop,
        as `accumulate` sums them unrolled. The losses and metrics of
        the looped micro-batches are updated inside the loop, by `hooks.update_metrics`.

        Returns:
          (gradients summed over micro-batches, the updated non-trainable values, the
          last micro-batch, whose loss and metrics the caller updates; its
          `data_share` then covers every micro-batch of the lane).
        """
        self.rows = rows
        self._running_sums = {}  # the last micro-batch's sums: nothing waits for them
        stacked = tf.nest.map_structure(lambda *xs: None if xs[0] is None else tf.stack(xs), *parts)
        self._read_values = {}
        owned = self.trainable_idx[0]
        sparse = [i for i in owned if self.sparse_gradients and i in self.embedding_tables]
        dense = [i for i in owned if i not in sparse]
        with tf.device(self.devices[0]):
            values = dict(zip(owned, self._stage_values(0)))  # read once, outside the loop
            sums = [tf.zeros(values[i].shape, values[i].dtype) for i in dense]
            rows = [_RowArrays.empty(values[i]) for i in sparse]
        carried = [i for i, v in enumerate(non_trainable) if v is not None]
        name = f"{task_scope or 'lane'}_stage0"
        # Per sparse table, its rows' indices when the body (traced once) proves them
        # constant: the same rows in every micro-batch.
        constant_rows: dict = {}

        def micro_batch(step, state: list, grads: list) -> MicroBatch:
            part = tf.nest.map_structure(lambda x: None if x is None else x[step], stacked)
            mb = self._micro_batch(part, None)
            with tf.name_scope(name + "_F"):
                self._forward(0, mb, state)
            with tf.name_scope(name + "_B"):
                self._backward(0, mb, grads)
            return mb

        def body(step, sums, row_arrays, carried_values, data_share):
            state = list(non_trainable)
            for index, value in zip(carried, carried_values):
                state[index] = value
            grads: list = [None] * len(self.variables)
            mb = micro_batch(step, state, grads)
            self.hooks.update_metrics(mb.labels, mb.y_pred, mb.loss, mb.mask, mb.rows, mb.weights)
            with tf.device(self.devices[0]):
                sums = [total + tf.convert_to_tensor(grads[i]) for total, i in zip(sums, dense)]
                row_arrays = [r.write(step, grads[i]) for r, i in zip(row_arrays, sparse)]
                for i in sparse:
                    if _is_slices(grads[i]):
                        constant_rows[i] = comm.constant_value(grads[i].indices)
                if mb.data_share is not None:
                    data_share += mb.data_share
            return step + 1, sums, row_arrays, [state[index] for index in carried], data_share

        last = self.num_micro_batch - 1
        with tf.device(self.devices[0]):
            no_share = tf.zeros([2])
        _, sums, row_arrays, carried_values, looped_share = tf.while_loop(
            lambda step, *_: step < last,
            body,
            (tf.constant(0), sums, rows, [non_trainable[index] for index in carried], no_share),
            parallel_iterations=1,  # one micro-batch's activations alive at a time
        )
        rows = row_arrays
        grads: list = [None] * len(self.variables)
        for i, total in zip(dense, sums):
            grads[i] = total
        with tf.device(self.devices[0]):
            for i, r in zip(sparse, rows):
                if constant_rows.get(i) is None:
                    grads[i] = r.slices(values[i].shape)
                else:  # the micro-batches' rows summed, with indices provably constant
                    grads[i] = r.summed(constant_rows[i], values[i].shape)
        non_trainable = list(non_trainable)
        for index, value in zip(carried, carried_values):
            non_trainable[index] = value
        mb = micro_batch(tf.constant(last), non_trainable, grads)  # accumulates into grads
        if mb.data_share is not None:
            with tf.device(self.devices[0]):
                mb.data_share = looped_share + mb.data_share
        return grads, non_trainable, mb

    def _forward(self, k: int, mb: MicroBatch, non_trainable: list) -> list:
        staged, stage = self.staged, self.staged.stages[k]
        last = k == self.num_stages - 1
        with tf.device(self.devices[k]):
            tape = tf.GradientTape(watch_accessed_variables=False)
            with tape:
                input_keys = list(stage.input_keys) if k > 0 else []
                if last:  # the loss needs model outputs made by earlier stages too
                    input_keys += [
                        key
                        for key in staged.output_keys
                        if key in mb.values and key not in input_keys
                    ]
                inputs = [mb.values[key] for key in input_keys]
                tape.watch([x for x in inputs if x.dtype.is_floating])
                gathers = None
                if k in self.hooks.gather_per_segment:  # ZeRO v2 + checkpointing
                    gathers = self.hooks.gather_per_segment[k](
                        [self.variables[i] for i in self.trainable_idx[k]], tape.watch
                    )
                    variables = gathers
                else:
                    variables = self._stage_values(k)
                    tape.watch(variables)
                nt_idx = self.non_trainable_idx[k]
                statistics = self.hooks.batch_statistics
                with statistics.forward(self.position, k, mb.index, mb.mask):
                    outputs, new_nt, aux = self.hooks.stage_calls[k](
                        variables,
                        [non_trainable[i] for i in nt_idx],
                        staged.stage_arguments(stage, mb.values),
                        True,
                    )
                results = staged.stage_results(stage, outputs)
                aux = self.hooks.output_cast(list(aux))
                objective = tf.add_n(aux) if aux else None
                if objective is not None:
                    if not last:
                        mb.earlier_aux.append(objective)
                    # Auxiliary losses count once per batch, as in Keras: their mean over
                    # the micro-batches (and, by the reduction, the lanes), each weighed
                    # by its real rows (a micro-batch holds whole copies of them when the
                    # batch was filled up: objective.fill_rows).
                    objective = tf.cast(objective, tf.float32) * self._auxiliary_share(mb)
                if last:
                    table = {**mb.values, **results}
                    mb.y_pred = self.hooks.output_cast(
                        staged.pack_outputs([table[key] for key in staged.output_keys])
                    )
                    loss, mb.loss = self._loss(mb, aux)
                    objective = loss if objective is None else loss + objective
                if objective is not None and self.hooks.loss_scale is not None:
                    objective = objective * self.hooks.loss_scale()  # AMP: fp16 grads survive
        for i, value in zip(nt_idx, new_nt):
            non_trainable[i] = value
        mb.values.update(results)
        if self.boundaries is not None:
            self.boundaries.forward_sends(k, mb.values)
        positions = None
        if gathers is not None:
            positions = [p for p, _ in gathers.sources]
            variables = [v for _, v in gathers.sources]
        mb.runs[k] = _StageRun(tape, variables, input_keys, inputs, results, objective, positions)
        markers = list(_flat_tensors(results)) + ([objective] if objective is not None else [])
        return markers

    def _auxiliary_share(self, mb: MicroBatch):
        """The factor of a micro-batch's auxiliary losses: its real rows' share of the
        job's batch, times the lanes the gradient reduction averages over (1 /
        num_micro_batch when every micro-batch is full)."""
        if mb.rows is None:
            return 1.0 / self.num_micro_batch
        rows = self.rows
        return tf.cast(mb.rows, tf.float32) * float(rows.lanes) / rows.global_rows

    def _loss(self, mb: MicroBatch, aux: list):
        """The micro-batch's share of the global batch's loss (differentiated), and its
        reported loss per real row (objective.py)."""
        terms = self.hooks.loss_fn.terms(mb.labels, mb.y_pred, mb.weights, real_rows=mb.rows)
        if not (terms or aux or mb.earlier_aux):
            raise ValueError(objective_lib.NO_LOSS_MESSAGE)
        padded = tf.shape(tree.flatten(mb.labels)[0])[0]
        data = [term for term in terms if term.kind == objective_lib.DATA]
        if data and not self.rows.single:
            if len(terms) > 1 or aux or mb.earlier_aux:
                raise ValueError(
                    "A loss divided by the data (a mask on the predictions, or reduction="
                    "'mean_with_sample_weight') is exact over micro-batches and replicas "
                    "only as the model's one loss, without auxiliary losses (add_loss, "
                    "regularizers): its divisor is known after every forward, and the "
                    "gradients are corrected by one factor. Train one micro-batch on one "
                    "device, or weight the rows by sample_weight instead of a mask. "
                    f"Received: {len(terms)} output losses, "
                    f"{len(aux) + len(mb.earlier_aux)} auxiliary losses"
                )
            mb.data_share = tf.stack([tf.cast(data[0].divisor, tf.float32),
                                      tf.cast(data[0].total, tf.float32)])  # fmt: skip
            mb.data_estimate = objective_lib.data_estimate(terms, padded, self.rows)
            return objective_lib.micro_batch_objective(terms, padded, self.rows), None
        loss = objective_lib.micro_batch_objective(terms, padded, self.rows)
        real = padded if mb.rows is None else mb.rows
        reported = objective_lib.micro_batch_report(terms, padded, real, self.rows)
        # Every stage's auxiliary losses are part of the reported loss (earlier stages'
        # with tf.stop_gradient: they are differentiated where they were computed).
        extra = [tf.cast(a, tf.float32) for a in aux]
        extra += [tf.stop_gradient(tf.cast(a, tf.float32)) for a in mb.earlier_aux]
        if extra:
            reported = tf.add_n([reported, *extra])
        # What the loss trackers report (program.py's `_update_loss_trackers`).
        outputs = objective_lib.output_reports(terms, padded, real, self.rows)
        share = tf.cast(real, tf.float32) / self.rows.global_rows
        return loss, tf.stack([reported, share, *outputs])

    def _stage_values(self, k: int) -> list:
        if k not in self._read_values:
            self._read_values[k] = [v.value for v in self.stage_variables[k]]
        return self._read_values[k]

    def _backward(self, k: int, mb: MicroBatch, grads: list, split: bool = False) -> list:
        """The backward of (stage k, micro-batch): the inputs' gradients go upstream; the
        weights' are accumulated here, or (`split`: B of a zero-bubble schedule) left
        for `_weights` with the ops only they need held back. Returns the tensors the
        stage's next task waits for."""
        run = mb.runs.pop(k)  # drop the tape's Python references once used
        with tf.device(self.devices[k]):
            targets, output_gradients = [], []
            for key, value in run.outputs.items():
                if key in mb.upstream:
                    targets.append(value)
                    output_gradients.append(mb.upstream.pop(key))
            if run.objective is not None:
                targets.append(run.objective)
                output_gradients.append(tf.ones_like(run.objective))
            float_inputs = [
                (key, x) for key, x in zip(run.input_keys, run.inputs) if x.dtype.is_floating
            ]

            def compute():
                return run.tape.gradient(
                    targets,
                    run.variables + [x for _, x in float_inputs],
                    output_gradients=output_gradients,
                    unconnected_gradients=tf.UnconnectedGradients.ZERO,
                )

            with self.hooks.batch_statistics.backward(self.position, k, mb.index, mb.mask):
                input_grads, pending = split_gradient(compute, len(run.variables), split)
            input_grads = [tf.convert_to_tensor(g) for g in input_grads]
            for (key, _), g in zip(float_inputs, input_grads):
                mb.upstream[key] = g if key not in mb.upstream else mb.upstream[key] + g
        if self.boundaries is not None:
            self.boundaries.gradient_sends(k, mb.values, mb.upstream)
        if split:
            mb.pending_weights[k] = (run, pending)
            return input_grads
        with tf.device(self.devices[k]):
            return self._weight_gradients(k, mb, run, pending.gradients, grads) + input_grads

    def _weights(self, k: int, mb: MicroBatch, grads: list, after: list) -> list:
        """W of a split backward: the held-back ops run after the stage's previous task."""
        run, pending = mb.pending_weights.pop(k)
        release(pending, after)
        with tf.device(self.devices[k]):
            return self._weight_gradients(k, mb, run, pending.gradients, grads)

    def _weight_gradients(self, k: int, mb: MicroBatch, run, computed: list, grads: list):
        """Accumulates one (stage, micro-batch)'s weight gradients into `grads`, or hands
        them to the gradient sink (ZeRO v1); returns them."""
        keep_slices = self.sparse_gradients
        computed = [
            _with_variable_shape(
                g if keep_slices and _is_slices(g) else tf.convert_to_tensor(g), v.shape
            )
            for g, v in zip(computed, run.variables)
        ]
        sink, handed = self.hooks.gradient_sink, {}
        variable_grads = computed
        if run.positions is not None:
            variable_grads = self._by_position(k, run.positions, variable_grads)
        for i, g in zip(self.trainable_idx[k], variable_grads):
            if i in self.unread_idx[k]:
                continue
            if sink is not None and i in sink.covered and not _is_slices(g):
                handed[i] = g  # reduced per micro-batch (ZeRO v1), never accumulated
            elif i not in self.one_stage_idx:  # a tied weight: other stages add to it
                tied = self._tied_sums.setdefault(i, _TiedSums())
                summed = tied.add(k, g)
                grads[i] = tied.total()
                if i in self.one_chain_idx and summed is not g:
                    chain = self.chains[k]
                    self._running_sums.setdefault(chain, []).extend(_sum_tensors(summed))
            elif grads[i] is None:
                grads[i] = g
            else:
                grads[i] = accumulate(grads[i], g, same_lookups=True)
                if i in self.one_chain_idx:
                    chain = self.chains[k]
                    self._running_sums.setdefault(chain, []).extend(_sum_tensors(grads[i]))
        if handed:
            sink.add(self.position, k, handed)
        return computed

    def _by_position(self, k: int, positions: list, gradients: list) -> list:
        """Per-source gradients -> one per stage variable: summed where several segments
        read the variable, zeros where none did."""
        by_position: list = [None] * len(self.trainable_idx[k])
        for p, g in zip(positions, gradients):
            by_position[p] = g if by_position[p] is None else accumulate(by_position[p], g)
        for p, g in enumerate(by_position):
            if g is None:
                variable = self.variables[self.trainable_idx[k][p]]
                by_position[p] = tf.zeros(variable.shape, variable.dtype)
        return by_position


class _TiedSums:
    """The gradients of a weight several stages read (a tied weight), over a lane's
    micro-batches.

    Rows a stage looks up at constant indices (a position table read by two stages) are
    summed per stage over the micro-batches, `accumulate(..., same_lookups=True)`: one
    device's gradient holds each stage's lookups once, summed over the batch, and the
    stages' as rows of their own (the tape concatenates two uses' rows), which Keras's
    Adam squares one by one (tests/test_comm_options.py). Every other gradient (rows of
    token ids, a dense use such as tied logits) goes to one running sum (`accumulate`:
    rows concatenated, or added dense).
    """

    def __init__(self):
        self.by_stage: dict = {}  # stage -> its constant-index rows, summed
        self.rest = None

    def add(self, stage: int, gradient):
        """Adds one (stage, micro-batch)'s gradient; returns the sum it went into."""
        if _is_slices(gradient) and comm.batch_independent(gradient.indices):
            total = self.by_stage.get(stage)
            summed = gradient if total is None else accumulate(total, gradient, True)
            self.by_stage[stage] = summed
        else:
            summed = gradient if self.rest is None else accumulate(self.rest, gradient)
            self.rest = summed
        return summed

    def total(self):
        """The sum of every stage's gradients (only the last one made is computed)."""
        parts = [self.by_stage[k] for k in sorted(self.by_stage)]
        if self.rest is not None:
            parts.insert(0, self.rest)
        total = parts[0]
        for part in parts[1:]:
            total = accumulate(total, part)
        return total


class _RowArrays(typing.NamedTuple):
    """An Embedding gradient's rows over a loop's iterations: values and indices, one
    TensorArray element per micro-batch (a named tuple: a loop variable TF can nest)."""

    values: tf.TensorArray
    indices: tf.TensorArray

    @staticmethod
    def empty(table) -> _RowArrays:
        def array(dtype, shape):
            return tf.TensorArray(dtype, size=0, dynamic_size=True, infer_shape=False,
                                  element_shape=tf.TensorShape(shape))  # fmt: skip

        return _RowArrays(array(table.dtype, [None, *table.shape[1:]]), array(tf.int64, [None]))

    def write(self, step, gradient) -> _RowArrays:
        if not _is_slices(gradient):  # e.g. made dense by a cast: every row of it
            gradient = _dense_as_slices(gradient)
        return _RowArrays(
            self.values.write(step, gradient.values),
            self.indices.write(step, tf.cast(gradient.indices, tf.int64)),
        )

    def slices(self, shape) -> tf.IndexedSlices:
        return tf.IndexedSlices(
            self.values.concat(), self.indices.concat(), tf.constant(shape.as_list(), tf.int64)
        )

    def summed(self, indices, shape) -> tf.IndexedSlices:
        """The iterations' rows summed, every iteration's indices being `indices` (a
        value): one row per index, as one device's gradient of all of them holds."""
        rows = tf.reduce_sum(self.values.stack(), axis=0)
        rows = tf.reshape(rows, [indices.size, *shape[1:]])
        return tf.IndexedSlices(
            rows, tf.constant(indices.reshape(-1), tf.int64), tf.constant(shape.as_list(), tf.int64)
        )


def _dense_as_slices(gradient) -> tf.IndexedSlices:
    rows = tf.range(tf.shape(gradient, out_type=tf.int64)[0])
    return tf.IndexedSlices(gradient, rows, tf.shape(gradient, out_type=tf.int64))


def run_to_end(steps):
    """Drives a `LaneExecutor.steps` generator to its end; returns its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def _is_slices(gradient) -> bool:
    return isinstance(gradient, tf.IndexedSlices)


def _with_variable_shape(gradient, shape):
    """A dense gradient with its variable's static shape.

    Some backward ops (attention over a dynamic sequence length, reshapes of dynamic
    shapes) lose the static shape of a weight's gradient; the reductions that follow
    size fused buckets from static shapes.
    """
    if _is_slices(gradient) or gradient.shape.is_fully_defined():
        return gradient
    return tf.reshape(gradient, shape)


def _accumulated_by_one_chain(trainable_idx, unread_idx, chains) -> frozenset:
    """Model-order indices of the variables whose gradients the stages of one chain
    accumulate. A tied weight read on several devices also gets its other stages'
    gradients: its running sum is not waited for, as a stage would then wait for
    another's backward."""
    chains_of: dict = {}
    for k, idx in enumerate(trainable_idx):
        for i in idx:
            if i not in unread_idx[k]:
                chains_of.setdefault(i, set()).add(chains[k])
    return frozenset(i for i, owners in chains_of.items() if len(owners) == 1)


def _sum_tensors(total) -> list:
    """The tensors of a running sum (an IndexedSlices's rows and indices)."""
    return [total.values, total.indices] if _is_slices(total) else [total]


def accumulate(total, gradient, same_lookups: bool = False):
    """Sum of two gradients; two IndexedSlices stay slices, their rows concatenated.

    With `same_lookups` (two micro-batches' gradients of the same stage's lookups), rows
    looked up at the same constant indices in both (a position embedding at
    `arange(n)`: each row once, summed over the micro-batch) are summed row by row
    instead: one device's gradient of both micro-batches holds each of them once, and
    Keras's Adam, which squares each row before it sums repeated indices, would give
    stacked copies another second moment (tests/test_comm_options.py). Per-sample
    lookups (token ids) stay concatenated, as one device's gradient holds every sample's.
    """
    if _is_slices(total) and _is_slices(gradient):
        if same_lookups and _same_constant(total.indices, gradient.indices):
            return tf.IndexedSlices(
                total.values + gradient.values, total.indices, total.dense_shape
            )
        return tf.IndexedSlices(
            tf.concat([total.values, gradient.values], axis=0),
            # The rows a micro-batch loop carries are int64 (`_RowArrays`).
            tf.concat([total.indices, tf.cast(gradient.indices, total.indices.dtype)], axis=0),
            total.dense_shape,
        )
    return tf.convert_to_tensor(total) + tf.convert_to_tensor(gradient)


def _same_constant(a, b) -> bool:
    """Whether two index tensors are provably constant and equal (comm.constant_value)."""
    if a is b:
        return comm.batch_independent(a)
    first = comm.constant_value(a)
    if first is None:
        return False
    second = comm.constant_value(b)
    return second is not None and first.shape == second.shape and bool((first == second).all())


def stateless_stage_call(model):
    """The default way to run a stage: `(variables, non_trainable, args, training) ->
    (outputs, new non-trainable values, auxiliary losses)`."""

    def call(variables, non_trainable, args, training):
        return model.stateless_call(
            variables, non_trainable, args, **training_kwargs(model, training), return_losses=True
        )

    return call


def compiled_stage_call(call, stage: int, statistics):
    """`call` (a stage call, as above) with its forward compiled by XLA, once for
    training and once for inference. The tape differentiates the compiled function, and
    TensorFlow compiles its backward as well, as `Model.compile(jit_compile=True)` does.

    Every tensor the function reads is an argument: its traces are shared by every
    micro-batch and lane calling it with the same shapes, so a tensor captured by
    closure would be the first caller's. BatchNorm's real rows of the micro-batch
    (`statistics`, the step's `batch_statistics`: `traced_mask`) are taken as an
    argument and installed again inside.

    A training forward with a loop (an RNN layer's `while`) runs as plain ops, with a
    warning: TensorFlow differentiates a loop from its intermediates (TensorLists),
    which cannot leave an XLA function ("Support for TensorList crossing the XLA/TF
    boundary is not implemented"); Keras's compiled step keeps the backward inside.
    """

    def traced(variables, non_trainable, args, row_mask, training):
        with statistics.installed_mask(stage, row_mask):
            return call(variables, non_trainable, args, training)

    compiled = {
        training: tf.function(
            lambda variables, non_trainable, args, row_mask, training=training: traced(
                variables, non_trainable, args, row_mask, training
            ),
            jit_compile=True,
            autograph=False,
        )
        for training in (True, False)
    }

    # Whether the training forward runs as plain ops (it has loops): decided once, at
    # the first trace, for every lane, micro-batch and later trace of the stage.
    plain_training: list[bool] = []

    def run(variables, non_trainable, args, training):
        row_mask = statistics.traced_mask(stage) if training else None
        function = compiled[bool(training)]
        if training:
            if not plain_training:
                traced_graph = function.get_concrete_function(
                    variables, non_trainable, args, row_mask
                ).graph
                loops = _loops_in(traced_graph)
                if loops:
                    _warn_plain_stage(stage, loops)
                plain_training.append(bool(loops))
            if plain_training[0]:
                return call(variables, non_trainable, args, training)
        return function(variables, non_trainable, args, row_mask)

    return run


_LOOPS = ("While", "StatelessWhile")


def _loops_in(graph) -> list[str]:
    """The names of the loops in `graph` and in the functions it calls (a loop inside
    a `tf.cond` branch or a nested `tf.function`: the graph's function library)."""
    graph_def = graph.as_graph_def()
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes.extend(function.node_def)
    return [node.name for node in nodes if node.op in _LOOPS]


def _warn_plain_stage(stage: int, loops: list) -> None:
    logger.warning(
        "jit_compile: stage %d's forward has loops %s (an RNN layer's, for one); TensorFlow "
        "cannot take a loop's gradient from outside an XLA function (TensorList crossing the "
        "XLA/TF boundary), and a compiled stage's backward runs outside its forward's, so "
        "this stage trains as plain TensorFlow ops. A layout compiled whole (one stage and "
        "one micro-batch per lane, without ZeRO or gradient checkpointing) keeps the "
        "backward inside.",
        stage,
        loops,
    )


def training_kwargs(model, training: bool) -> dict:
    # `stateless_call` forwards `training` unconditionally; a subclassed `call` may not
    # accept it (Keras's own `__call__` drops it in that case, so do we).
    return {"training": training} if getattr(model, "_call_has_training_arg", True) else {}


def _flat_tensors(results: dict):
    for value in results.values():
        yield from tf.nest.flatten(value)
