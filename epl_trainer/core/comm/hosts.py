"""The workers' host CPUs as one collective group, for job-wide agreements.

Agreements between worker processes (the end of the data, epoch metrics, checkpoint
barriers, the start state, the write-back of stages held elsewhere) are small and run on
each worker's host CPU, whatever its compute devices are. They all use this one group:
its key follows its members, so every such agreement shares the group's instance-key
counter, and every worker must build them in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from epl_trainer.core.comm.group import CollectiveGroup
from epl_trainer.core.comm.keys import ordering_token


def host_of(device: str) -> str:
    """The host CPU of the worker that holds `device`."""
    return device.rsplit("/device:", 1)[0] + "/device:CPU:0"


def host_group(devices_by_worker: Sequence[Sequence[str]], host_device: str) -> CollectiveGroup:
    """One member per worker (its host CPU, in worker order); this worker's is local.

    Also creates the host's ordering token now: a variable created while a function is
    traced makes it trace twice, and the second trace would take another instance key on
    this worker only, so the workers' keys would no longer meet.

    Args:
      devices_by_worker: `devices_by_worker[w]` lists worker w's compute devices.
      host_device: this worker's host CPU.
    """
    hosts = tuple(host_of(devices[0]) for devices in devices_by_worker)
    if host_device not in hosts:
        raise ValueError(
            f"host_device must be one of the workers' hosts. Received: "
            f"host_device={host_device!r}, hosts={hosts}"
        )
    ordering_token(host_device)
    return CollectiveGroup(hosts, (host_device,))


def rows_by_worker(group: CollectiveGroup, gathered) -> np.ndarray:
    """An `all_gather` result of `host_group`, one row per worker in worker order.

    The gather lays the members' inputs out by collective rank, which need not be the
    worker order.
    """
    rows = np.asarray(gathered).reshape(group.size, -1)
    return rows[[group.rank_of(device) for device in group.devices]]
