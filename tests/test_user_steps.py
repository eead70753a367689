"""A model's own train_step / test_step / predict_step / compute_loss runs through
EPLTrainer (core/engine/user_steps.py), equal to plain Keras on one device.

Before, EPLTrainer ran its own (Keras's default) step in their place without a word:
the halved-gradient step below ended 3.8e-2 from the user's, the extra L2 term of
`compute_loss` was ignored (8.6e-2 off). Each case runs on 2 data-parallel devices
against `model.fit` on one, with SGD and with Adam (Adam hides a constant factor in the
gradient: the halved step would pass with Adam alone).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import epl_trainer as epl

ATOL = 1e-6
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "adam": lambda: keras.optimizers.Adam(0.01),
}


class HalvedGradients(keras.Model):
    """Keras's guide's custom train_step ("Customizing what happens in fit()"), with its
    gradients halved so the default step gives another result."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip([g * 0.5 for g in grads], self.trainable_variables))
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class L2Loss(keras.Model):
    """Its own compute_loss: Keras's loss plus an L2 term (Keras's default step calls it)."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        return loss + 0.05 * tf.add_n([tf.reduce_sum(w**2) for w in self.trainable_weights])


class OwnTestAndPredict(keras.Model):
    """test_step and predict_step of its own (a scaled prediction, a custom metric)."""

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False) * 2.0
        self.compiled_loss_tracker.update_state(LOSS(y, y_pred))
        return {"doubled_loss": self.compiled_loss_tracker.result()}

    def predict_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        return self(x, training=False) * 2.0

    @property
    def compiled_loss_tracker(self):
        if not hasattr(self, "_doubled"):
            self._doubled = keras.metrics.Mean(name="doubled_loss")
        return self._doubled


def _model(cls, seed=1, batchnorm=False):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    if batchnorm:
        h = keras.layers.BatchNormalization()(h)
    outputs = keras.layers.Dense(3)(h)
    return cls(inputs, outputs)


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 8)).astype("float32"), rng.integers(0, 3, n)


def _max_difference(a, b) -> float:
    return max(float(np.abs(np.asarray(u) - np.asarray(v)).max()) for u, v in zip(a, b))


def _fit_both(cls, optimizer, batch_size=16, epochs=2, n=64, **kwargs):
    x, y = _data(n)
    reference = _model(cls, **kwargs)
    reference.compile(OPTIMIZERS[optimizer](), LOSS, metrics=["accuracy"])
    expected = reference.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    model = _model(cls, **kwargs)
    model.compile(OPTIMIZERS[optimizer](), LOSS, metrics=["accuracy"])
    trainer = epl.EPLTrainer(model, config={"cluster.virtual_devices": 2})
    got = trainer.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return reference, model, expected.history, got.history


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("cls", [HalvedGradients, L2Loss], ids=["train_step", "compute_loss"])
def test_the_models_own_step_runs_on_two_devices(cls, optimizer):
    reference, model, expected, got = _fit_both(cls, optimizer)
    assert _max_difference(reference.get_weights(), model.get_weights()) < ATOL
    # The user's optimizer itself holds the trained state (slots, iterations).
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations) == 8
    assert _max_difference(reference.optimizer.variables, model.optimizer.variables) < ATOL
    assert set(got) == set(expected)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6)


class MetricsAfterTheUpdate(keras.Model):
    """Keras's guide's train_step, its metrics computed on a forward after the update."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return self.compute_metrics(x, y, self(x), sample_weight=None)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_asserts_of_the_loss_and_of_a_metric_after_the_update_do_not_deadlock(optimizer):
    """The sparse cross-entropy's shape asserts, in the loss before the update and in a
    metric after it: TF ran them in one program order over the lanes, so lane 1's loss
    waited for lane 0's metric, which waited for lane 0's update and its all-reduce with
    lane 1: the first step hung (now: each lane's asserts in its own order)."""
    rng = np.random.default_rng(0)  # a label per position: the asserts check the shapes
    x, y = rng.normal(size=(64, 4, 8)).astype("float32"), rng.integers(0, 3, (64, 4))
    metric = lambda: keras.metrics.SparseCategoricalCrossentropy(from_logits=True)  # noqa: E731

    def sequence_model():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((4, 8))
        h = keras.layers.Dense(16, activation="relu")(inputs)
        return MetricsAfterTheUpdate(inputs, keras.layers.Dense(3)(h))

    reference = sequence_model()
    reference.compile(OPTIMIZERS[optimizer](), LOSS, metrics=[metric()])
    expected = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    model = sequence_model()
    model.compile(OPTIMIZERS[optimizer](), LOSS, metrics=[metric()])
    config = {"cluster.virtual_devices": 2, "communication.timeout_seconds": 60}
    got = epl.EPLTrainer(model, config=config).fit(
        x, y, batch_size=16, epochs=2, shuffle=False, verbose=0
    )
    assert _max_difference(reference.get_weights(), model.get_weights()) < ATOL
    for name in expected:
        np.testing.assert_allclose(got.history[name], expected[name], rtol=1e-5, atol=1e-6)


