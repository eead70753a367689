"""`EPLTrainer.train_on_batch / test_on_batch / predict_on_batch` are Keras's.

Every expected value is plain single-device Keras's own `train_on_batch`, `test_on_batch`
or `predict_on_batch` on a model with the same initial weights and the same batches; the
trainer runs data parallel on 2 devices (a 2-stage pipeline in one test; 2 workers in a
slow one, each passing its own part of the global batch). The batches have 16, 15 and 17
rows: the odd ones do not split evenly over 2 lanes and are filled up with weight-0 rows,
as fit fills them. Tolerance: weights after 3 steps within 1e-6, the returned values
within rtol 1e-6 (observed: weights <= 3e-8 apart, losses <= 9.3e-8 relative, from the
order of sums over the lanes).
"""

import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from _launch import SCRIPTS, run_launch
from _models import LOSS, max_weight_difference, mlp, mlp_data

import epl_trainer as epl

ATOL = 1e-6
RTOL = 1e-6
BATCH_ROWS = (16, 15, 17)
OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.1), "adam": lambda: keras.optimizers.Adam(0.01)}
RETURNS = {  # (metrics, return_dict): Keras returns a scalar, a list or a dict
    "scalar": (None, False),
    "list": (["accuracy"], False),
    "dict": (["accuracy"], True),
}


def _batches(x, y, weights=None):
    start = 0
    for rows in BATCH_ROWS:
        part = slice(start, start + rows)
        start += rows
        yield (x[part], y[part]) if weights is None else (x[part], y[part], weights[part])


def _keras(model, optimizer, metrics=None):
    model.compile(optimizer=optimizer, loss=LOSS, metrics=metrics)
    return model


def _trainer(model, optimizer=None, metrics=None, **config):
    return epl.EPLTrainer(
        model,
        LOSS,
        optimizer,
        metrics=metrics,
        config={"cluster.virtual_devices": 2, **config},
    )


def assert_same_return(ours, theirs):
    """The same kind of value as Keras's (scalar, list or dict), with equal numbers."""
    assert type(ours) is type(theirs), (ours, theirs)
    if isinstance(theirs, dict):
        assert set(ours) == set(theirs)
        ours, theirs = [ours[k] for k in sorted(ours)], [theirs[k] for k in sorted(theirs)]
    np.testing.assert_allclose(ours, theirs, rtol=RTOL)


def _train_both(reference, trainer, batches, **arguments):
    for batch in batches:
        assert_same_return(
            trainer.train_on_batch(*batch, **arguments),
            reference.train_on_batch(*batch, **arguments),
        )


@pytest.mark.parametrize(
    "optimizer, returns",
    # SGD with each of Keras's return kinds; Adam (its step count in every update) with
    # one. Adam with the scalar and the list re-ran the same steps for the same returns
    # (trimmed for the suite's time).
    [("sgd", "scalar"), ("sgd", "list"), ("sgd", "dict"), ("adam", "dict")],
)
def test_train_on_batch_matches_keras(optimizer, returns):
    metrics, return_dict = RETURNS[returns]
    x, y = mlp_data(48)
    reference = _keras(mlp(), OPTIMIZERS[optimizer](), metrics)
    model = mlp()
    trainer = _trainer(model, OPTIMIZERS[optimizer](), metrics)
    _train_both(reference, trainer, _batches(x, y), return_dict=return_dict)
    assert trainer.plan.num_replicas == 2
    assert max_weight_difference(reference, model) < ATOL  # the Keras model has them
    assert int(trainer.optimizer.iterations.numpy()) == 3


