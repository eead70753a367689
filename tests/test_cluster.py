"""TF_CONFIG parsing, local devices and epl.init / Env."""

import json
import os
import subprocess
import sys

import pytest
from _launch import ROOT

import epl_trainer as epl
from epl_trainer.runtime.cluster import (
    ClusterError,
    build_cluster,
    configure_tensorflow,
    default_intra_op_threads,
    is_single_worker_job,
    parse_tf_config,
)


def _tf_config(cluster, task_type, index):
    return {
        "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})
    }


def test_without_tf_config_the_job_is_one_local_worker():
    spec = parse_tf_config({})
    assert spec.worker_num == 1 and spec.worker_index == 0


@pytest.mark.parametrize(
    "environ, single",
    [
        ({}, True),
        (_tf_config({"worker": ["a:1"]}, "worker", 0), True),
        (_tf_config({"worker": ["a:1", "b:2"]}, "worker", 1), False),
        ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"}, False),
    ],
)
def test_a_single_worker_job_is_known_before_anything_starts(monkeypatch, environ, single):
    for name in ("TF_CONFIG", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert is_single_worker_job() is single


def test_workers_are_indexed_in_order():
    spec = parse_tf_config(_tf_config({"worker": ["a:1", "b:2", "c:3"]}, "worker", 2))
    assert spec.worker_num == 3 and spec.worker_index == 2
    assert spec.addresses == ("a:1", "b:2", "c:3")


def test_chief_is_worker_zero_and_workers_follow():
    cluster = {"chief": ["c:1"], "worker": ["w:1", "w:2"], "ps": ["p:1"]}
    assert parse_tf_config(_tf_config(cluster, "chief", 0)).worker_index == 0
    spec = parse_tf_config(_tf_config(cluster, "worker", 1))
    assert spec.worker_index == 2 and spec.worker_num == 3  # ps tasks take no part
    assert spec.job_names[2] == ("worker", 1)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"TF_CONFIG": "{not json"}, "not valid JSON"),
        ({"TF_CONFIG": "[1, 2]"}, "must be a JSON object"),
        (
            {"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1"]}})},
            'needs a "cluster" object and a "task"',
        ),
        (_tf_config({"worker": "a:1"}, "worker", 0), r'cluster\["worker"\] must be a list'),
        (_tf_config({"worker": ["a:1"]}, "worker", 3), "index 3 is not in the cluster"),
        (_tf_config({"worker": ["a:1"], "ps": ["p:1"]}, "ps", 0), "no parameter servers"),
        (_tf_config({"evaluator": ["e:1"]}, "worker", 0), 'no "chief" or "worker" tasks'),
    ],
)
def test_malformed_tf_config_is_a_clear_error(environ, message):
    with pytest.raises(ClusterError, match=message):
        parse_tf_config(environ)


def test_local_devices_are_the_first_n_logical_cpus():
    config = epl.Config({"cluster.virtual_devices": 4})
    cluster = build_cluster(config.cluster, environ={})
    assert cluster.worker_num == 1 and cluster.total_gpu_num == 4
    assert [d.rsplit("/", 1)[1] for d in cluster.local_devices] == [
        f"device:CPU:{i}" for i in range(4)
    ]
    assert cluster.device_type == "CPU" and cluster.is_chief


def test_asking_for_more_devices_than_tensorflow_has_is_an_error():
    with pytest.raises(ClusterError, match="already initialised with 8"):
        configure_tensorflow(16)


