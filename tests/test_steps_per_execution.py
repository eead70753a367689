"""Fewer host round trips: `steps_per_execution` (several training steps per call of the
compiled step), evaluation as a loop in the graph, and pipelined evaluation/prediction.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import epl_trainer as epl
from epl_trainer.training.trainer import EVAL_STEPS_PER_CALL, _checked_steps_per_execution

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def model():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu", name="embed")(inputs)
    h = keras.layers.Dense(16, activation="relu", name="body")(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(h))


def data(rows=96, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 8)).astype("float32")
    return x, (x[:, :3].argmax(axis=1)).astype("int32")


class BatchLog(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(batch)


def train(steps_per_execution, steps_per_epoch=None, epochs=2, rows=96, **config):
    x, y = data(rows)
    m = model()
    trainer = epl.EPLTrainer(
        m,
        LOSS,
        keras.optimizers.Adam(0.01),
        config={"cluster.virtual_devices": 2, **config},
        steps_per_execution=steps_per_execution,
    )
    log = BatchLog()
    history = trainer.fit(
        x,
        y,
        batch_size=16,
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        verbose=0,
        callbacks=[log],
        shuffle=False,
    )
    return m, trainer, history, log


@pytest.mark.parametrize("steps_per_epoch", [None, 6, 4])
@pytest.mark.combines("steps_per_execution+data_parallel")
def test_several_steps_per_call_train_exactly_like_one(steps_per_epoch):
    one, _, history_one, log_one = train(1, steps_per_epoch)
    four, trainer, history_four, log_four = train(4, steps_per_epoch)
    for a, b in zip(one.get_weights(), four.get_weights()):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(history_four.history["loss"], history_one.history["loss"])
    # 6 batches of 16: two epochs of 6 steps, or with steps_per_epoch=4 an epoch of 4 and
    # one of the 2 batches left (the data runs out mid-epoch, as in Keras).
    expected_steps = {None: 12, 6: 12, 4: 6}[steps_per_epoch]
    assert int(trainer.optimizer.iterations.numpy()) == expected_steps
    # One batch callback per call, with the index of the call's last step (as Keras).
    assert log_four.ends == {None: [3, 5, 3, 5], 6: [3, 5, 3, 5], 4: [3, 1]}[steps_per_epoch]
    assert (
        log_one.ends
        == {None: [*range(6)] * 2, 6: [*range(6)] * 2, 4: [0, 1, 2, 3, 0, 1]}[steps_per_epoch]
    )

    # Calls of 4 and of 2 steps share one trace (the count is a tensor): the main job's
    # epochs end on a shorter call, which traced the step again.
    assert trainer.engine.program._train_many.experimental_get_tracing_count() == 1


@pytest.mark.combines("steps_per_execution+one_device")
def test_steps_per_execution_comes_from_compile_and_matches_keras():
    x, y = data()
    reference = model()
    reference.compile(keras.optimizers.Adam(0.01), LOSS, steps_per_execution=3)
    reference.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    compiled = model()
    compiled.compile(keras.optimizers.Adam(0.01), LOSS, steps_per_execution=3)
    trainer = epl.EPLTrainer(compiled, config={"cluster.virtual_devices": 1})
    assert trainer.steps_per_execution == 3
    trainer.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    for a, b in zip(reference.get_weights(), compiled.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_periodic_checkpoints_are_written_after_the_call_that_reaches_them(tmp_path):
    config = {"checkpoint.dir": str(tmp_path), "checkpoint.save_steps": 5}
    train(4, steps_per_epoch=6, epochs=1, **config)
    # Steps 1-4, then 5-6: the second call reaches step 5 and is saved at step 6 (a
    # checkpoint holds the state after a whole call), then the epoch end saves again.
    saved = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-"))
    assert saved == ["ckpt-6"], saved


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="steps_per_execution must be an int >= 1"):
        _checked_steps_per_execution(0)
    assert _checked_steps_per_execution(None) == 1


def test_evaluation_and_prediction_over_many_calls_equal_keras():
    x, y = data(rows=16 * (EVAL_STEPS_PER_CALL + 5) + 7)  # several calls and a short batch
    reference = model()
    reference.compile(loss=LOSS, metrics=["accuracy"])
    expected = reference.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    trainer = epl.EPLTrainer(
        model(), LOSS, metrics=["accuracy"], config={"cluster.virtual_devices": 2}
    )
    got = trainer.evaluate(x, y, batch_size=16, return_dict=True)
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert got["accuracy"] == pytest.approx(expected["accuracy"], rel=1e-6)
    predictions = trainer.predict(x, batch_size=16)
    assert predictions.shape == (len(x), 3)
    np.testing.assert_allclose(
        predictions, reference.predict(x, batch_size=16, verbose=0), rtol=1e-5, atol=1e-6
    )


def test_pipelined_evaluation_and_prediction_equal_keras():
    """With stages, evaluation and prediction run in micro-batches so the stages overlap;
    padding a batch that does not split evenly must not change the results."""
    x, y = data(rows=45)
    reference = model()
    reference.compile(loss=LOSS)
    expected_loss = reference.evaluate(x, y, batch_size=15, verbose=0)
    expected = reference.predict(x, batch_size=15, verbose=0)
    trainer = epl.EPLTrainer(
        model(),
        LOSS,
        stages={"embed": 0, "body|head": 1},
        config={"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 4},
    )
    assert (
        trainer.runtime.ensure_for(tf.data.Dataset.from_tensors((x, y))).program._eval_pieces == 4
    )
    np.testing.assert_allclose(trainer.predict(x, batch_size=15), expected, rtol=1e-5, atol=1e-6)
    assert trainer.evaluate(x, y, batch_size=15, return_dict=True)["loss"] == pytest.approx(
        expected_loss, rel=1e-5
    )


def test_split_layers_with_several_steps_per_call_are_refused():
    with pytest.raises(epl.SplitError, match="Use steps_per_execution=1"):
        epl.EPLTrainer(
            model(),
            LOSS,
            split=["head"],
            config={"cluster.virtual_devices": 2, "cluster.colocate_split_and_replicate": True},
            steps_per_execution=4,
        )


@pytest.mark.combines("steps_per_execution+pipeline")
def test_several_steps_per_call_of_a_pipeline_train_exactly_like_one():
    x, y = data()
    weights = []
    for steps_per_execution in (1, 4):
        m = model()
        trainer = epl.EPLTrainer(
            m,
            LOSS,
            keras.optimizers.Adam(0.01),
            stages={"embed": 0, "body|head": 1},
            config={"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2},
            steps_per_execution=steps_per_execution,
        )
        trainer.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        weights.append(m.get_weights())
    for a, b in zip(*weights):
        np.testing.assert_array_equal(a, b)