def test_the_default_step_would_have_trained_another_model():
    """The halved step differs measurably from Keras's default (the test above can fail)."""
    x, y = _data()
    halved, plain = _model(HalvedGradients), _model(keras.Model)
    for model in (halved, plain):
        model.compile(keras.optimizers.SGD(0.1), LOSS)
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert _max_difference(halved.get_weights(), plain.get_weights()) > 1e-2


def test_uneven_lanes_weigh_their_rows():
    """An odd batch (9 rows over 2 lanes: 4 and 5) still gives the one-device step: each
    lane's gradient counts by its rows."""
    reference, model, _, _ = _fit_both(HalvedGradients, "sgd", batch_size=9, epochs=1, n=27)
    assert _max_difference(reference.get_weights(), model.get_weights()) < ATOL


def test_batchnorm_statistics_are_averaged_over_lanes():
    """Moving statistics of each lane's rows, averaged after the step: after one step equal
    to one device for the moving mean (a mean of equal-sized lanes' means). Later steps
    normalise each lane by its own rows' statistics (no synchronized BatchNorm), so the
    weights part from one device's."""
    reference, model, _, _ = _fit_both(HalvedGradients, "sgd", epochs=1, n=16, batchnorm=True)
    mean = next(v for v in model.non_trainable_variables if "moving_mean" in v.path)
    expected = next(v for v in reference.non_trainable_variables if "moving_mean" in v.path)
    np.testing.assert_allclose(mean.numpy(), expected.numpy(), atol=1e-6)


def test_validation_with_compiled_metrics_and_the_models_own_loss_logs_as_keras():
    """Its own compute_loss, compiled metrics, validation_data: the evaluation's batch logs
    hold the compiled metrics' items, as Keras's (before: TypeError, their result is a
    dict that the batch logs took for one value)."""
    x, y = _data(48)
    validation = _data(16, seed=1)

    def fit(trainer_of):
        model = _model(L2Loss)
        model.compile(OPTIMIZERS["sgd"](), LOSS, metrics=["accuracy"])
        batch_logs = []
        seen = keras.callbacks.LambdaCallback(
            on_test_batch_end=lambda _, logs: batch_logs.append(dict(logs))
        )
        history = trainer_of(model).fit(
            x, y, batch_size=16, validation_data=validation, callbacks=[seen], shuffle=False,
            verbose=0,
        )  # fmt: skip
        return history.history, batch_logs

    expected, expected_logs = fit(lambda model: model)
    got, got_logs = fit(lambda model: epl.EPLTrainer(model, config={"cluster.virtual_devices": 2}))
    assert sorted(got) == sorted(expected)
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=0, atol=ATOL)
    assert [sorted(logs) for logs in got_logs] == [sorted(logs) for logs in expected_logs]
    for key in expected_logs[-1]:
        np.testing.assert_allclose(got_logs[-1][key], expected_logs[-1][key], rtol=0, atol=ATOL)


