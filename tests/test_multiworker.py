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


@pytest.fixture(scope="module")
def evaluated_then_trained(tmp_path_factory):
    """2 workers x 1 device that evaluate first (worker 1 on no data), then train 3 steps:
    one job for the two tests below (evaluate changes no weight: the training must equal
    one process's as it does without the evaluate)."""
    tmp_path = tmp_path_factory.mktemp("evaluated_then_trained")
    result = _launch(tmp_path, 2, 1, "--evaluate_first")
    assert result.returncode == 0, result.stdout + result.stderr
    return tmp_path, result


def test_two_workers_end_with_identical_weights_equal_to_one_process(evaluated_then_trained):
    """One device per worker (two per worker: the short-last-batch tests)."""
    tmp_path, result = evaluated_then_trained
    assert "worker 0/2 devices=1" in result.stdout
    weights = [np.load(tmp_path / "out" / f"weights_{w}.npz") for w in range(2)]
    expected = _single_process_weights()
    for w in range(2):
        for i, value in enumerate(expected):
            np.testing.assert_allclose(weights[w][f"arr_{i}"], value, atol=1e-5)
    for key in weights[0]:
        np.testing.assert_array_equal(weights[0][key], weights[1][key])


def test_evaluate_where_one_worker_has_no_data_then_train(evaluated_then_trained):
    """Regression: the metric all-reduce took a different instance key on a worker that
    had built no program (its tf.function traced twice), and the job hung."""
    tmp_path, _ = evaluated_then_trained
    logs = "".join(p.read_text() for p in (tmp_path / "logs").rglob("worker_*.log"))
    losses = [line.split("loss=")[1] for line in logs.splitlines() if "evaluate loss=" in line]
    assert len(losses) == 2 and losses[0] == losses[1]  # both report the job-wide loss


def test_a_failing_worker_stops_the_job_with_its_error(tmp_path):
    start = time.monotonic()
    result = _launch(tmp_path, 2, 1, "--fail_worker", "1", "--steps", "1000")
    elapsed = time.monotonic() - start
    assert result.returncode == 1
    assert "worker 1 fails on purpose" in result.stderr
    assert "worker 1 failed (exit code 1)" in result.stderr
    assert elapsed < 60


def test_two_stages_per_worker_with_data_parallelism_between_workers(tmp_path):
    result = _launch(tmp_path, 2, 2, "--two_stages", "--num_micro_batch", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    weights = [np.load(tmp_path / "out" / f"weights_{w}.npz") for w in range(2)]
    for w in range(2):
        for i, value in enumerate(_single_process_weights()):
            np.testing.assert_allclose(weights[w][f"arr_{i}"], value, atol=1e-5)


@pytest.mark.combines("tied_weights+pipeline+multi_worker")
def test_a_tied_weight_in_two_stages_per_worker_with_data_parallelism(tmp_path):
    """Each worker runs one 2-stage pipeline whose stages both use the embedding (tied
    logits): the lane sums the stages' gradients, the workers all-reduce the owner's, the
    copies follow. Both workers end at plain Keras `fit`'s weights on the global batch."""
    result = _launch(tmp_path, 2, 2, "--tied", "--num_micro_batch", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    weights = [np.load(tmp_path / "out" / f"weights_{w}.npz") for w in range(2)]
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


def test_split_classifier_per_worker_with_data_parallelism_between_workers(tmp_path):
    """replicate(2) + split(2) on each worker: two replicas, one per worker; each shard's
    gradient is reduced across the workers."""
    result = _launch(tmp_path, 2, 2, "--split")
    assert result.returncode == 0, result.stdout + result.stderr
    weights = [np.load(tmp_path / "out" / f"weights_{w}.npz") for w in range(2)]
    expected = _single_process_weights(classes=4)
    for w in range(2):
        for i, value in enumerate(expected):
            np.testing.assert_allclose(weights[w][f"arr_{i}"], value, atol=1e-5)


@pytest.mark.parametrize(
    "steps_per_execution",
    [1, pytest.param(3, marks=pytest.mark.combines("steps_per_execution+multi_worker"))],
)
def test_a_worker_that_runs_out_first_ends_the_epoch_everywhere(tmp_path, steps_per_execution):
    """Worker 1 has 2 batches, worker 0 has 4: both stop after 2 steps (a warning names
    worker 1) instead of worker 0 waiting in a collective for a partner that never comes.
    With 3 steps per call the workers agree inside the compiled loop: the call ends
    after its second step everywhere."""
    result = _launch(tmp_path, 2, 1, "--uneven", "--steps_per_execution", steps_per_execution)
    assert result.returncode == 0, result.stdout + result.stderr
    logs = "".join(p.read_text() for p in (tmp_path / "logs").rglob("worker_*.log"))
    assert logs.count("steps=2") == 2, logs
    assert "Worker(s) [1] ran out of data at step 2" in logs, logs
    expected = _single_process_weights(steps=2)
    for w in range(2):
        weights = np.load(tmp_path / "out" / f"weights_{w}.npz")
        for i, value in enumerate(expected):
            np.testing.assert_allclose(weights[f"arr_{i}"], value, atol=1e-5)


@pytest.mark.parametrize(
    "zero",
    ["", pytest.param("v2", marks=pytest.mark.combines("zero_v2+multi_worker+data_parallel"))],
)
@pytest.mark.combines("steps_per_execution+multi_worker+data_parallel")
def test_a_worker_whose_last_batch_is_shorter_trains_with_its_peer(tmp_path, zero):
    """1001 samples sharded over 2 workers, then batched by 167: worker 0's three batches
    are full, worker 1's last one has 166 rows. Its step no longer retraces alone (which
    gave its collectives other keys than its peer's, and the job hung until the watchdog
    ended it): the job ends cleanly with Keras's weights on the concatenated batches (two
    devices per worker: worker 0's 167 rows are also filled up to split in two). Two steps
    per call: the batches are taken and agreed on inside the compiled loop (one step per
    call, where each is agreed on before the call: test_hosts.py). With ZeRO v2 the
    parameters, sharded over both workers, are all-gathered inside the compiled loop."""
    args = ["--short_last", "--steps_per_execution", 2, *(["--zero", zero] if zero else [])]
    result = _launch(tmp_path, 2, 2, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    logs = "".join(p.read_text() for p in (tmp_path / "logs").rglob("worker_*.log"))
    check_short_last_batches(tmp_path / "out", logs)


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
