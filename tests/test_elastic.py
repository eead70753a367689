"""Elastic training: a job that loses a worker goes on with the survivors, and grows back.

The end-to-end tests run `tests/scripts/train_elastic.py` under `epl-launch
--num_workers 3 --min_workers 2`: worker 2 kills itself (SIGKILL) after step 5 of 12
(checkpoints every 2 steps), the launcher restarts the job on 2 workers from step 4
without anyone acting, then the test announces a worker (`epl-launch --join`) and the
job grows back to 3 at its next checkpoint. Its final weights must equal one process
training on the same global batches (SGD), and every sample must be trained on once.
The fast tests cover the pieces: row dealing, the micro-batch rule, the launcher's sizing.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf
from _launch import SCRIPTS, clean_env

from epl_trainer.config.sections import Config
from epl_trainer.runtime import elastic, launcher
from epl_trainer.runtime.launch_elastic import ElasticSize, request_join
from epl_trainer.runtime.launch_job import Job, _Worker
from epl_trainer.training import data as data_lib

SCRIPT = os.path.join(SCRIPTS, "train_elastic.py")
sys.path.insert(0, SCRIPTS)
import train_elastic  # noqa: E402

STEPS, BATCH = train_elastic.NUM_STEPS, train_elastic.GLOBAL_BATCH


# --- The pieces -------------------------------------------------------------------


@pytest.mark.parametrize("rows", [12, 7, 2])
@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_rows_of_shard_deal_every_row_of_a_global_batch_once(rows, shards):
    batch = tf.data.Dataset.from_tensors(({"id": tf.range(rows)}, tf.range(rows) * 10))
    dealt = []
    for shard in range(shards):
        (features, labels), *_ = list(data_lib.rows_of_shard(batch, shard, shards))
        np.testing.assert_array_equal(labels.numpy(), features["id"].numpy() * 10)
        dealt.append(features["id"].numpy().tolist())
    assert [i for share in dealt for i in share] == list(range(rows))  # in order, once
    assert max(map(len, dealt)) - min(map(len, dealt)) <= 1


def test_numpy_inputs_with_global_batches_deal_rows_of_each_batch():
    x = np.arange(10, dtype="float32")[:, None]
    shares = [
        [b[0][:, 0].numpy().tolist() for b in data_lib.as_dataset(x, x, 5, deal_rows=True, **w)]
        for w in (dict(worker_index=0, worker_num=2), dict(worker_index=1, worker_num=2))
    ]
    assert shares == [[[0, 1, 2], [5, 6, 7]], [[3, 4], [8, 9]]]


def test_fewer_workers_than_the_job_is_sized_for_raise_the_micro_batches(caplog):
    config = Config.load(
        {"elastic.max_workers": 3, "io.global_batches": True, "pipeline.num_micro_batch": 2}
    )
    assert elastic.sized_config(config, 3).pipeline.num_micro_batch == 2
    assert elastic.sized_config(config, 2).pipeline.num_micro_batch == 4
    assert elastic.sized_config(config, 1).pipeline.num_micro_batch == 6
    per_worker = config.replace({"io.global_batches": False})
    assert elastic.sized_config(per_worker, 2).pipeline.num_micro_batch == 2
    assert "without io.global_batches" in caplog.text


def test_a_resize_file_stops_every_worker_when_any_sees_it(tmp_path):
    config = Config.load({"elastic.resize_file": str(tmp_path / "resize")})
    seen = []

    def agree(values, what):  # worker 1 of 2 sees the file, this worker does not
        seen.append(values)
        return [values, [1]]

    elastic.stop_if_resize_requested(config, 1, agree, step=4)  # one worker: no file, goes on
    with pytest.raises(elastic.ResizeExit) as stopped:
        elastic.stop_if_resize_requested(config, 2, agree, step=6)
    assert (stopped.value.code, stopped.value.step, seen) == (75, 6, [[0]])


def _ended_job(tmp_path, returncode, attempt=0, resizing=False):
    job = Job(["true"], [{}], tmp_path, attempt=attempt)
    job.failure, job.resizing = (2, returncode), resizing
    return job


def test_a_killed_worker_is_the_failure_even_when_a_peer_failed_first(tmp_path):
    """Its peers exit with an error once they notice the lost peer; if the launcher polls
    after that, the kill must still be what it sees (else it would not shrink)."""

    class Ended:
        def __init__(self, returncode):
            self.returncode = returncode

        def poll(self):
            return self.returncode

    job = Job(["true"], [{}] * 3, tmp_path)
    job.workers = [_Worker(i, Ended(code), tmp_path) for i, code in enumerate([1, None, -9])]
    assert job._first_failure().index == 2
    job.workers[2].process.returncode = None
    assert job._first_failure().index == 0


def test_the_launcher_shrinks_on_a_lost_worker_down_to_min_workers_only(tmp_path, capfd):
    sizing = ElasticSize(3, 2, tmp_path)
    assert sizing.worker_env(1) == {
        "EPL_ELASTIC_MAX_WORKERS": "3",
        "EPL_ELASTIC_RESIZE_FILE": str(tmp_path / "resize_1"),
    }
    assert sizing.next_size(_ended_job(tmp_path, 1), 1) is None  # an error, not a loss
    assert sizing.next_size(_ended_job(tmp_path, -9), 137) == 2  # killed: lost
    assert sizing.next_size(_ended_job(tmp_path, -9), 137) is None  # 1 < min_workers
    assert "fewer than --min_workers 2" in capfd.readouterr().err
    assert ElasticSize(3, 3, tmp_path / "x").worker_env(0) == {}  # not elastic


def test_a_join_asks_the_job_to_stop_at_a_checkpoint_and_grows_it(tmp_path, capfd):
    sizing = ElasticSize(3, 1, tmp_path)
    job = _ended_job(tmp_path, -9)
    assert sizing.next_size(job, 137) == 2
    running = _ended_job(tmp_path, 0, attempt=1)
    request_join(tmp_path)
    request_join(tmp_path)  # one more than the job can take
    sizing.poll(running)
    assert running.resizing and (tmp_path / "resize_1").exists()
    assert not list((tmp_path / "join").iterdir())
    assert "already has 3 (ignored)" in capfd.readouterr().err
    assert sizing.next_size(_ended_job(tmp_path, 75, attempt=1, resizing=True), 75) == 3


def test_join_and_min_workers_errors_name_the_value(tmp_path, capfd):
    assert launcher.main(["--join", str(tmp_path)]) == launcher.EXIT_USAGE
    assert "not the run folder of an elastic epl-launch" in capfd.readouterr().err
    script = tmp_path / "s.py"
    script.write_text("")
    argv = ["--num_workers", "2", "--gpu_per_worker", "1", "--min_workers", "3", str(script)]
    assert launcher.main(argv) == launcher.EXIT_USAGE
    assert "min_workers=3, num_workers=2" in capfd.readouterr().err


# --- End to end ---------------------------------------------------------------------


def _run_alone(out, *args):
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, SCRIPT, str(out), *args]
    env = clean_env(CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return _weights(out)


def _weights(out):
    loaded = np.load(out / "weights.npz")
    return [loaded[f"arr_{i}"] for i in range(len(loaded.files))]


def _report(out, attempt):
    path = out / f"attempt{attempt}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _wait_for_first_step(out, attempt, job, timeout=240.0):
    deadline = time.monotonic() + timeout
    while "first_step" not in _report(out, attempt):
        if job.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"attempt {attempt} never trained: {job.communicate()}")
        time.sleep(0.1)


def _steps_trained(out, reports) -> dict[int, list[int]]:
    """The sample ids each step trained on, from the attempt that owns the step (a step
    an attempt ran after its last checkpoint is redone by the next attempt)."""
    by_step = {}
    for attempt, report in enumerate(reports):
        first = report["step"]
        last = reports[attempt + 1]["step"] if attempt + 1 < len(reports) else STEPS
        lines_per_step = report["micro_batches"]  # the recording layer runs per micro-batch
        for path in out.glob(f"ids_*_attempt{attempt}.txt"):
            lines = path.read_text().splitlines()[: (last - first) * lines_per_step]
            for k, line in enumerate(lines):
                ids = [int(i) for i in line.strip("[]").split()]
                by_step.setdefault(first + k // lines_per_step, []).extend(ids)
    return by_step


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "mode",
    [
        # Plain data parallelism has no variant of its own (~48 s): its restart, join and
        # whole-copy restore are the zero_v2 variant's, which also re-cuts the pieces.
        # Every parameter held only as pieces spread over the workers, all-gathered to be
        # read (zero_gather.py): 3, then 2, then 3 owners of each piece.
        pytest.param(
            ["--zero", "v2", "--momentum", "0.9"],
            id="data_parallel_zero_v2",
            marks=pytest.mark.combines("checkpoint+zero_v2+multi_worker"),
        ),
        # One automatic stage per worker: the lost worker's stage is re-planned onto the
        # survivors (3 stages, then 2, then 3), with ZeRO v1 over momentum slots.
        # (ZeRO v1 over one replica's stages: a group of one lane each, not claimed.)
        pytest.param(
            ["--pipeline", "--zero", "v1", "--momentum", "0.9"],
            id="pipeline_zero_v1",
            marks=pytest.mark.combines("checkpoint+pipeline+stages_across_workers"),
        ),
    ],
)
def test_a_lost_worker_shrinks_the_job_and_a_join_grows_it_with_identical_weights(tmp_path, mode):
    expected = _run_alone(tmp_path / "alone", *mode)
    out = tmp_path / "elastic"
    out.mkdir()
    command = [
        sys.executable, "-m", "epl_trainer.runtime.launcher", "--num_workers", "3",
        "--gpu_per_worker", "1", "--min_workers", "2", "--log_dir", str(tmp_path / "logs"),
        SCRIPT, str(out), "--kill_worker", "2", "--kill_at_step", "5", "--step_seconds", "0.4",
        *mode,
    ]  # fmt: skip
    job = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env()
    )
    try:
        _wait_for_first_step(out, 1, job)  # the survivors train again...
        (run_dir,) = (tmp_path / "logs").iterdir()
        request_join(run_dir)  # ...and the lost worker comes back
        _, err = job.communicate(timeout=300)
    finally:
        job.kill()
    assert job.returncode == 0, err
    assert "worker 2 is lost; restarting on 2 worker(s)" in err
    assert "the job stops at its next checkpoint and restarts on 3 worker(s)" in err
    reports = [_report(out, attempt) for attempt in range(4)]
    assert not reports[3]
    shrunk, grown = reports[1], reports[2]
    assert (shrunk["workers"], shrunk["step"], shrunk["micro_batches"]) == (2, 4, 2)
    assert (grown["workers"], grown["micro_batches"]) == (3, 1)
    assert grown["step"] in (6, 8, 10)  # a checkpoint after the join

    killed = json.loads((out / "killed.json").read_text())["time"]
    restore = shrunk["began"] - shrunk["started"]  # process start, restore, ready to train
    print(
        f"kill -> survivors restarted {shrunk['started'] - killed:.1f} s, trained again "
        f"{shrunk['first_step'] - killed:.1f} s (of which start + restore {restore:.1f} s); "
        f"grown at step {grown['step']}, start + restore {grown['began'] - grown['started']:.1f} s"
    )
    assert shrunk["started"] - killed < 10.0

    by_step = _steps_trained(out, reports[:3])
    assert sorted(by_step) == list(range(STEPS))
    for step, ids in by_step.items():
        assert sorted(ids) == list(range(step * BATCH, (step + 1) * BATCH)), step
    for got, want in zip(_weights(out), expected, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