def test_own_test_step_and_predict_step():
    x, y = _data()
    reference = _model(OwnTestAndPredict)
    reference.compile(keras.optimizers.SGD(0.1), LOSS)
    model = _model(OwnTestAndPredict)
    model.compile(keras.optimizers.SGD(0.1), LOSS)
    trainer = epl.EPLTrainer(model, config={"cluster.virtual_devices": 2})
    expected = reference.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    got = trainer.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    assert set(got) == {"doubled_loss"}
    np.testing.assert_allclose(got["doubled_loss"], expected["doubled_loss"], rtol=1e-5)
    np.testing.assert_allclose(
        trainer.predict(x, batch_size=16, verbose=0),
        reference.predict(x, batch_size=16, verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )


class GAN(keras.Model):
    """Two optimizers of its own, the second step reading the first's update (the
    pattern of Keras's GAN example, on a toy regression)."""

    def __init__(self, generator, critic):
        super().__init__()
        self.generator, self.critic = generator, critic

    def compile(self, g_optimizer, c_optimizer):
        super().compile()
        self.g_optimizer, self.c_optimizer = g_optimizer, c_optimizer
        self.c_loss = keras.metrics.Mean(name="c_loss")
        self.g_loss = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.c_loss, self.g_loss]

    def call(self, x):
        return self.critic(self.generator(x))

    def train_step(self, data):
        noise, real = data
        with tf.GradientTape() as tape:
            fake = self.generator(noise)
            c_loss = tf.reduce_mean(self.critic(fake)) - tf.reduce_mean(self.critic(real))
        grads = tape.gradient(c_loss, self.critic.trainable_variables)
        self.c_optimizer.apply_gradients(zip(grads, self.critic.trainable_variables))
        with tf.GradientTape() as tape:
            g_loss = -tf.reduce_mean(self.critic(self.generator(noise)))
        grads = tape.gradient(g_loss, self.generator.trainable_variables)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_variables))
        self.c_loss.update_state(c_loss)
        self.g_loss.update_state(g_loss)
        return {"c_loss": self.c_loss.result(), "g_loss": self.g_loss.result()}


