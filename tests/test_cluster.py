"""TF_CONFIG parsing, local devices and epl.init / Env."""

import json

import pytest

import epl_trainer as epl
from epl_trainer.cluster import ClusterError, build_cluster, configure_tensorflow, parse_tf_config


def _tf_config(cluster, task_type, index):
    return {
        "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})
    }


def test_without_tf_config_the_job_is_one_local_worker():
    spec = parse_tf_config({})
    assert spec.worker_num == 1 and spec.worker_index == 0


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