def test_test_and_predict_on_batch_match_keras_after_training():
    # SGD only: test_on_batch and predict_on_batch read the trained weights, whichever
    # optimizer trained them (Adam's training on batches: test_train_on_batch_matches_keras
    # [adam-dict]). Its Adam cell is trimmed for the suite's time.
    x, y = mlp_data(48)
    weights = np.random.default_rng(1).uniform(0.2, 2.0, 48).astype("float32")
    reference = _keras(mlp(), OPTIMIZERS["sgd"](), ["accuracy"])
    trainer = _trainer(mlp(), OPTIMIZERS["sgd"](), ["accuracy"])
    _train_both(reference, trainer, _batches(x, y, weights))
    for rows in (16, 7):  # 7: does not split evenly over the lanes
        for return_dict in (False, True):
            assert_same_return(
                trainer.test_on_batch(x[:rows], y[:rows], return_dict=return_dict),
                reference.test_on_batch(x[:rows], y[:rows], return_dict=return_dict),
            )
        assert_same_return(
            trainer.test_on_batch(x[:rows], y[:rows], sample_weight=weights[:rows]),
            reference.test_on_batch(x[:rows], y[:rows], sample_weight=weights[:rows]),
        )
        predictions = trainer.predict_on_batch(x[:rows])
        assert isinstance(predictions, np.ndarray) and predictions.shape == (rows, 3)
        np.testing.assert_allclose(predictions, reference.predict_on_batch(x[:rows]), atol=ATOL)


def test_each_call_returns_its_own_batch_values():
    """As Keras, the metrics are reset before each call: not a running mean."""
    x, y = mlp_data(48)
    trainer = _trainer(mlp(), keras.optimizers.SGD(0.0), ["accuracy"])
    first = trainer.test_on_batch(x[:16], y[:16], return_dict=True)
    trainer.test_on_batch(x[16:32], y[16:32])
    assert trainer.test_on_batch(x[:16], y[:16], return_dict=True) == first
    trained = trainer.train_on_batch(x[:16], y[:16], return_dict=True)  # learning rate 0
    np.testing.assert_allclose(trained["loss"], first["loss"], rtol=RTOL)


def test_class_weight_and_sample_weight_match_keras():
    x, y = mlp_data(48)
    weights = np.random.default_rng(1).uniform(0.2, 2.0, 48).astype("float32")
    reference = _keras(mlp(), keras.optimizers.SGD(0.1))
    model = mlp()
    trainer = _trainer(model, keras.optimizers.SGD(0.1))
    _train_both(reference, trainer, _batches(x, y, weights))
    _train_both(reference, trainer, _batches(x, y), class_weight={0: 1.0, 1: 2.5, 2: 0.5})
    assert max_weight_difference(reference, model) < ATOL


def test_weights_set_on_the_keras_model_between_calls_are_trained():
    """The Keras model holds the weights between calls, as in Keras: a set_weights (or
    another trainer training shared layers) is what the next step starts from."""
    x, y = mlp_data(48)
    start = mlp(seed=5).get_weights()
    reference = _keras(mlp(), keras.optimizers.Adam(0.01))
    model = mlp()
    trainer = _trainer(model, keras.optimizers.Adam(0.01))
    for i, batch in enumerate(_batches(x, y)):
        if i == 1:
            reference.set_weights(start)
            model.set_weights(start)
        assert_same_return(trainer.train_on_batch(*batch), reference.train_on_batch(*batch))
        np.testing.assert_allclose(
            trainer.predict_on_batch(x[:8]), reference.predict_on_batch(x[:8]), atol=ATOL
        )
    assert max_weight_difference(reference, model) < ATOL


def test_a_compiled_model_matches_keras():
    x, y = mlp_data(48)

    def compiled():
        model = mlp()
        model.compile(keras.optimizers.Adam(0.01), LOSS, metrics=["accuracy"])
        return model

    reference, model = compiled(), compiled()
    trainer = epl.EPLTrainer(model, config={"cluster.virtual_devices": 2})
    _train_both(reference, trainer, _batches(x, y))
    assert max_weight_difference(reference, model) < ATOL
    assert_same_return(trainer.test_on_batch(x[:9], y[:9]), reference.test_on_batch(x[:9], y[:9]))
    np.testing.assert_allclose(
        trainer.predict_on_batch(x[:9]), reference.predict_on_batch(x[:9]), atol=ATOL
    )


