"""Which tensors cross worker boundaries, and the keys both sides of a transfer agree on
(single process; the real transfers run in tests/test_span_workers.py)."""

import concurrent.futures
import os
import sys

import pytest
import tensorflow as tf

from epl_trainer.core import comm
from epl_trainer.core.comm import keys
from epl_trainer.core.engine.engine import data_shards
from epl_trainer.core.engine.pipeline.boundaries import Boundaries, LaneBoundaries, Route
from epl_trainer.core.engine.state import Lane
from epl_trainer.core.graph.partition import partition_model, tensor_key
from epl_trainer.core.plan.ir import PlanError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
import train_span

DEVICES = tuple(f"/job:worker/replica:0/task:{w}/device:CPU:{d}" for w in (0, 1) for d in (0, 1))


def _four_stages():
    model = train_span.make_model()
    stage_of = {"dense_a": 0, "dense_b": 1, "norm": 2, "join": 3, "logits": 3}
    return model, partition_model(model, lambda node: stage_of[node.operation.name], 4)


def test_a_tensor_read_by_two_stages_of_another_worker_travels_once():
    model, staged = _four_stages()
    boundaries = Boundaries(staged)
    lane = Lane(0, DEVICES, workers=(0, 0, 1, 1), worker=0)
    routes = boundaries.routes(lane)
    h1 = tensor_key(model.get_layer("dense_a").output)
    h2 = tensor_key(model.get_layer("dense_b").output)
    # dense_a's output feeds dense_b (same worker: no transfer) and join (stage 3, on
    # worker 1); dense_b's output crosses to norm (stage 2), the first stage of worker 1.
    assert sorted(routes, key=lambda r: r.producer) == [Route(h1, 0, 3), Route(h2, 1, 2)]


def test_a_lane_on_one_worker_has_no_routes():
    _, staged = _four_stages()
    lane = Lane(0, DEVICES, workers=(1, 1, 1, 1), worker=1)
    assert Boundaries(staged).routes(lane) == []
    assert not lane.spans_workers and lane.is_local(3)


def test_instance_keys_count_per_group():
    """A worker outside a group builds none of its collectives; the keys of the groups it
    is in must not shift (they did with one job-wide counter)."""
    a = keys.group_key(DEVICES[:2])
    b = keys.group_key(DEVICES[2:])
    first_a = keys.next_instance_key(a)
    for _ in range(3):
        keys.next_instance_key(b)  # another worker's group
    assert keys.next_instance_key(a) == first_a + 1


def test_workers_sharing_a_replica_read_the_same_shard():
    lanes = [
        [Lane(0, DEVICES[:2], (0, 1), 0), Lane(1, DEVICES[2:], (0, 1), 0)],
        [Lane(0, DEVICES[:2], (0, 1), 1), Lane(1, DEVICES[2:], (0, 1), 1)],
    ]
    assert data_shards(lanes) == (1, [0, 0])
    assert data_shards([[Lane(0, DEVICES[:1])], [Lane(1, DEVICES[1:2])]]) == (2, [0, 1])
    worker_0 = [Lane(0, DEVICES[:2], (0, 1), 0)]
    worker_1 = [Lane(0, DEVICES[:2], (0, 1), 1), Lane(1, DEVICES[2:], (1, 1), 1)]
    overlapping = [worker_0, worker_1]
    with pytest.raises(PlanError, match="must compute the same replicas"):
        data_shards(overlapping)


def test_a_transfer_moves_a_tensor_between_two_local_devices(monkeypatch):
    """The same op pair as across workers, here between two logical devices. Each side
    is traced as its own worker would: from the same key counters."""
    source, destination = "/device:CPU:0", "/device:CPU:1"
    x = tf.reshape(tf.range(12, dtype=tf.float32), [4, 3])
    spec = tf.TensorSpec([None, 3], tf.float32)

    def traced(side):
        monkeypatch.setattr(keys, "_instance_counters", {})
        monkeypatch.setattr(keys, "_dynamic_counters", {})
        transfer = comm.PairTransfer(source, destination, side)
        if side == source:
            return tf.function(lambda v: transfer.send(v, unit=3)).get_concrete_function(spec)
        receive = lambda v: transfer.receive([tf.shape(v)[0], 3], tf.float32, unit=3)  # noqa: E731
        return tf.function(receive).get_concrete_function(spec)

    send, receive = traced(source), traced(destination)
    for batch in (x, x[:2]):  # another batch size takes another key (TF fixes its shape)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            pool.submit(send, batch)
            received = pool.submit(receive, batch).result(timeout=60)
        tf.debugging.assert_equal(received, batch)


def test_a_send_does_not_wait_for_an_earlier_receive_of_its_device(monkeypatch):
    """Transfers order on two chains per device, sends and receives (keys.TRANSFER_CHAINS).
    Device B receives Z from C, then sends Y to A (its program order); A only receives Y,
    and C sends Z only once A is done. On one chain per device (before), B's send waited
    for its receive, which waited for C, which waited for A: A never got Y (measured:
    A's call timed out). In a pipeline, a stage's send likewise no longer waits for the
    next transfer it receives, and the peer it sends to is not held at that point."""
    a, b, c = "/device:CPU:0", "/device:CPU:1", "/device:CPU:2"
    y, z = tf.constant([[1.0, 2.0]]), tf.constant([[3.0, 4.0]])
    spec = tf.TensorSpec([1, 2], tf.float32)

    def traced(side, function):  # from fresh key counters, as its own worker would
        monkeypatch.setattr(keys, "_instance_counters", {})
        monkeypatch.setattr(keys, "_dynamic_counters", {})
        return tf.function(function, input_signature=[spec]).get_concrete_function()

    def on_b(value):
        with tf.device(b):
            got = comm.PairTransfer(c, b, b).receive([1, 2], tf.float32, unit=2)
            comm.PairTransfer(b, a, b).send(value, unit=2)
            return got

    receive_y = traced(a, lambda _: comm.PairTransfer(b, a, a).receive([1, 2], tf.float32, unit=2))
    send_y = traced(b, on_b)
    send_z = traced(c, lambda value: comm.PairTransfer(c, b, c).send(value, unit=2))
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        on_a, b_done = pool.submit(receive_y, y), pool.submit(send_y, y)
        try:
            received_y = on_a.result(timeout=30)
        finally:
            pool.submit(send_z, z)  # lets B finish (and A, had it hung)
        tf.debugging.assert_equal(received_y, y)
        tf.debugging.assert_equal(b_done.result(timeout=60), z)


def test_the_sends_of_a_block_are_collected():
    """`collecting_sends` yields the outputs of the sends built inside it (the executor
    makes the sending stage's next W wait for them); sends outside any block, such as
    predictions sent to the lane's other workers, are not kept."""
    _, staged = _four_stages()
    lane_boundaries = LaneBoundaries(Boundaries(staged), Lane(0, DEVICES, (0, 0, 1, 1), 0))

    class Transfer:
        def send(self, value, unit, send_shape=False):
            return tf.identity(value)

    spec = tf.TensorSpec([None, 3], tf.float32)
    value = tf.zeros([2, 3])
    lane_boundaries._send(Transfer(), value, spec)  # outside: not collected
    with lane_boundaries.collecting_sends() as sent:
        lane_boundaries._send(Transfer(), value, spec)
        lane_boundaries._send(Transfer(), value + 1, spec)
    assert len(sent) == 2
    tf.debugging.assert_equal(sent[1], value + 1)
    lane_boundaries._send(Transfer(), value, spec)  # after: not collected either
    assert len(sent) == 2 and lane_boundaries._sent is None
