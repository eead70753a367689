"""Workers on hosts with their own network addresses (Linux network namespaces on a
bridge, tests/_hosts.py): training across them, link faults, a slow link, a restart.

Every worker runs in its own namespace and reaches its peer only by the address its
TF_CONFIG names, as on separate machines; faults are real: a cable unplugged (the
host's veth link set down), a host that stops answering (its process frozen with
SIGSTOP), a link slowed by a delaying relay (this kernel has no netem).
"""

import json
import os
import signal
import time

import numpy as np
import pytest
from _hosts import NetworkHosts, port, start_relay, start_workers, unavailable_reason
from _launch import SCRIPTS
from test_elastic import BATCH, STEPS, _report, _run_alone, _steps_trained, _weights
from test_fault_tolerance import check_resumed_at_step_4, uninterrupted  # noqa: F401 (fixture)
from test_multiworker import check_short_last_batches
from test_soak import RSS_SLACK_MIB, RSS_WARMUP_MIB, THREAD_SLACK
from test_span_workers import TIMEOUT_AFTER_PAUSE, _check_workers, _keras_reference

UNAVAILABLE = unavailable_reason()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(400),
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no test hosts: {UNAVAILABLE}"),
]

TIMEOUT = 20  # communication.timeout_seconds of the fault tests
SPAN = os.path.join(SCRIPTS, "train_span.py")
DP = os.path.join(SCRIPTS, "train_dp.py")
FT = os.path.join(SCRIPTS, "train_ft.py")
SOAK = os.path.join(SCRIPTS, "soak_workers.py")
ELASTIC = os.path.join(SCRIPTS, "train_elastic.py")


@pytest.fixture
def hosts():
    with NetworkHosts(3) as made:  # two workers and, for the slow link, a relay
        yield made


def _finish(processes, timeout=240) -> list[str]:
    """Each process's output once it exits (all are killed if one overruns)."""
    try:
        return [p.communicate(timeout=timeout)[0] for p in processes]
    finally:
        _stop(processes)


def _stop(processes) -> None:
    """Kills what still runs (frozen ones too) and waits for it: a namespace goes away
    only with its last process."""
    for p in processes:
        if p.poll() is None:
            p.kill()
        p.communicate()


def _wait_for(path, process, seconds=120):
    deadline = time.monotonic() + seconds
    while not (path.exists() and path.read_text()):
        assert process.poll() is None, f"exited with {process.returncode} before {path}"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)
    return path.read_text()


def test_data_parallel_on_two_hosts_with_a_shorter_last_batch_equals_keras(tmp_path, hosts):
    """2 hosts x 2 devices, data parallel; host 1's last batch is a row short."""
    workers = start_workers(hosts, DP, tmp_path / "out", "--short_last", devices_per_worker=2)
    outputs = _finish(workers)
    assert [w.returncode for w in workers] == [0, 0], "\n".join(outputs)
    check_short_last_batches(tmp_path / "out", "".join(outputs))


def test_pipeline_stages_on_two_hosts_over_a_slowed_link_equal_keras(tmp_path, hosts):
    """Stage 0 on host 0, stage 1 on host 1 (SGD, GPipe-style 2 micro-batches); TF_CONFIG
    names a relay on host 2 for both workers, so every connection between them crosses
    it with 20 ms added each way. The run completes and equals single-device Keras."""
    relay = start_relay(hosts, 2, delay_ms=20, workers=2)
    try:
        via_relay = [hosts.addresses[2]] * 2
        workers = start_workers(hosts, SPAN, tmp_path / "out", cluster=via_relay)
        started = time.monotonic()
        outputs = _finish(workers)
        print(f"pipeline over the slowed link: {time.monotonic() - started:.1f} s")
    finally:
        relay.kill()
    relayed = relay.communicate()[0]
    assert [w.returncode for w in workers] == [0, 0], "\n".join(outputs)
    for w in range(2):  # both workers' traffic went through the slow link
        assert f"connection to {hosts.addresses[w]}:{port(w)}" in relayed, relayed
    _check_workers(tmp_path / "out", 2, _keras_reference())


@pytest.mark.parametrize("fault", ["link_cut", "frozen"])
def test_an_unreachable_host_is_named_within_the_watchdog_bound(tmp_path, hosts, fault):
    """Worker 1 (stage 1) pauses after step 2 while worker 0 waits in step 3's
    collectives; then its cable is unplugged, or its process frozen (SIGSTOP). Worker 0
    stops with a WorkerLostError naming worker 1 by address as unreachable (a merely
    paused peer still answers and would be reported as stuck, after the timeout). From
    the pause on both run with TIMEOUT_AFTER_PAUSE (the first step's tracing keeps
    TIMEOUT)."""
    args = ["--steps", 50, "--timeout", TIMEOUT, "--pause_worker", 1, "--pause_at_step", 2]
    args += ["--timeout_after_pause", TIMEOUT_AFTER_PAUSE]  # the watchdog polls every 2 s
    workers = start_workers(hosts, SPAN, tmp_path / "out", *args)
    survivor, victim = workers
    try:
        pid = int(_wait_for(tmp_path / "out" / "paused_1", victim))
        if fault == "link_cut":
            hosts.cut(1)
        else:
            os.kill(pid, signal.SIGSTOP)
        faulted = time.monotonic()
        output = survivor.communicate(timeout=TIMEOUT + 60)[0]
        elapsed = time.monotonic() - faulted
    finally:
        _stop(workers)
    print(f"{fault}: worker 0 stopped {elapsed:.1f} s after the fault")
    assert survivor.returncode == 1, output
    assert "WorkerLostError" in output, output
    named = f"worker 1 ({hosts.addresses[1]}:{port(1)}, /job:worker/replica:0/task:1)"
    assert f"peer worker(s) are unreachable: {named}" in output, output
    assert elapsed < TIMEOUT + 30, elapsed


