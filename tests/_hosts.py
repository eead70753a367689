"""Hosts with their own network addresses, for multi-worker tests: Linux network
namespaces on one bridge, one veth pair each (`ip netns`, as root).

Each host is a namespace with the address 10.77.0.<i+1>; its link to the bridge (the
veth end left in the test's namespace) can be cut and restored like a cable. Workers
started in the namespaces reach each other only through the bridge, by the addresses
their TF_CONFIG names, as on separate machines. Names carry the test process's pid, so
tests running side by side (pytest-xdist) build separate networks; the subnet is the
same in every network, which is harmless since no namespace joins two of them.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys

from _launch import SCRIPTS, clean_env

SUBNET = "10.77.0"
_networks = itertools.count()
PORT = 2222  # worker w listens on PORT + w (each host has its own ports)
RELAY = os.path.join(SCRIPTS, "delay_relay.py")


def unavailable_reason() -> str | None:
    """Why this machine cannot make network namespaces (None: it can)."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"eplprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"the kernel refused a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")


class NetworkHosts:
    """`count` hosts on one bridge; a context manager that removes them on exit.

    Attributes:
      names: the namespaces, host i's at index i.
      addresses: host i's IPv4 address.
    """

    def __init__(self, count: int):
        # Unique per network: a deleted namespace is torn down by the kernel later, and
        # a new network must not wait for that to reuse its names (<= 15 characters).
        tag = f"e{os.getpid()}n{next(_networks)}"
        self.bridge = f"{tag}br"
        self.names = [f"{tag}h{i}" for i in range(count)]
        self.links = [f"{tag}v{i}" for i in range(count)]  # the bridge's end of each
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(count)]

    def __enter__(self) -> NetworkHosts:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for name, link, address in zip(self.names, self.links, self.addresses):
                _ip("netns", "add", name)
                _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", name)
                _ip("link", "set", link, "master", self.bridge, "up")
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for link, name in zip(self.links, self.names):
            subprocess.run(["ip", "link", "del", link], capture_output=True)  # and its peer
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def cut(self, host: int) -> None:
        """Unplugs host `host`'s cable: its packets no longer reach the bridge."""
        _ip("link", "set", self.links[host], "down")

    def command(self, host: int, argv: list) -> list:
        """`argv` run on host `host`."""
        return ["ip", "netns", "exec", self.names[host], *(str(a) for a in argv)]


def port(worker: int) -> int:
    """Worker `worker`'s port (on its own host; a relay listens on the same one)."""
    return PORT + worker


def tf_config(addresses: list[str], index: int) -> str:
    workers = [f"{address}:{port(w)}" for w, address in enumerate(addresses)]
    return json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})


def start_workers(
    hosts: NetworkHosts, script, *script_args, devices_per_worker=1, cluster=None, **env_extra
):
    """Worker i of one job on host i, each with its TF_CONFIG (no launcher), output piped
    as text.

    Args:
      cluster: the addresses TF_CONFIG names, worker by worker (default: the hosts' own);
        a test may name a relay's instead.
      env_extra: more environment variables for every worker.

    Returns the Popen of each worker in worker order.
    """
    from epl_trainer.runtime import launcher

    cluster = cluster or hosts.addresses[:2]
    workers = []
    for index in range(len(cluster)):
        ports = [port(w) for w in range(len(cluster))]
        env = launcher.worker_env(index, ports, devices_per_worker, base_env=clean_env(**env_extra))
        env["TF_CONFIG"] = tf_config(cluster, index)
        argv = [sys.executable, str(script), *script_args]
        workers.append(
            subprocess.Popen(
                hosts.command(index, argv),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return workers


def start_relay(hosts: NetworkHosts, host: int, delay_ms: float, workers: int):
    """A delaying relay on host `host` for workers 0..workers-1: connections to its address
    at worker w's port reach worker w (on host w). Returns (its Popen, once it listens)."""
    routes = [
        f"{hosts.addresses[host]}:{port(w)}={hosts.addresses[w]}:{port(w)}" for w in range(workers)
    ]
    relay = subprocess.Popen(
        hosts.command(host, [sys.executable, RELAY, "--delay_ms", delay_ms, *routes]),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if relay.stdout.readline().strip() != "ready":
        relay.kill()
        raise RuntimeError(f"the relay did not start: {relay.communicate()[0]}")
    return relay
