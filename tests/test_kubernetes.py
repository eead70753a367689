"""The Kubernetes example (examples/kubernetes/tfjob.yaml) run as the operator runs it.

Kubeflow's training operator starts one pod per worker replica, each running the
container's command and args with the container's env plus a TF_CONFIG it writes:
`{"cluster": {"worker": ["<job>-worker-<i>.<namespace>.svc:<port>", ...]}, "task":
{"type": "worker", "index": i}, "environment": "cloud"}`. Here each pod is a local
process with exactly that; the only liberty is that the pods' service names, which no
DNS here resolves, are mapped to 127.0.0.1 and free ports.
"""

import json
import os
import subprocess
import sys

import pytest
import yaml
from _launch import ROOT, clean_env

from epl_trainer.runtime import launcher

MANIFEST = os.path.join(ROOT, "examples", "kubernetes", "tfjob.yaml")


def _operator_tf_config(name: str, replicas: int, port: int, index: int) -> dict:
    workers = [f"{name}-worker-{i}.default.svc:{port}" for i in range(replicas)]
    return {
        "cluster": {"worker": workers},
        "task": {"type": "worker", "index": index},
        "environment": "cloud",
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_tfjob_pods_commands_train_as_two_workers(tmp_path):
    with open(MANIFEST) as file:
        job = yaml.safe_load(file)
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "TFJob")
    name = job["metadata"]["name"]
    spec = job["spec"]["tfReplicaSpecs"]["Worker"]
    (container,) = spec["template"]["spec"]["containers"]
    (port,) = [p["containerPort"] for p in container["ports"]]
    replicas = spec["replicas"]
    assert replicas == 2
    local = dict(zip(
        [f"{name}-worker-{i}.default.svc:{port}" for i in range(replicas)],
        [f"127.0.0.1:{p}" for p in launcher.free_ports(replicas)],
    ))  # fmt: skip
    pods = []
    for index in range(replicas):
        tf_config = _operator_tf_config(name, replicas, port, index)
        tf_config["cluster"]["worker"] = [local[w] for w in tf_config["cluster"]["worker"]]
        env = clean_env(
            CUDA_VISIBLE_DEVICES="",
            TF_CONFIG=json.dumps(tf_config),
            **{e["name"]: e["value"] for e in container["env"]},
        )
        # The container's command and args; shorter training and a writable output here
        # (absl flags: the last value given wins).
        argv = [*container["command"], *container["args"]]
        argv += ["--epochs", "1", "--steps_per_epoch", "4", "--output_dir", str(tmp_path)]
        argv[0] = sys.executable if argv[0] == "python" else argv[0]
        pods.append(
            subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = [pod.communicate(timeout=240)[0] for pod in pods]
    assert [pod.returncode for pod in pods] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert (metrics["num_workers"], metrics["devices_per_worker"], metrics["epochs"]) == (2, 1, 1)