@pytest.mark.combines("checkpoint+multi_worker")
def test_a_job_on_two_hosts_killed_and_restarted_resumes_exactly(tmp_path, hosts, uninterrupted):  # noqa: F811
    """Both workers SIGKILL themselves after step 5 (checkpoints every 2 steps, in a folder
    both hosts see); started again, they resume step 4 on their own halves of the global
    batch and end with the uninterrupted run's weights."""
    common = [tmp_path, "--timeout", TIMEOUT, "--kill_at_step", 5]
    killed = start_workers(hosts, FT, *common, EPL_RESTART_ATTEMPT="0")
    outputs = _finish(killed)
    assert [w.returncode for w in killed] == [-signal.SIGKILL] * 2, "\n".join(outputs)
    resumed = start_workers(hosts, FT, *common, EPL_RESTART_ATTEMPT="1")
    outputs = _finish(resumed)
    assert [w.returncode for w in resumed] == [0, 0], "\n".join(outputs)
    check_resumed_at_step_4(tmp_path, uninterrupted, attempt=1)


@pytest.mark.combines("checkpoint+multi_worker")
def test_a_scheduler_restarts_an_elastic_job_on_the_surviving_host(tmp_path, hosts):
    """Elastic training without epl-launch, as a scheduler that restarts pods with a new
    TF_CONFIG runs it: 2 workers on 2 hosts with EPL_ELASTIC_MAX_WORKERS=2 and global
    batches; worker 1 SIGKILLs itself after step 5, worker 0 stops with the error naming
    it; started again alone on host 0 (TF_CONFIG of one worker), it resumes step 4 with 2
    micro-batches and ends with the weights of one process on the same global batches."""
    expected = _run_alone(tmp_path / "alone")
    out = tmp_path / "elastic"
    out.mkdir()
    sized = dict(EPL_ELASTIC_MAX_WORKERS="2")
    kill = ["--kill_worker", 1, "--kill_at_step", 5]
    lost = start_workers(hosts, ELASTIC, out, *kill, EPL_RESTART_ATTEMPT="0", **sized)
    outputs = _finish(lost)
    assert lost[1].returncode == -signal.SIGKILL, outputs[1]
    named = f"worker 1 ({hosts.addresses[1]}:{port(1)}"
    assert lost[0].returncode != 0 and named in outputs[0], outputs[0]
    survivor = start_workers(
        hosts, ELASTIC, out, cluster=hosts.addresses[:1], EPL_RESTART_ATTEMPT="1", **sized
    )
    outputs = _finish(survivor)
    assert survivor[0].returncode == 0, outputs[0]
    reports = [_report(out, attempt) for attempt in range(2)]
    assert [(r["workers"], r["step"], r["micro_batches"]) for r in reports] == [
        (2, 0, 1),
        (1, 4, 2),
    ]
    by_step = _steps_trained(out, reports)
    assert {s: sorted(ids) for s, ids in by_step.items()} == {
        s: list(range(s * BATCH, (s + 1) * BATCH)) for s in range(STEPS)
    }
    for got, want in zip(_weights(out), expected, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_a_pipeline_over_two_hosts_soaks_with_threads_and_memory_flat(tmp_path):
    """Stage 0 on host 0, stage 1 on host 1, 3,000 steps (after 200 of warm-up); every
    1,400th batch is slower than two of the watchdog's polls, so it probes its peer over
    the network then, as in a job whose input stalls. Threads and resident memory stay
    flat on both hosts (test_soak.py's bounds)."""
    with NetworkHosts(2) as hosts:
        args = ["--steps", 3000, "--slow_every", 1400, "--pipeline"]
        workers = start_workers(hosts, SOAK, tmp_path / "out", *args)
        outputs = _finish(workers, timeout=600)
    assert [w.returncode for w in workers] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    for worker in (0, 1):
        result = json.loads((tmp_path / "out" / f"soak_{worker}.json").read_text())
        print(worker, result)
        assert result["watchdog_running"] and result["probes"] >= 2, result
        threads, rss = result["baseline"]
        first = result["samples"][0][2]
        assert len(result["samples"]) == 6 and first - rss < RSS_WARMUP_MIB, result
        for step, count, resident in result["samples"]:
            assert count <= threads + THREAD_SLACK, f"worker {worker}: {count} threads at {step}"
            assert resident - first < RSS_SLACK_MIB, f"worker {worker}: RSS grew at {step}"
        assert result["loss"] < 1.0