def _gan(optimizer):
    keras.utils.set_random_seed(3)
    generator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="tanh")])
    critic = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    gan = GAN(generator, critic)
    gan.compile(OPTIMIZERS[optimizer](), OPTIMIZERS[optimizer]())
    return gan


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_gan_with_two_optimizers(optimizer):
    rng = np.random.default_rng(2)
    noise = rng.normal(size=(32, 4)).astype("float32")
    real = rng.normal(size=(32, 6)).astype("float32")
    reference = _gan(optimizer)
    expected = reference.fit(noise, real, batch_size=8, epochs=2, shuffle=False, verbose=0)
    gan = _gan(optimizer)
    trainer = epl.EPLTrainer(gan, config={"cluster.virtual_devices": 2})
    got = trainer.fit(noise, real, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert _max_difference(reference.get_weights(), gan.get_weights()) < ATOL
    for name in ("c_loss", "g_loss"):
        np.testing.assert_allclose(got.history[name], expected.history[name], atol=1e-6)
    assert int(gan.c_optimizer.iterations) == int(gan.g_optimizer.iterations) == 8


@pytest.mark.parametrize(
    "config, match",
    [
        ({"pipeline.num_micro_batch": 2}, "pipeline.num_micro_batch=2"),
        ({"zero.level": "v1"}, "zero.level='v1'"),
        ({"gradient_checkpoint.type": "auto"}, "gradient_checkpoint.type='auto'"),
    ],
)
def test_layouts_that_cannot_run_the_users_step_are_refused(config, match):
    model = _model(HalvedGradients)
    model.compile(keras.optimizers.SGD(0.1), LOSS)
    with pytest.raises(ValueError, match=rf"overrides train_step.*{match}"):
        epl.EPLTrainer(model, config={"cluster.virtual_devices": 2, **config})


def test_pipeline_stages_are_refused_by_name():
    model = _model(L2Loss)
    model.compile(keras.optimizers.SGD(0.1), LOSS)
    first, second = model.layers[1].name, model.layers[2].name
    with pytest.raises(ValueError, match=r"overrides compute_loss.*2 pipeline stages"):
        epl.EPLTrainer(
            model,
            stages={first: 0, second: 1},
            config={"cluster.virtual_devices": 2},
        )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_models_own_step_across_two_workers(tmp_path):
    """2 workers x 2 devices (4 lanes), each worker's 8-row batches: the user's step on
    the 16-row global batch, as Keras runs it on one device (SGD and Adam)."""
    import os
    import sys

    from _launch import SCRIPTS, run_launch

    sys.path.insert(0, SCRIPTS)
    import train_dp
    import train_user_step as script

    result = run_launch(os.path.join(SCRIPTS, "train_user_step.py"), tmp_path, 2, 2, timeout=280)
    assert result.returncode == 0, result.stdout + result.stderr
    x, y = train_dp.make_data()

    def keras_fit(reference, optimizer):
        """Keras on one device, on the global batches the workers shared."""
        reference.compile(optimizer, LOSS)
        return reference.fit(
            x, y, batch_size=2 * script.PER_WORKER_BATCH, steps_per_epoch=script.STEPS,
            shuffle=False, verbose=0,
        )  # fmt: skip

    for name, (cls, rate) in script.OPTIMIZERS.items():
        reference = script.halved_gradients_model()
        history = keras_fit(reference, getattr(keras.optimizers, cls)(rate))
        for worker in range(2):
            saved = np.load(tmp_path / "out" / f"worker_{worker}.npz")
            for i, value in enumerate(reference.get_weights()):
                np.testing.assert_allclose(saved[f"{name}_{i}"], value, atol=1e-5)
            # The epoch's loss: the model's metric summed over both workers' lanes.
            np.testing.assert_allclose(saved[f"{name}_loss"], history.history["loss"], rtol=1e-5)
    # A loss tensor the step returns (no metric): the global batch's on both workers, as
    # Keras logs it (before: each worker logged its own rows' loss times its share of the
    # job's rows, 0.997 on one worker where Keras logged 2.110).
    history = keras_fit(script.loss_tensor_model(), keras.optimizers.SGD(0.1))
    for worker in range(2):
        saved = np.load(tmp_path / "out" / f"worker_{worker}.npz")
        np.testing.assert_allclose(saved["step_loss"], history.history["step_loss"], rtol=1e-5)


def _distiller(optimizer):
    """Keras's own `keras.distillation.Distiller` (its compute_loss adds the distillation
    loss against a frozen teacher): a model with its own step that we did not write."""
    keras.utils.set_random_seed(8)
    teacher = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(32, "relu"), keras.layers.Dense(3)]
    )
    student = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8, "relu"), keras.layers.Dense(3)]
    )
    distiller = keras.distillation.Distiller(
        teacher=teacher,
        student=student,
        distillation_losses=keras.distillation.LogitsDistillation(temperature=3.0),
        student_loss_weight=0.5,
    )
    distiller.compile(OPTIMIZERS[optimizer](), LOSS, metrics=["accuracy"])
    return distiller


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_keras_distiller_trains_as_in_keras(optimizer):
    x, y = _data()
    reference = _distiller(optimizer)
    expected = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    distiller = _distiller(optimizer)
    trainer = epl.EPLTrainer(distiller, config={"cluster.virtual_devices": 2})
    got = trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    assert _max_difference(reference.student.get_weights(), distiller.student.get_weights()) < ATOL
    assert _max_difference(reference.teacher.get_weights(), distiller.teacher.get_weights()) == 0
    assert set(got) == set(expected)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6)


def test_the_trainers_loss_and_optimizer_become_the_models_compile():
    """An uncompiled model with its own compute_loss, given its loss, optimizer and
    metrics through EPLTrainer: its step reads them as if compile() had been called."""
    x, y = _data()
    reference = _model(L2Loss)
    reference.compile(keras.optimizers.SGD(0.1), LOSS, metrics=["accuracy"])
    expected = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    model = _model(L2Loss)
    trainer = epl.EPLTrainer(
        model, LOSS, keras.optimizers.SGD(0.1), metrics=["accuracy"],
        config={"cluster.virtual_devices": 2},
    )  # fmt: skip
    got = trainer.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    assert model.optimizer is trainer.optimizer
    assert _max_difference(reference.get_weights(), model.get_weights()) < ATOL
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6)
