"""A pytest plugin that records where each test's wall time went, to explain tests that
take 30-60 s in a `-n 2` run and about 1 s alone.

Per test (setup, call and teardown), one JSON line in `$STALL_PROBE_OUT.<pid>`: wall time,
this process's CPU time, its children's, page faults, voluntary and involuntary context
switches, block I/O, the machine's busy/iowait/steal CPU seconds (/proc/stat) and pressure
stall seconds (/proc/pressure), and the thread count before and after. A test still
running after `$STALL_PROBE_DUMP_S` seconds (default 20) has every thread's Python stack
written to `$STALL_PROBE_OUT.<pid>.stacks` (faulthandler), once per test. That dump reads
the other threads' frames without the GIL and can kill the process: once in four `.ci/run`
runs (2026-11-30) an xdist worker died in the middle of writing the main thread's stack
("node down: Not properly terminated", the file cut after its first frame). A failure of
that kind under the probe is the probe's; set `STALL_PROBE_DUMP_S` high to keep only the
per-test records.

    PYTHONPATH=tools STALL_PROBE_OUT=/tmp/probe python -m pytest -n 2 -p stall_probe
    PYTHONPATH=$PWD/tools STALL_PROBE_OUT=/tmp/probe PYTEST_ADDOPTS="-p stall_probe" .ci/run

What it found so far (2026-11-29, `.ci/run` on 2 cores): a stalled test uses 5-11x its
solo CPU time, yet is blocked most of its wall time (about 150 voluntary context switches
in 53 s, no major faults, no iowait, no steal, a core idle), and threads end during it
(61 -> 57, 65 -> 57): work an earlier test left in the process is torn down inside it.
"""

from __future__ import annotations

import faulthandler
import json
import os
import resource
import time

import pytest

_OUT = os.environ.get("STALL_PROBE_OUT", "/tmp/stall_probe")
_DUMP_AFTER_S = float(os.environ.get("STALL_PROBE_DUMP_S", "20"))
_RUSAGE = ("ru_majflt", "ru_minflt", "ru_nvcsw", "ru_nivcsw", "ru_inblock", "ru_oublock")


def _machine() -> dict:
    with open("/proc/stat") as f:
        ticks = list(map(int, f.readline().split()[1:]))
    # user nice system idle iowait irq softirq steal ...
    state = {"busy": sum(ticks) - ticks[3] - ticks[4], "iowait": ticks[4], "steal": ticks[7]}
    for kind in ("cpu", "io", "memory"):
        try:
            with open(f"/proc/pressure/{kind}") as f:
                state[f"psi_{kind}"] = int(f.readline().split("total=")[1])  # microseconds
        except (OSError, IndexError):
            pass
    return state


def _process() -> dict:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    state = {name: getattr(own, name) for name in _RUSAGE}
    state["cpu"] = own.ru_utime + own.ru_stime
    state["child_cpu"] = children.ru_utime + children.ru_stime
    state["threads"] = len(os.listdir("/proc/self/task"))
    return state


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with open(f"{_OUT}.{os.getpid()}.stacks", "a") as stacks:
        stacks.write(f"\n== {item.nodeid}\n")
        stacks.flush()
        faulthandler.dump_traceback_later(_DUMP_AFTER_S, repeat=False, file=stacks)
        start, machine, process = time.time(), _machine(), _process()
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
    wall, machine_end, process_end = time.time() - start, _machine(), _process()
    tick = os.sysconf("SC_CLK_TCK")
    record = {"id": item.nodeid, "start": start, "wall": wall}
    for name in ("cpu", "child_cpu", *_RUSAGE):
        record[name] = process_end[name] - process[name]
    record["threads_before"], record["threads_after"] = process["threads"], process_end["threads"]
    for name in ("busy", "iowait", "steal"):
        record[f"machine_{name}_s"] = (machine_end[name] - machine[name]) / tick
    for name in ("psi_cpu", "psi_io", "psi_memory"):
        if name in machine:
            record[f"{name}_s"] = (machine_end[name] - machine[name]) / 1e6
    with open(f"{_OUT}.{os.getpid()}", "a") as f:
        f.write(json.dumps(record) + "\n")