def test_init_and_env_get():
    env = epl.init({"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2})
    assert epl.Env.get() is env
    assert env.config.pipeline.num_micro_batch == 2
    assert env.cluster.total_gpu_num == 2 and env.cluster.worker_index == 0
    epl.init()  # back to defaults for the other tests
    assert epl.Env.get().cluster.total_gpu_num == 1


@pytest.mark.parametrize(
    "devices, cores, expected",
    [(1, 2, None), (2, 2, 1), (4, 2, 1), (2, 8, 4), (3, 8, 2)],
)
def test_simulated_devices_share_the_cores(devices, cores, expected):
    assert default_intra_op_threads(devices, cores) == expected


_THREADS_PROBE = """
import json, sys
import tensorflow as tf
import epl_trainer as epl
epl.init(json.loads(sys.argv[1]))
print(tf.config.threading.get_intra_op_parallelism_threads(),
      tf.config.threading.get_inter_op_parallelism_threads())
"""


@pytest.mark.parametrize(
    "config, expected",
    [
        ({"cluster.virtual_devices": 2}, (max(1, len(os.sched_getaffinity(0)) // 2), 0)),
        ({}, (0, 0)),  # one device: TensorFlow's defaults
        (
            {"cluster.virtual_devices": 2, "cluster.intra_op_threads": 3,
             "cluster.inter_op_threads": 5},
            (3, 5),
        ),
    ],
)  # fmt: skip
def test_init_sets_the_thread_pools(config, expected):
    # Thread pools are fixed when TensorFlow starts: a fresh process per case.
    out = subprocess.run(
        [sys.executable, "-c", _THREADS_PROBE, json.dumps(config)],
        capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"},
    )  # fmt: skip
    assert tuple(int(n) for n in out.stdout.split()) == expected


def test_thread_keys_set_after_tensorflow_started_are_reported(caplog):
    with caplog.at_level("WARNING", logger="epl_trainer.runtime.cluster"):
        epl.init({"cluster.intra_op_threads": 3})
    epl.init()
    assert "cluster.intra_op_threads=3 is not applied" in caplog.text


def test_visible_gpus_set_after_tensorflow_started_are_checked_not_ignored(monkeypatch):
    """cluster.run_visible_devices was read only before TensorFlow started: afterwards
    any value was accepted without a word (here "0" on a machine without GPUs, or "1"
    while both GPUs stayed in the job)."""
    import tensorflow as tf

    with pytest.raises(ClusterError, match=r"'0' does not name visible GPUs \(this machine"):
        epl.init({"cluster.run_visible_devices": "0"})
    gpus = [tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(2)]
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: gpus)
    monkeypatch.setattr(tf.config, "get_visible_devices", lambda kind=None: gpus)
    configure_tensorflow(1, visible_gpus="0,1")  # what runs already: nothing to change
    with pytest.raises(ClusterError, match=r"run_visible_devices='1' cannot be applied"):
        configure_tensorflow(1, visible_gpus="1")


# These two run in this order: the first leaves a process-wide config behind.
def test_init_sets_the_process_wide_config():
    assert epl.init({"cluster.virtual_devices": 2}).config.cluster.virtual_devices == 2


def test_each_test_starts_from_the_default_config():
    """conftest restores `epl.init`'s config after each test: the test above would
    otherwise be this one's base config (a DeepSpeed recipe translated on top of its 2
    devices took a batch twice as large, and ran one step where its test expected two)."""
    assert epl.Env.get().config.cluster.virtual_devices == 0


def test_the_trainers_config_keys_go_over_inits(tmp_path):
    """`config=` adds its keys to `epl.init`'s: it does not drop the devices and the
    checkpoint directory init set (the trainer once trained on one device here)."""
    from _models import LOSS, mlp

    epl.init({"cluster.virtual_devices": 4, "checkpoint.dir": str(tmp_path)})
    trainer = epl.EPLTrainer(mlp(), LOSS, "sgd", config={"pipeline.num_micro_batch": 2})
    assert trainer.config.cluster.virtual_devices == 4
    assert trainer.config.checkpoint.dir == str(tmp_path)
    assert trainer.config.pipeline.num_micro_batch == 2
    assert trainer.cluster.total_gpu_num == 4
    again = epl.EPLTrainer(mlp(), LOSS, "sgd", config={"cluster.virtual_devices": 2})
    assert again.config.cluster.virtual_devices == 2  # the trainer's key wins
    assert again.config.checkpoint.dir == str(tmp_path)


def test_a_worker_whose_peer_never_starts_stops_naming_it():
    """Worker 0 of 2 started alone: TensorFlow would wait an hour for worker 1 (holding
    the GIL, swallowing SIGTERM); after cluster.startup_timeout_seconds its watcher stops
    it, naming worker 1."""
    from _launch import clean_env

    from epl_trainer.runtime import launcher

    ports = launcher.free_ports(2)
    tf_config = {
        "cluster": {"worker": [f"127.0.0.1:{port}" for port in ports]},
        "task": {"type": "worker", "index": 0},
    }
    env = clean_env(
        TF_CONFIG=json.dumps(tf_config),
        EPL_CLUSTER_STARTUP_TIMEOUT_SECONDS="4",
        CUDA_VISIBLE_DEVICES="",
    )
    script = "import epl_trainer as epl; epl.init(); print('started')"
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == -9, result.stderr[-2000:]  # killed by its watcher
    assert "started" not in result.stdout
    assert (
        "worker 0 waited cluster.startup_timeout_seconds=4 for the job's workers to start; "
        f"worker 1 (127.0.0.1:{ports[1]}) never listened"
    ) in result.stderr


def _two_worker_cluster():
    from epl_trainer.runtime.cluster import Cluster

    tasks = [f"/job:worker/replica:0/task:{w}" for w in range(2)]
    return Cluster(
        worker_num=2,
        worker_index=0,
        local_devices=(f"{tasks[0]}/device:CPU:0",),
        devices_by_worker=tuple((f"{task}/device:CPU:0",) for task in tasks),
        host_device=f"{tasks[0]}/device:CPU:0",
        device_type="CPU",
        addresses=("10.0.0.1:2222", "10.0.0.2:2222"),
    )


def test_a_peer_the_watchdog_found_unreachable_is_named_without_probing_it_again(monkeypatch):
    """The watchdog probes the peer of a stalled step (5 s for a peer that does not answer)
    and aborts the collectives; the error that abort raises names the peer from that probe.
    Probing again cost every lost peer another 5 s before the job stopped (two-host tests:
    ~15 s from a cut cable to the survivor's exit, where the poll and one probe take ~7)."""
    import threading

    import tensorflow as tf
    from tensorflow.python.eager import context

    from epl_trainer.runtime import watchdog as watchdog_lib
    from epl_trainer.runtime.cluster import Cluster, WorkerLostError

    cluster = _two_worker_cluster()
    probes = []

    def probe(self, probe_seconds=5.0):
        probes.append(probe_seconds)
        return {1: "DeadlineExceededError: the peer did not answer"}

    aborted = threading.Event()

    class Context:  # the collective executor's abort, without aborting this process's
        def abort_collective_ops(self, code, message):
            aborted.set()

    monkeypatch.setattr(Cluster, "unreachable_workers", probe)
    monkeypatch.setattr(context, "context", Context)
    watchdog = watchdog_lib.CollectiveWatchdog(cluster, timeout_seconds=60, poll_seconds=0.05)
    key = tuple(cluster.task_name(w) for w in range(2))
    monkeypatch.setitem(watchdog_lib._watchdogs, key, watchdog)
    try:
        with pytest.raises(WorkerLostError) as raised, watchdog_lib.bounded(cluster, 60):
            assert aborted.wait(10), "the watchdog never aborted the stalled step"
            raise tf.errors.UnavailableError(None, None, watchdog.aborted)
    finally:
        watchdog.stop()
    assert "peer worker(s) are unreachable: worker 1 (10.0.0.2:2222" in str(raised.value)
    assert raised.value.workers == (1,)
    assert len(probes) == 1, f"{len(probes)} probes of the lost peer"


@pytest.mark.parametrize("local_collectives", [True, False])
def test_one_worker_whose_step_spans_its_devices_is_watched_for_progress(
    monkeypatch, local_collectives
):
    """A single worker's devices wait on each other in their collectives: a step that
    stops making progress there is aborted after timeout_seconds with an error saying so
    (a deadlock among lanes hung a KerasHub Llama's first step for good before). A job
    on one device (no collectives) runs no watchdog thread."""
    import threading
    import time

    import tensorflow as tf
    from tensorflow.python.eager import context

    from epl_trainer.runtime import watchdog as watchdog_lib
    from epl_trainer.runtime.cluster import Cluster

    device = "/job:localhost/replica:0/task:0/device:CPU:0"
    cluster = Cluster(
        worker_num=1,
        worker_index=0,
        local_devices=(device, device[:-1] + "1"),
        devices_by_worker=((device, device[:-1] + "1"),),
        host_device=device,
        device_type="CPU",
    )
    aborted, codes = threading.Event(), []

    class Context:  # the collective executor's abort, without aborting this process's
        def abort_collective_ops(self, code, message):
            codes.append((code, message))
            aborted.set()

    monkeypatch.setattr(context, "context", Context)
    watchdog = watchdog_lib.CollectiveWatchdog(cluster, timeout_seconds=0.3, poll_seconds=0.05)
    monkeypatch.setitem(watchdog_lib._watchdogs, (cluster.task_name(0),), watchdog)
    try:
        with watchdog_lib.bounded(cluster, 0.3, local_collectives=local_collectives):
            if local_collectives:
                assert aborted.wait(10), "the watchdog never aborted the stalled step"
            else:
                time.sleep(0.6)
    finally:
        watchdog.stop()
    if not local_collectives:
        assert not codes and watchdog._thread is None
        return
    code, message = codes[0]
    assert code == tf.errors.DEADLINE_EXCEEDED
    assert "made no progress" in message and "communication.timeout_seconds=0.3" in message
    assert "a collective among this process's devices did not complete" in message


def test_a_failure_during_the_watchdogs_probe_names_the_peers_that_probe_finds(monkeypatch):
    """TF's coordination service may fail the step first ("tasks are unhealthy") while the
    watchdog's probe of the silent peer is still waiting for an answer: the error waits for
    that probe instead of starting another (two-host link cut: 14.6-14.7 s from the fault
    to the survivor's exit with a second probe, where one takes ~9.6)."""
    import threading

    import tensorflow as tf

    from epl_trainer.runtime import watchdog as watchdog_lib
    from epl_trainer.runtime.cluster import Cluster, WorkerLostError

    cluster = _two_worker_cluster()
    probes, probing, answer = [], threading.Event(), threading.Event()

    def probe(self, probe_seconds=5.0):
        probes.append(probe_seconds)
        probing.set()
        answer.wait(10)  # the silent peer: the probe waits out its timeout
        return {1: "DeadlineExceededError: the peer did not answer"}

    monkeypatch.setattr(Cluster, "unreachable_workers", probe)
    watchdog = watchdog_lib.CollectiveWatchdog(cluster, timeout_seconds=60, poll_seconds=0.05)
    key = tuple(cluster.task_name(w) for w in range(2))
    monkeypatch.setitem(watchdog_lib._watchdogs, key, watchdog)
    threading.Timer(0.5, answer.set).start()
    try:
        with pytest.raises(WorkerLostError) as raised, watchdog_lib.bounded(cluster, 60):
            assert probing.wait(10), "the watchdog never probed the stalled step's peer"
            raise tf.errors.UnavailableError(None, None, "tasks are unhealthy")
    finally:
        answer.set()
        watchdog.stop()
    assert "peer worker(s) are unreachable: worker 1 (10.0.0.2:2222" in str(raised.value)
    assert len(probes) == 1, f"{len(probes)} probes of the lost peer"
    assert watchdog.aborted is None  # the phase had failed already: nothing left to abort
