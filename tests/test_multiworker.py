"""Real worker processes on 127.0.0.1 under epl-launch."""

import functools
import os
import sys
import time

import keras
import numpy as np
import pytest
from _launch import SCRIPTS, run_launch

import epl_trainer as epl

SCRIPT = os.path.join(SCRIPTS, "train_dp.py")
sys.path.insert(0, SCRIPTS)
import train_dp  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _launch(tmp_path, num_workers, devices_per_worker, *script_args):
    return run_launch(SCRIPT, tmp_path, num_workers, devices_per_worker, *script_args, timeout=200)


@functools.cache  # the same weights for every test that asks for them (read only)
def _single_process_weights(steps=3, global_batch=16, classes=3):
    model = train_dp.make_model(classes)
    trainer = epl.EPLTrainer(
        model,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.SGD(0.1),
        config={"cluster.virtual_devices": 1},
    )
    x, y = train_dp.make_data()
    trainer.fit(x, y, batch_size=global_batch, steps_per_epoch=steps, verbose=0, shuffle=False)
    return model.get_weights()


def _job(tmp_path_factory, devices_per_worker, runs):
    """One job of 2 workers x `devices_per_worker` devices that trains each of `runs`
    (name -> train_dp.py flags) in turn, a trainer each with its flags' config (one job,
    not one per run: starting the processes is most of a run's time). Returns its folder."""
    tmp_path = tmp_path_factory.mktemp("runs")
    args = [f"--run={name}={flags}" for name, flags in runs.items()]
    result = run_launch(SCRIPT, tmp_path, 2, devices_per_worker, *args, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    for name in runs:
        assert f"[{name}] worker 0/2 devices={devices_per_worker}" in result.stdout
    return tmp_path


def _run(job, name):
    """A run of `job`: (its output folder, the lines its workers printed, what
    epl_trainer logged on its workers while it ran)."""
    logs = "".join(p.read_text() for p in (job / "logs").rglob("worker_*.log"))
    lines = "".join(f"{line}\n" for line in logs.splitlines() if f"[{name}] " in line)
    messages = "".join(p.read_text() for p in (job / "out" / name).glob("messages_*.txt"))
    return job / "out" / name, lines, messages


# Evaluated first, so that its worker 1 has built no program when it evaluates.
ONE_DEVICE_RUNS = {
    "evaluated_then_trained": "--evaluate_first",
    "uneven_1": "--uneven --steps_per_execution 1",
    "uneven_3": "--uneven --steps_per_execution 3",
    "evaluate_rows": "--evaluate_rows 20",
    "evaluate_rows_global": "--global_batches --evaluate_rows 12",
}
TWO_DEVICE_RUNS = {
    "two_stages": "--two_stages --num_micro_batch 2",
    "tied": "--tied --num_micro_batch 2",
    "split": "--split",
    "short_last": "--short_last --steps_per_execution 2",
    "short_last_v2": "--short_last --steps_per_execution 2 --zero v2",
}


@pytest.fixture(scope="module")
def one_device_job(tmp_path_factory):
    """ONE_DEVICE_RUNS in one job of 2 workers x 1 device (the three took 15.0 s, one 7.1 s)."""
    return _job(tmp_path_factory, 1, ONE_DEVICE_RUNS)


@pytest.fixture(scope="module")
def two_device_job(tmp_path_factory):
    """TWO_DEVICE_RUNS in one job of 2 workers x 2 devices (the five took 27.4 s, one 8.5 s)."""
    return _job(tmp_path_factory, 2, TWO_DEVICE_RUNS)


@pytest.mark.timeout(360)
def test_two_workers_end_with_identical_weights_equal_to_one_process(one_device_job):
    """One device per worker (two per worker: the short-last-batch tests); evaluate
    first, which changes no weight."""
    out, _, _ = _run(one_device_job, "evaluated_then_trained")
    weights = [np.load(out / f"weights_{w}.npz") for w in range(2)]
    expected = _single_process_weights()
    for w in range(2):
        for i, value in enumerate(expected):
            np.testing.assert_allclose(weights[w][f"arr_{i}"], value, atol=1e-5)
    for key in weights[0]:
        np.testing.assert_array_equal(weights[0][key], weights[1][key])


@pytest.mark.parametrize(
    "run, rows", [("evaluate_rows", 20), ("evaluate_rows_global", 12)], ids=["per_worker", "global"]
)
@pytest.mark.timeout(360)
def test_evaluate_counts_every_row_once_as_one_process(one_device_job, run, rows):
    """evaluate(x[:rows]) after fit on both workers: the loss of every row, as Keras's on the
    trained weights. 20 rows in per-worker batches of 8 (global batches of 16, then 4):
    before, dealt in whole batches, the third could not go to both workers and was
    skipped (the loss of 16 rows, 1.1231 for 1.1597). With io.global_batches, 12 rows in
    global batches of 16: before, the one batch was skipped and both workers reported a
    loss of 0.0 (for 1.0836)."""
    out, lines, _ = _run(one_device_job, run)
    losses = [
        float(line.split("loss=")[1])
        for line in lines.splitlines()
        if " evaluate_rows loss=" in line
    ]
    assert len(losses) == 2, lines
    weights = np.load(out / "weights_0.npz")
    model = train_dp.make_model()
    model.set_weights([weights[f"arr_{i}"] for i in range(len(weights.files))])
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = train_dp.make_data()
    expected = model.evaluate(x[:rows], y[:rows], batch_size=rows, verbose=0)
    np.testing.assert_allclose(losses, [expected, expected], rtol=0, atol=1e-6)


@pytest.mark.timeout(360)
def test_evaluate_where_one_worker_has_no_data_then_train(one_device_job):
    """Regression: the metric all-reduce took a different instance key on a worker that
    had built no program (its tf.function traced twice), and the job hung."""
    _, lines, _ = _run(one_device_job, "evaluated_then_trained")
    losses = [line.split("loss=")[1] for line in lines.splitlines() if "evaluate loss=" in line]
    assert len(losses) == 2 and losses[0] == losses[1]  # both report the job-wide loss


def test_a_failing_worker_stops_the_job_with_its_error(tmp_path):
    start = time.monotonic()
    result = _launch(tmp_path, 2, 1, "--fail_worker", "1", "--steps", "1000")
    elapsed = time.monotonic() - start
    assert result.returncode == 1
    assert "worker 1 fails on purpose" in result.stderr
    assert "worker 1 failed (exit code 1)" in result.stderr
    assert elapsed < 60


@pytest.mark.timeout(360)
def test_two_stages_per_worker_with_data_parallelism_between_workers(two_device_job):
    out, _, _ = _run(two_device_job, "two_stages")
    weights = [np.load(out / f"weights_{w}.npz") for w in range(2)]
    for w in range(2):
        for i, value in enumerate(_single_process_weights()):
            np.testing.assert_allclose(weights[w][f"arr_{i}"], value, atol=1e-5)


@pytest.mark.timeout(360)
@pytest.mark.combines("tied_weights+pipeline+multi_worker")
def test_a_tied_weight_in_two_stages_per_worker_with_data_parallelism(two_device_job):
    """Each worker runs one 2-stage pipeline whose stages both use the embedding (tied
    logits): the lane sums the stages' gradients, the workers all-reduce the owner's, the
    copies follow. Both workers end at plain Keras `fit`'s weights on the global batch."""
    out, _, _ = _run(two_device_job, "tied")
    weights = [np.load(out / f"weights_{w}.npz") for w in range(2)]
    model = train_dp.make_tied_model()
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = train_dp.make_tied_data()
    model.fit(x, y, batch_size=16, steps_per_epoch=3, shuffle=False, verbose=0)
    for w in range(2):
        for i, value in enumerate(model.get_weights()):
            np.testing.assert_allclose(weights[w][f"arr_{i}"], value, atol=1e-5)


def test_a_tied_weight_in_a_replica_spanning_workers_is_refused_by_name(tmp_path):
    """2 workers x 1 device: stage 0 on worker 0, stage 1 on worker 1; both use the
    embedding, whose copies would be summed and updated on different processes."""
    result = _launch(tmp_path, 2, 1, "--tied")
    assert result.returncode != 0
    assert "'embed/embeddings' (stages 0, 1)" in result.stderr, result.stderr[-3000:]
    assert "(stages 0, 1) with a replica's stages on several workers" in result.stderr


@pytest.mark.timeout(360)
def test_split_classifier_per_worker_with_data_parallelism_between_workers(two_device_job):
    """replicate(2) + split(2) on each worker: two replicas, one per worker; each shard's
    gradient is reduced across the workers."""
    out, _, _ = _run(two_device_job, "split")
    weights = [np.load(out / f"weights_{w}.npz") for w in range(2)]
    expected = _single_process_weights(classes=4)
    for w in range(2):
        for i, value in enumerate(expected):
            np.testing.assert_allclose(weights[w][f"arr_{i}"], value, atol=1e-5)


@pytest.mark.parametrize(
    "steps_per_execution",
    [1, pytest.param(3, marks=pytest.mark.combines("steps_per_execution+multi_worker"))],
)
@pytest.mark.timeout(360)
def test_a_worker_that_runs_out_first_ends_the_epoch_everywhere(
    one_device_job, steps_per_execution
):
    """Worker 1 has 2 batches, worker 0 has 4: both stop after 2 steps (a warning names
    worker 1) instead of worker 0 waiting in a collective for a partner that never comes.
    With 3 steps per call the workers agree inside the compiled loop: the call ends
    after its second step everywhere."""
    out, lines, messages = _run(one_device_job, f"uneven_{steps_per_execution}")
    assert lines.count("steps=2") == 2, lines
    assert "Worker(s) [1] ran out of data at step 2" in messages, messages
    expected = _single_process_weights(steps=2)
    for w in range(2):
        weights = np.load(out / f"weights_{w}.npz")
        for i, value in enumerate(expected):
            np.testing.assert_allclose(weights[f"arr_{i}"], value, atol=1e-5)


@pytest.mark.parametrize(
    "zero",
    ["", pytest.param("v2", marks=pytest.mark.combines("zero_v2+multi_worker+data_parallel"))],
)
@pytest.mark.combines("steps_per_execution+multi_worker+data_parallel")
@pytest.mark.timeout(360)
def test_a_worker_whose_last_batch_is_shorter_trains_with_its_peer(two_device_job, zero):
    """1001 samples sharded over 2 workers, then batched by 167: worker 0's three batches
    are full, worker 1's last one has 166 rows. Its step no longer retraces alone (which
    gave its collectives other keys than its peer's, and the job hung until the watchdog
    ended it): the job ends cleanly with Keras's weights on the concatenated batches (two
    devices per worker: worker 0's 167 rows are also filled up to split in two). Two steps
    per call: the batches are taken and agreed on inside the compiled loop (one step per
    call, where each is agreed on before the call: test_hosts.py). With ZeRO v2 the
    parameters, sharded over both workers, are all-gathered inside the compiled loop."""
    out, lines, _ = _run(two_device_job, f"short_last_{zero}" if zero else "short_last")
    check_short_last_batches(out, lines)


def check_short_last_batches(out, logs):
    """A `--short_last` job trained 3 steps on both workers, as Keras (SGD) on global batch
    i = worker 0's batch i ++ worker 1's (also used by test_hosts.py)."""
    assert logs.count("steps=3") == 2, logs
    x, y = train_dp.make_data(train_dp.SHORT_LAST_SAMPLES)
    shards = [np.arange(w, len(x), 2) for w in range(2)]  # Dataset.shard(2, w)
    batch = train_dp.SHORT_LAST_BATCH
    model = train_dp.make_model()
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    for step in range(3):
        rows = np.concatenate([shard[step * batch :][:batch] for shard in shards])
        model.train_on_batch(x[rows], y[rows])
    for w in range(2):
        weights = np.load(out / f"weights_{w}.npz")
        for i, value in enumerate(model.get_weights()):
            np.testing.assert_allclose(weights[f"arr_{i}"], value, atol=1e-5)
