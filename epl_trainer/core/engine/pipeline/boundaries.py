"""Stage boundaries that cross worker processes: which tensors travel, from where to where.

A pipeline replica may place its stages on devices of different workers. Each worker
then traces only its own stages of that lane and walks the *same* schedule: at a task
of a stage on another worker it builds the other half of that task's transfers. So the
two sides of every transfer are built at the same point of the schedule, in the same
order, and their keys meet (comm/transfer.py).

* Forward: the outputs of stage p that stages on another worker W consume travel once
  to W, to the device of the first of those stages (later consumers on W read it
  there). The receiver builds the transfer at p's forward task.
* Backward: the gradient of such a tensor is summed on W over its consumers there and
  sent back after the backward of the first (lowest) consumer on W, the last of them to
  run; the producer's worker receives it at that task and adds it to the gradients of
  its own consumers.

Model inputs are never sent: every worker of a lane reads the same batch. Tensor specs
(dtype, shape) come from the stage sub-models' `compute_output_spec`, so both sides
agree on them without exchanging anything; a dimension other than the batch that is not
static travels as a shape first.
"""

from __future__ import annotations

import contextlib
import dataclasses

import keras
import tensorflow as tf
from keras import tree

from epl_trainer.core import comm
from epl_trainer.core.engine.state import Lane
from epl_trainer.core.graph.partition import StagedModel


@dataclasses.dataclass(frozen=True)
class Route:
    """One tensor key's trip from the producing stage to a consuming worker."""

    key: tuple
    producer: int  # stage that computes the tensor
    consumer: int  # first stage on the receiving worker that reads it

    def transfer(self, lane: Lane, local: str, backward: bool = False) -> comm.PairTransfer:
        source, destination = lane.devices[self.producer], lane.devices[self.consumer]
        if backward:
            source, destination = destination, source
        return comm.PairTransfer(source, destination, local)


class Boundaries:
    """The routes of one staged model (the same for every lane; devices differ).

    Args:
      staged: the model cut into stages.
    """

    def __init__(self, staged: StagedModel):
        self.staged = staged
        num_stages = len(staged.stages)
        self.producer = {}
        for stage in staged.stages:
            for key in stage.output_keys:
                self.producer[key] = stage.index
        self.consumers: dict[tuple, list[int]] = {}
        for stage in staged.stages:
            for key in stage.input_keys:
                if key in self.producer:
                    self.consumers.setdefault(key, []).append(stage.index)
        # The loss, on the last stage, also reads model outputs made by earlier stages.
        last = num_stages - 1
        for key in staged.output_keys:
            if self.producer.get(key, last) != last:
                readers = self.consumers.setdefault(key, [])
                if last not in readers:
                    readers.append(last)
        self._specs: dict[tuple, dict] = {}  # by the model inputs' (shape, dtype)s

    def routes(self, lane: Lane) -> list[Route]:
        """Every cross-worker route of `lane`: one per (tensor, consuming worker)."""
        found = []
        if not lane.spans_workers:
            return found
        for key, stages in self.consumers.items():
            producer = self.producer[key]
            first_on_worker: dict[int, int] = {}
            for c in sorted(stages):
                worker = lane.workers[c]
                if worker != lane.workers[producer]:
                    first_on_worker.setdefault(worker, c)
            found.extend(Route(key, producer, c) for c in first_on_worker.values())
        return found

    def specs(self, input_values: dict) -> dict:
        """{tensor key: KerasTensor} for every stage output, from the model inputs."""
        signature = tuple(
            (key, tuple(x.shape[1:]), x.dtype.name) for key, x in input_values.items()
        )
        if signature not in self._specs:
            values = {
                key: keras.KerasTensor((None, *x.shape[1:]), dtype=x.dtype.name)
                for key, x in input_values.items()
            }
            for stage in self.staged.stages:
                outputs = _output_spec(stage.model, self.staged.stage_arguments(stage, values))
                values.update(self.staged.stage_results(stage, outputs))
            self._specs[signature] = values
        return self._specs[signature]


def _output_spec(model, arguments):
    """The stage model's outputs, each with the dtype its layer computes in.

    A functional model's `compute_output_spec` gives every output the model's own compute
    dtype: float32 under AMP, where a mixed layer's output is float16, so a receiver would
    build a float32 half for a float16 tensor. Running the graph op by op gives each
    layer's own spec.
    """
    run = getattr(model, "_run_through_graph", None)
    if run is None:  # not a functional model: its own spec is its outputs'
        return model.compute_output_spec(arguments)
    return run(model._standardize_inputs(arguments), operation_fn=lambda op: op.compute_output_spec)