def test_an_unbuilt_sequential_is_built_by_its_first_batch():
    x, y = mlp_data(48)

    def sequential():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])

    reference = _keras(sequential(), keras.optimizers.SGD(0.1))
    model = sequential()
    trainer = _trainer(model, keras.optimizers.SGD(0.1))
    _train_both(reference, trainer, _batches(x, y))
    assert max_weight_difference(reference, model) < ATOL


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_two_stage_pipeline_matches_keras(optimizer):
    """Stage 0 holds dense_in, stage 1 the logits, each on its own device; 2 micro-batches
    (the odd batches leave them uneven, filled up as fit fills them)."""
    x, y = mlp_data(48)
    reference = _keras(mlp(), OPTIMIZERS[optimizer](), ["accuracy"])
    model = mlp()
    trainer = epl.EPLTrainer(
        model,
        LOSS,
        OPTIMIZERS[optimizer](),
        metrics=["accuracy"],
        stages={"dense_in": 0, "logits": 1},
        config={"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2},
    )
    _train_both(reference, trainer, _batches(x, y))
    assert len(trainer.plan.taskgraphs) == 2 and trainer.plan.num_replicas == 1
    assert max_weight_difference(reference, model) < ATOL
    np.testing.assert_allclose(
        trainer.predict_on_batch(x[:5]), reference.predict_on_batch(x[:5]), atol=ATOL
    )


def test_a_nonfinite_step_stops_train_on_batch_and_is_not_applied():
    x, y = mlp_data(48)
    model = mlp()
    trainer = _trainer(model, keras.optimizers.SGD(0.1))
    trainer.train_on_batch(x[:16], y[:16])
    before = model.get_weights()
    weights = np.ones(16, "float32")
    weights[3] = np.nan  # a NaN loss on every CPU (test_nonfinite.py says why not x)
    with pytest.raises(
        epl.NonFiniteLossError, match=r"at training step 2 \(train_on_batch\)\. The step was not"
    ):
        trainer.train_on_batch(x[16:32], y[16:32], sample_weight=weights)
    for now, then in zip(model.get_weights(), before):
        np.testing.assert_array_equal(now, then)


def test_many_batches_and_empty_batches_are_refused():
    x, y = mlp_data(16)
    trainer = _trainer(mlp(), keras.optimizers.SGD(0.1))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    with pytest.raises(TypeError, match=r"train_on_batch takes one batch.*Received: x of type"):
        trainer.train_on_batch(dataset)
    with pytest.raises(TypeError, match="predict_on_batch takes one batch"):
        trainer.predict_on_batch(batch for batch in [x])
    with pytest.raises(ValueError, match=r"test_on_batch needs a batch of at least one sample"):
        trainer.test_on_batch(x[:0], y[:0])
    with pytest.raises(ValueError, match="`class_weight` and `sample_weight`"):
        trainer.train_on_batch(x, y, sample_weight=np.ones(16), class_weight={0: 2.0})


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_workers_each_passing_its_own_batch_match_keras_on_the_global_batch(tmp_path):
    """Each worker passes its own rows of the global batch (uneven: 8 + 8, 9 + 6, 6 + 11
    rows): the step is Keras's on the whole global batch, on both workers; test_on_batch
    returns the global batch's loss, predict_on_batch each worker's own outputs."""
    sys.path.insert(0, SCRIPTS)
    import train_dp
    import train_on_batch as script

    result = run_launch(os.path.join(SCRIPTS, "train_on_batch.py"), tmp_path, 2, 1, timeout=200)
    assert result.returncode == 0, result.stdout + result.stderr
    x, y = train_dp.make_data()
    reference = train_dp.make_model()
    reference.compile(keras.optimizers.Adam(0.01), LOSS)
    steps = [script.global_rows(step) for step in range(len(script.ROWS))]
    losses = [reference.train_on_batch(x[rows], y[rows]) for rows in steps]
    tested = reference.test_on_batch(x[steps[-1]], y[steps[-1]])
    for worker in range(2):
        saved = np.load(tmp_path / "out" / f"worker_{worker}.npz")
        for i, value in enumerate(reference.get_weights()):
            np.testing.assert_allclose(saved[f"arr_{i}"], value, atol=1e-5)
        np.testing.assert_allclose(saved["losses"], losses, rtol=1e-5)
        np.testing.assert_allclose(saved["tested"], tested, rtol=1e-5)
        rows = x[script.worker_rows(0, worker)]
        np.testing.assert_allclose(
            saved["predictions"], reference.predict_on_batch(rows), atol=1e-5
        )
