"""Data parallelism and gradient accumulation match single-device Keras numerically.

Tolerance: weights after 3 SGD steps agree to atol 1e-5 (observed ~6e-8: the only
difference is the order of floating-point sums across replicas).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _models import (
    LOSS,
    keras_reference,
    max_weight_difference,
    mlp,
    mlp_data,
    parity_data,
    parity_model,
)

import epl_trainer as epl

ATOL = 1e-5


def _trainer(model, devices, optimizer=None, **config):
    config = {"cluster.virtual_devices": devices, **config}
    return epl.EPLTrainer(model, LOSS, optimizer or keras.optimizers.SGD(0.1), config=config)


@pytest.mark.parametrize("devices", [2, 4])
def test_data_parallel_matches_single_device_keras(devices):
    x, y = parity_data()
    reference = parity_model()
    keras_reference(reference, x, y, keras.optimizers.SGD(0.1), batch_size=16, steps=3)

    model = parity_model()
    trainer = _trainer(model, devices)
    trainer.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=3, verbose=0, shuffle=False)

    assert trainer.plan.num_replicas == devices
    assert max_weight_difference(reference, model) < ATOL


@pytest.mark.parametrize("devices", [1, 2])
def test_gradient_accumulation_matches_keras_on_the_same_batches(devices):
    x, y = parity_data()
    reference = parity_model()
    keras_reference(reference, x, y, keras.optimizers.SGD(0.1), batch_size=32, steps=3)

    model = parity_model()
    trainer = _trainer(model, devices, **{"pipeline.num_micro_batch": 4})
    trainer.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=3, verbose=0, shuffle=False)

    assert trainer.plan.num_micro_batch == 4
    assert max_weight_difference(reference, model) < ATOL


def test_adam_with_data_parallelism_keeps_slots_per_replica():
    x, y = mlp_data()
    reference = mlp()
    keras_reference(reference, x, y, keras.optimizers.Adam(0.01), batch_size=16, steps=4)
    model = mlp()
    trainer = _trainer(model, 4, optimizer=keras.optimizers.Adam(0.01))
    trainer.fit(x, y, batch_size=16, steps_per_epoch=4, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < ATOL
    assert int(trainer.optimizer.iterations.numpy()) == 4


def test_sum_reduction_is_mean_times_replicas():
    """With SGD, summing 2 replicas' gradients equals the mean at twice the rate."""
    x, y = mlp_data()
    reference = mlp()
    keras_reference(reference, x, y, keras.optimizers.SGD(0.2), batch_size=16, steps=3)
    model = mlp()
    trainer = _trainer(model, 2, **{"communication.gradients_reduce_method": "sum"})
    trainer.fit(x, y, batch_size=16, steps_per_epoch=3, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < ATOL


@pytest.mark.parametrize("max_splits", [1, 3])
def test_gradient_buckets_do_not_change_the_result(max_splits):
    x, y = parity_data()
    reference = parity_model()
    keras_reference(reference, x, y, keras.optimizers.SGD(0.1), batch_size=16, steps=2)
    model = parity_model()
    trainer = _trainer(model, 2, **{"communication.max_splits": max_splits})
    trainer.fit(x, y, batch_size=16, steps_per_epoch=2, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < ATOL


def test_global_clipnorm_before_and_after_allreduce():
    """Clipping the mean gradient (after) matches Keras; clipping per replica differs."""
    x, y = mlp_data()
    reference = mlp()
    keras_reference(
        reference, x, y, keras.optimizers.SGD(0.5, global_clipnorm=0.05), batch_size=16, steps=3
    )
    after = mlp()
    _trainer(
        after,
        2,
        optimizer=keras.optimizers.SGD(0.5, global_clipnorm=0.05),
        **{"communication.clip_after_allreduce": True},
    ).fit(x, y, batch_size=16, steps_per_epoch=3, verbose=0, shuffle=False)
    before = mlp()
    _trainer(before, 2, optimizer=keras.optimizers.SGD(0.5, global_clipnorm=0.05)).fit(
        x, y, batch_size=16, steps_per_epoch=3, verbose=0, shuffle=False
    )
    assert max_weight_difference(reference, after) < ATOL
    assert max_weight_difference(reference, before) > 1e-4


def test_batchnorm_statistics_stay_identical_across_replicas():
    x, y = mlp_data()
    model = mlp(batchnorm=True)
    trainer = _trainer(model, 4)
    trainer.fit(x, y, batch_size=16, steps_per_epoch=2, verbose=0, shuffle=False)
    state = trainer.engine.state
    for i in state.synced_non_trainable():
        values = [np.asarray(lane[i].value) for lane in state.non_trainable]
        for other in values[1:]:
            np.testing.assert_allclose(values[0], other, atol=1e-7)
    moving_mean = model.get_layer("bn").moving_mean.numpy()
    assert np.abs(moving_mean).max() > 0  # the statistics were updated and written back


def test_batchnorm_statistics_average_the_replicas():
    """One step on 2 replicas: moving mean = average of each replica's own update."""
    x, y = mlp_data(n=32)
    single = [mlp(batchnorm=True) for _ in range(2)]
    for half, model in zip((slice(0, 16), slice(16, 32)), single):
        _trainer(model, 1).fit(
            x[half], y[half], batch_size=16, steps_per_epoch=1, verbose=0, shuffle=False
        )
    model = mlp(batchnorm=True)
    _trainer(model, 2).fit(x, y, batch_size=32, steps_per_epoch=1, verbose=0, shuffle=False)
    expected = (single[0].get_layer("bn").moving_mean + single[1].get_layer("bn").moving_mean) / 2
    np.testing.assert_allclose(model.get_layer("bn").moving_mean.numpy(), expected, atol=1e-6)


def test_dropout_seeds_differ_per_replica_and_lane0_keeps_the_models():
    model = mlp(dropout=0.5)
    trainer = _trainer(model, 4)
    x, y = mlp_data()
    trainer.fit(x, y, batch_size=16, steps_per_epoch=1, verbose=0, shuffle=False)
    state = trainer.engine.state
    index = next(i for i, v in enumerate(state.model_non_trainable) if "seed_generator" in v.path)
    seeds = [int(np.asarray(lane[index].value)[0]) for lane in state.non_trainable]
    assert len(set(seeds)) == 4
    assert seeds[0] == int(np.asarray(state.model_non_trainable[index].value)[0])


def test_evaluate_and_predict_match_keras_with_uneven_batches():
    x, y = parity_data(n=50)
    model = parity_model()
    model.compile(loss=LOSS, metrics=["accuracy"])
    expected_loss, expected_accuracy = model.evaluate(x, y, batch_size=16, verbose=0)
    expected_outputs = model.predict(x, batch_size=16, verbose=0)

    trainer = epl.EPLTrainer(
        model, LOSS, "sgd", metrics=["accuracy"], config={"cluster.virtual_devices": 4}
    )
    logs = trainer.evaluate(
        x, y, batch_size=16, return_dict=True
    )  # last batch of 2 does not split into 4
    outputs = trainer.predict(x, batch_size=16)
    assert logs["loss"] == pytest.approx(expected_loss, abs=1e-5)
    assert logs["accuracy"] == pytest.approx(expected_accuracy, abs=1e-6)
    np.testing.assert_allclose(outputs, expected_outputs, atol=1e-5)


def test_weights_are_written_back_to_the_keras_model():
    x, y = mlp_data()
    model = mlp()
    trainer = _trainer(model, 2)
    trainer.fit(x, y, batch_size=16, steps_per_epoch=2, verbose=0, shuffle=False)
    np.testing.assert_allclose(model.predict(x, verbose=0), trainer.predict(x), atol=1e-5)


def test_two_stages_and_two_pipelines_match_keras():
    """Stage partition + execution: 2 stages x 2 replicas on 4 devices (DP x PP)."""
    x, y = parity_data()
    reference = parity_model()
    keras_reference(reference, x, y, keras.optimizers.SGD(0.1), batch_size=16, steps=3)
    model = parity_model()
    trainer = epl.EPLTrainer(
        model,
        LOSS,
        keras.optimizers.SGD(0.1),
        stages={"conv|pool_image|embed|pool_tokens|concat": 0, "hidden|norm|logits": 1},
        config={"cluster.virtual_devices": 4, "pipeline.num_micro_batch": 2},
    )
    trainer.fit(x, y, batch_size=16, steps_per_epoch=3, verbose=0, shuffle=False)
    assert trainer.plan.num_replicas == 2
    assert [lane.devices for lane in trainer.lanes] == [
        (
            "/job:localhost/replica:0/task:0/device:CPU:0",
            "/job:localhost/replica:0/task:0/device:CPU:1",
        ),
        (
            "/job:localhost/replica:0/task:0/device:CPU:2",
            "/job:localhost/replica:0/task:0/device:CPU:3",
        ),
    ]
    assert max_weight_difference(reference, model) < ATOL


def test_model_fn_returning_a_model_spec():
    x, y = mlp_data()
    reference = mlp()
    keras_reference(reference, x, y, keras.optimizers.SGD(0.1), batch_size=16, steps=2)

    def model_fn():
        return epl.ModelSpec(mlp(), loss=LOSS, metrics=["accuracy"])

    trainer = epl.EPLTrainer(
        model_fn, optimizer=keras.optimizers.SGD(0.1), config={"cluster.virtual_devices": 2}
    )
    history = trainer.fit(x, y, batch_size=16, steps_per_epoch=2, verbose=0, shuffle=False)
    assert "accuracy" in history.history
    assert max_weight_difference(reference, trainer.model) < ATOL


def test_batches_that_do_not_split_train_as_keras_static_and_dynamic():
    """Refused before the one-batch loss semantics (core/engine/objective.py): batches of
    15 over 2 replicas (numpy: the last of 67 rows has 7), and a dataset's last batch of
    3; now each step equals Keras's on exactly those rows."""
    x, y = mlp_data(n=67)
    reference, model = mlp(), mlp()
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    reference.fit(x, y, batch_size=15, shuffle=False, verbose=0)
    trainer = _trainer(model, 2, **{"pipeline.num_micro_batch": 2})
    trainer.fit(x, y, batch_size=15, shuffle=False, verbose=0)
    assert int(trainer.optimizer.iterations.numpy()) == 5
    assert max_weight_difference(reference, model) < ATOL

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)  # last batch has 3 rows
    reference, model = mlp(), mlp()
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    reference.fit(dataset, shuffle=False, verbose=0)
    trainer = _trainer(model, 2)
    trainer.fit(dataset, verbose=0)
    assert int(trainer.optimizer.iterations.numpy()) == 5
    assert max_weight_difference(reference, model) < ATOL


class SubclassedMLP(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.logits = keras.layers.Dense(3)

    def call(self, x):
        return self.logits(self.hidden(x))


def test_subclassed_model_trains_data_parallel():
    x, y = mlp_data()
    keras.utils.set_random_seed(3)
    reference = SubclassedMLP()
    reference(x[:1])
    initial = reference.get_weights()
    keras_reference(reference, x, y, keras.optimizers.SGD(0.1), batch_size=16, steps=3)
    model = SubclassedMLP()  # not built: the trainer builds it from the first batch
    trainer = _trainer(model, 2)
    model(x[:1])
    model.set_weights(initial)
    trainer.fit(x, y, batch_size=16, steps_per_epoch=3, verbose=0, shuffle=False)
    assert max_weight_difference(reference, model) < ATOL


def test_settings_that_cannot_apply_are_refused_not_ignored():
    with pytest.raises(ValueError, match="num_stages only applies"):
        _trainer(mlp(), 2, **{"pipeline.num_stages": 2})


def test_impossible_layouts_name_every_term():
    from epl_trainer.core.plan.ir import PlanError

    with pytest.raises(PlanError, match="3"):
        epl.EPLTrainer(
            mlp(), LOSS, "sgd", strategy=epl.replicate(3), config={"cluster.virtual_devices": 2}
        )
    with pytest.raises(epl.ConfigError, match=r"Did you mean 'pipeline\.num_micro_batch'"):
        _trainer(mlp(), 2, **{"pipeline.num_micro_batches": 2})


def test_the_first_fit_in_a_process_traces_the_training_step_once(monkeypatch):
    """The collectives' ordering-token variables are made when the engine is built: made
    during the first trace (as they were, once per process and device), the step had to
    be traced a second time (tf.function's rule for variables created while tracing)."""
    from epl_trainer.core.comm import keys

    monkeypatch.setattr(keys, "_ordering_tokens", {})  # as in a fresh process
    x, y = mlp_data()
    trainer = _trainer(mlp(), 2, **{"communication.num_communicators": 2})
    trainer.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert trainer.engine.program.train_on_iterator.experimental_get_tracing_count() == 1