class LaneBoundaries:
    """One lane's transfers, built by its executor while it walks the schedule.

    Args:
      boundaries: the model's routes.
      lane: this worker's view of the lane.
    """

    def __init__(self, boundaries: Boundaries, lane: Lane):
        self.boundaries = boundaries
        self.lane = lane
        self.routes = boundaries.routes(lane)
        self._sent: list | None = None  # inside `collecting_sends`: the sends built

    @property
    def active(self) -> bool:
        return bool(self.routes)

    def _spec(self, values: dict, key):
        return self.boundaries.specs(_model_inputs(values, self.boundaries.staged))[key]

    def _shape(self, spec, batch):
        dims = list(spec.shape)
        if any(d is None for d in dims[1:]):
            return None  # sent first
        return [batch, *dims[1:]]

    def _send(self, transfer, value, spec) -> None:
        sent = transfer.send(value, _unit(spec), send_shape=self._shape(spec, 0) is None)
        if self._sent is not None:
            self._sent.append(sent)

    @contextlib.contextmanager
    def collecting_sends(self):
        """Yields a list that receives the outputs of the sends built inside the block
        (each completes once the receiver has taken part)."""
        self._sent = []
        try:
            yield self._sent
        finally:
            self._sent = None

    def _receive(self, transfer, spec, values):
        shape = self._shape(spec, _batch(values, self.boundaries.staged))
        return transfer.receive(shape, spec.dtype, _unit(spec), shape_rank=len(spec.shape))

    def forward_sends(self, stage: int, values: dict) -> None:
        """After stage's forward (local): sends its outputs read on other workers."""
        for route in self.routes:
            if route.producer == stage:
                transfer = route.transfer(self.lane, self.lane.devices[stage])
                self._send(transfer, values[route.key], self._spec(values, route.key))

    def forward_receives(self, stage: int, values: dict) -> None:
        """At a remote stage's forward: receives its outputs that local stages read."""
        for route in self.routes:
            if route.producer == stage and self.lane.is_local(route.consumer):
                transfer = route.transfer(self.lane, self.lane.devices[route.consumer])
                values[route.key] = self._receive(transfer, self._spec(values, route.key), values)

    def gradient_sends(self, stage: int, values: dict, upstream: dict) -> None:
        """After a local stage's backward: sends the summed gradients of the tensors whose
        first consumer on this worker is `stage` back to their (remote) producers."""
        for route in self.routes:
            if route.consumer == stage and route.key in upstream:
                spec = self._spec(values, route.key)
                if not _is_float(spec):
                    continue
                transfer = route.transfer(self.lane, self.lane.devices[stage], backward=True)
                self._send(transfer, upstream.pop(route.key), spec)

    def gradient_receives(self, stage: int, values: dict, upstream: dict) -> None:
        """At a remote stage's backward: receives the gradients it sends to local stages'
        outputs, and adds them to the local consumers' share."""
        for route in self.routes:
            if route.consumer == stage and self.lane.is_local(route.producer):
                spec = self._spec(values, route.key)
                if not _is_float(spec):
                    continue
                device = self.lane.devices[route.producer]
                transfer = route.transfer(self.lane, device, backward=True)
                received = self._receive(transfer, spec, values)
                with tf.device(device):
                    previous = upstream.get(route.key)
                    upstream[route.key] = received if previous is None else previous + received

    def output_sends(self, values: dict) -> None:
        """Predictions: the last stage's worker sends the model outputs to the lane's
        other workers (each worker of a lane returns the lane's predictions)."""
        last = len(self.lane.devices) - 1
        for _, first in self._other_workers(last):
            for key in self.boundaries.staged.output_keys:
                transfer = comm.PairTransfer(
                    self.lane.devices[last], self.lane.devices[first], self.lane.devices[last]
                )
                self._send(transfer, values[key], self._spec(values, key))

    def output_receives(self, values: dict) -> None:
        last = len(self.lane.devices) - 1
        for worker, first in self._other_workers(last):
            if worker != self.lane.worker:
                continue
            for key in self.boundaries.staged.output_keys:
                transfer = comm.PairTransfer(
                    self.lane.devices[last], self.lane.devices[first], self.lane.devices[first]
                )
                values[key] = self._receive(transfer, self._spec(values, key), values)

    def _other_workers(self, last: int) -> list[tuple[int, int]]:
        """(worker, its first stage) for every worker of the lane but the last stage's."""
        seen = {}
        for k, worker in enumerate(self.lane.workers):
            if worker != self.lane.workers[last]:
                seen.setdefault(worker, k)
        return sorted(seen.items())


def _unit(spec) -> int:
    """Elements per row: the product of the static dimensions after the batch."""
    unit = 1
    for d in spec.shape[1:]:
        unit *= d or 1
    return unit


def _is_float(spec) -> bool:
    return tf.as_dtype(spec.dtype).is_floating


def _model_inputs(values: dict, staged: StagedModel) -> dict:
    return {key: values[key] for key in staged.input_keys}


def _batch(values: dict, staged: StagedModel):
    first = tree.flatten(values[staged.input_keys[0]])[0]
    return tf.shape(first)[0]
