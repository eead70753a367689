"""Every worker starts from worker 0's state (start_state.py), with real worker processes.

The workers seed Keras differently on purpose (an unseeded job), give their BatchNorm
statistics their own values and move their optimizer's step counter. After the engine is
built every worker's Keras model must hold worker 0's initial values, and one short
epoch of SGD must equal plain single-process Keras `fit` on the global batches started
from worker 0's initial weights.
"""

import json
import os
import sys

import keras
import numpy as np
import pytest
from _launch import SCRIPTS, run_launch

import epl_trainer as epl
from epl_trainer.training import start_state

SCRIPT = os.path.join(SCRIPTS, "train_start_equal.py")
sys.path.insert(0, SCRIPTS)
import train_start_equal  # noqa: E402

STEPS = 3


def _arrays(path):
    loaded = np.load(path)
    return [loaded[f"arr_{i}"] for i in range(len(loaded.files))]


def _keras_reference(mode, initial_weights):
    """Plain Keras on one device from worker 0's initial weights, on the global batches."""
    x, y = train_start_equal.make_data()
    model = train_start_equal.own_model(mode, seed=0, x=x)[0]
    if not model.built:
        model(x[:1])
    model.set_weights(initial_weights)
    model.compile(
        keras.optimizers.SGD(train_start_equal.LEARNING_RATE),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rows = STEPS * train_start_equal.GLOBAL_BATCH
    batch = train_start_equal.GLOBAL_BATCH
    model.fit(x[:rows], y[:rows], batch_size=batch, shuffle=False, verbose=0)
    return model.get_weights()


MODES = ("dp", "zero1", "span", "subclassed")
CHECKED = "Start state identical on all 2 workers: checksum"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One job of 2 workers (epl-launch) that trains every mode in turn, a trainer each
    (one job, not one per mode: four took 30 s in the suite, most of it starting
    processes). Returns its output folder."""
    tmp_path = tmp_path_factory.mktemp("start_equal")
    result = run_launch(SCRIPT, tmp_path, 2, 1, "--mode", *MODES, "--steps", STEPS, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return tmp_path / "out"


@pytest.mark.slow
@pytest.mark.timeout(360)
@pytest.mark.parametrize(
    "mode",
    [
        "dp",
        pytest.param("zero1", marks=pytest.mark.combines("zero_v1+multi_worker")),
        "span",
        "subclassed",
    ],
)
def test_workers_start_from_worker_0_and_train_like_one_process(job, mode):
    out = job / mode
    own = [_arrays(out / f"own_{w}.npz") for w in range(2)]
    # The workers really began apart (kernels, BatchNorm statistics).
    assert all(np.abs(a - b).max() > 0.1 for a, b in zip(own[0], own[1]) if a.std() > 0)

    for w in range(2):
        for got, want in zip(_arrays(out / f"start_{w}.npz"), own[0]):
            np.testing.assert_array_equal(got, want)
        result = json.loads((out / f"result_{w}.json").read_text())
        assert result["iterations"] == STEPS
        # This trainer's start was checked (each worker logs it once).
        logged = result["start_state_log"]
        assert sum(CHECKED in message for message in logged) == 1, logged

    expected = _keras_reference(mode, own[0])
    for w in range(2):
        trained = _arrays(out / f"weights_{w}.npz")
        assert len(trained) == len(expected)
        for got, want in zip(trained, expected):
            np.testing.assert_allclose(got, want, atol=1e-5)


def test_a_checksum_mismatch_names_the_workers_and_the_first_variable():
    names = ["'dense/kernel' (model)", "'dense/bias' (model)", "'sgd/iteration' (optimizer)"]
    hashes = np.array([[5, 6, 7], [5, 9, 3], [5, 8, 7]])
    sums = np.array([[0.5, 1.0, 2.0], [0.5, 1.5, 0.0], [0.5, 2.5, 2.0]])
    with pytest.raises(
        start_state.StartStateError,
        match=r"Workers \[1, 2\] do not hold worker 0's value of 'dense/bias' \(model\).*"
        r"2 of 3 variables differ.*Received: worker 0: sum=1.0, worker 1: sum=1.5, "
        r"worker 2: sum=2.5",
    ):
        start_state.compare_checksums(names, hashes, sums)
    start_state.compare_checksums(names, hashes[[0, 0]], sums[[0, 1]])  # the same bytes


@pytest.mark.parametrize(
    "dtype", ["float32", "float64", "float16", "bfloat16", "int64", "uint32", "int8", "bool"]
)
def test_the_broadcast_wire_is_exact_for_every_dtype(dtype):
    import tensorflow as tf

    rng = np.random.default_rng(0)
    raw = rng.normal(size=7) * 100
    value = tf.constant(raw > 0) if dtype == "bool" else tf.cast(tf.constant(raw), dtype)
    if value.dtype.is_floating:
        value = tf.concat([value, -tf.zeros([1], value.dtype)], 0)  # and a -0.0
    wire = start_state._to_wire(value)
    assert wire.dtype in (tf.int32, tf.int64)
    back = start_state._from_wire(wire + tf.zeros_like(wire), value.dtype)
    assert back.dtype == value.dtype
    same_bits = tf.io.serialize_tensor(back).numpy() == tf.io.serialize_tensor(value).numpy()
    assert same_bits


def test_a_single_worker_runs_no_collective(monkeypatch):
    def no_group(*args, **kwargs):
        raise AssertionError("a single-worker job built a collective group")

    monkeypatch.setattr(start_state, "host_group", no_group)
    x, y = train_start_equal.make_data(32)
    trainer = epl.EPLTrainer(
        train_start_equal.make_model(seed=0),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.SGD(0.1),
        config={"cluster.virtual_devices": 2},
    )
    trainer.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=2, verbose=0, shuffle=False)
    assert int(trainer.optimizer.iterations.numpy()) == 2
