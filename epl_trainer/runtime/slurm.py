"""Slurm: a job step started by `srun` (one task per worker) needs no TF_CONFIG.

Slurm tells each task its rank (`SLURM_PROCID`), the step's task count and nodes
(`SLURM_STEP_NUM_TASKS`, `SLURM_STEP_NODELIST`, `SLURM_STEP_TASKS_PER_NODE`).
TensorFlow's `SlurmClusterResolver` turns them into a cluster: the tasks of each node in
order, on ports `EPL_SLURM_PORT_BASE` (default 8888), +1, ... of that node.
`epl.init()` (`cluster.build_cluster`) sets TF_CONFIG from it when the step has several
tasks and no TF_CONFIG is set, so the rest of the library sees a cluster as from any
other scheduler:

    srun --nodes 2 --ntasks-per-node 4 python train.py     # 8 workers

`epl-launch` reads the allocation too, when `srun` starts one launcher per node
(`NodeAllocation`): each starts its node's workers, and their TF_CONFIG names every
node's (the nodes from `scontrol show hostnames`, Slurm's own expansion of the node
list), so the launcher's supervision, logs and devices work across nodes:

    srun --nodes 2 --ntasks-per-node 1 epl-launch --num_workers 4 --gpu_per_worker 1 train.py

The resolver counts each node's GPUs with `nvidia-smi` and gives every task its share
(`CUDA_VISIBLE_DEVICES`); on nodes without GPUs (or without `nvidia-smi`) the tasks
are placed without GPUs, and each worker's devices come from `cluster.virtual_devices`
as in any CPU job.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess

logger = logging.getLogger(__name__)

PORT_BASE_ENV = "EPL_SLURM_PORT_BASE"
DEFAULT_PORT_BASE = 8888


def in_job_step() -> bool:
    """Whether this process is one of several tasks of a Slurm job step."""
    try:
        return "SLURM_PROCID" in os.environ and int(os.environ["SLURM_STEP_NUM_TASKS"]) > 1
    except (KeyError, ValueError):
        return False


def tf_config_of_step() -> str:
    """TF_CONFIG for this task of the Slurm job step (see the module docstring)."""
    import tensorflow as tf  # only here: the launcher-side helpers stay TensorFlow-free

    resolvers = tf.distribute.cluster_resolver
    raw_port = os.environ.get(PORT_BASE_ENV, str(DEFAULT_PORT_BASE))
    try:
        port_base = int(raw_port)
    except ValueError:
        raise ValueError(f"{PORT_BASE_ENV} must be a port number. Received: {raw_port!r}") from None
    try:
        resolver = resolvers.SlurmClusterResolver(port_base=port_base)
        spec = resolver.cluster_spec()
    except (OSError, RuntimeError, ValueError):
        # No GPUs (no nvidia-smi): TF's resolver would give a node without GPUs no task,
        # so each task is given one "GPU" slot that nothing uses.
        from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver

        per_node = slurm_cluster_resolver.expand_tasks_per_node(
            os.environ["SLURM_STEP_TASKS_PER_NODE"]
        )
        resolver = resolvers.SlurmClusterResolver(
            port_base=port_base, gpus_per_node=max(per_node), gpus_per_task=1, auto_set_gpu=False
        )
        spec = resolver.cluster_spec()
    task_type, task_index = resolver.get_task_info()
    workers = spec.job_tasks(task_type)
    logger.info("Slurm job step: worker %d of %d, cluster %s", task_index, len(workers), workers)
    return json.dumps(
        {"cluster": {task_type: workers}, "task": {"type": task_type, "index": task_index}}
    )


@dataclasses.dataclass(frozen=True)
class NodeAllocation:
    """The nodes of an `srun` step running one `epl-launch` per node.

    Attributes:
      hosts: the step's nodes, in Slurm's order.
      node_index: this node's position among them (`SLURM_NODEID`).
      port_base: worker i of every node listens on `port_base + i`.
    """

    hosts: tuple[str, ...]
    node_index: int
    port_base: int

    def place(self, env: dict, local_index: int, per_node: int) -> None:
        """Makes the env of this node's worker `local_index` (of `per_node`) one worker
        of the whole allocation: its TF_CONFIG, index and worker count."""
        workers = [f"{host}:{self.port_base + i}" for host in self.hosts for i in range(per_node)]
        index = self.node_index * per_node + local_index
        env["TF_CONFIG"] = json.dumps(
            {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        )
        env["EPL_WORKER_INDEX"] = str(index)
        env["EPL_NUM_WORKERS"] = str(len(workers))


def node_allocation(environ) -> NodeAllocation | None:
    """This node's place when `epl-launch` runs as a task of an `srun` step over several
    nodes; None outside one (a local launch, also in an `salloc` shell).

    Raises:
      ValueError: the step runs several launchers per node, the node list cannot be
        expanded, or the port base is not a number.
    """
    try:
        nodes = int(environ["SLURM_STEP_NUM_NODES"])
        tasks = int(environ["SLURM_STEP_NUM_TASKS"])
        node_index = int(environ["SLURM_NODEID"])
        nodelist = environ["SLURM_STEP_NODELIST"]
    except (KeyError, ValueError):
        return None
    if nodes < 2:
        return None
    if tasks != nodes:
        raise ValueError(
            "epl-launch starts a node's workers itself: run it once per node (srun "
            "--ntasks-per-node=1), or run the script under srun without epl-launch. "
            f"Received: SLURM_STEP_NUM_TASKS={tasks}, SLURM_STEP_NUM_NODES={nodes}"
        )
    hosts = tuple(expand_nodelist(nodelist))
    if len(hosts) != nodes or not 0 <= node_index < nodes:
        raise ValueError(
            f"The step's node list {nodelist!r} expands to {list(hosts)}, which does not "
            f"hold node {node_index} of SLURM_STEP_NUM_NODES={nodes}."
        )
    raw_port = environ.get(PORT_BASE_ENV, str(DEFAULT_PORT_BASE))
    if not raw_port.isdigit():
        raise ValueError(f"{PORT_BASE_ENV} must be a port number. Received: {raw_port!r}")
    return NodeAllocation(hosts, node_index, int(raw_port))


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's node list (`node[1-3],gpu07`) as host names, expanded by Slurm's own
    `scontrol show hostnames`."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        raise ValueError(
            f"Expanding the Slurm node list {nodelist!r} needs `scontrol` (Slurm's client "
            "tools) on PATH."
        )
    result = subprocess.run(
        [scontrol, "show", "hostnames", nodelist],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0:
        raise ValueError(f"scontrol show hostnames {nodelist!r} failed: {result.stderr.strip()}")
    return result.stdout.split()
