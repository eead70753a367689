"""Slurm: a job step started by `srun` (one task per worker) needs no TF_CONFIG.

Slurm tells each task its rank (`SLURM_PROCID`), the step's task count and nodes
(`SLURM_STEP_NUM_TASKS`, `SLURM_STEP_NODELIST`, `SLURM_STEP_TASKS_PER_NODE`).
TensorFlow's `SlurmClusterResolver` turns them into a cluster: the tasks of each node in
order, on ports `EPL_SLURM_PORT_BASE` (default 8888), +1, ... of that node.
`epl.init()` (`cluster.build_cluster`) sets TF_CONFIG from it when the step has several
tasks and no TF_CONFIG is set, so the rest of the library sees a cluster as from any
other scheduler:

    srun --nodes 2 --ntasks-per-node 4 python train.py     # 8 workers

The resolver counts each node's GPUs with `nvidia-smi` and gives every task its share
(`CUDA_VISIBLE_DEVICES`); on nodes without GPUs (or without `nvidia-smi`) the tasks
are placed without GPUs, and each worker's devices come from `cluster.virtual_devices`
as in any CPU job.
"""

from __future__ import annotations

import json
import logging
import os

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
