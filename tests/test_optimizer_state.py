"""The model's optimizer is the one home of the optimizer state (update/master_state.py):
EPLTrainer starts from it and gives it back, so Keras -> EPLTrainer -> Keras trains as
Keras alone does.

Before, EPLTrainer started from fresh slots and never gave its own back: a model trained
one epoch by Keras, one by EPLTrainer, saved, loaded and trained one more by Keras ended
3.3e-2 from three Keras epochs with Adam, 2.7e-2 with SGD with momentum and a schedule
(data parallel and ZeRO v1 alike); a checkpoint of `ModelCheckpoint` held an optimizer
at step 0; with `use_ema=True` the weights ended 3.0e-2 off, and the user's optimizer was
never built; a mixed_float16 model restarted at Keras's initial loss scale (2**15 after
Keras had halved it to 2**14), and `model.save` lost its whole optimizer state (its
LossScaleOptimizer was replaced by the optimizer inside it: Keras skips loading it).
"""

import os
import sys

import keras
import numpy as np
import pytest
from _launch import SCRIPTS, run_launch
from _models import LOSS, mlp, mlp_data

import epl_trainer as epl

sys.path.insert(0, SCRIPTS)

ATOL = 1e-6
BATCH = 16


def _sgd():
    # A schedule: its position is the update count, which the engine takes from Keras.
    rate = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=3, decay_rate=0.5)
    return keras.optimizers.SGD(rate, momentum=0.9)


def _adam():
    return keras.optimizers.Adam(0.01)


def _ema_sgd():
    return keras.optimizers.SGD(0.1, momentum=0.9, use_ema=True, ema_momentum=0.9)


def _compiled(make_optimizer):
    model = mlp()
    model.compile(optimizer=make_optimizer(), loss=LOSS)
    return model


def _keras_fit(model, x, y, epochs=1, **kwargs):
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, **kwargs)


def _trainer(model, **config):
    return epl.EPLTrainer(model, config={"cluster.virtual_devices": 2, **config})


def _optimizer_values(optimizer) -> list[np.ndarray]:
    """Iterations, learning rate and every slot, in the optimizer's order (names differ
    between two optimizers of a process: "adam", "adam_1")."""
    return [np.asarray(v.numpy()) for v in optimizer.variables]


def _assert_same_state(expected_model, model, atol=ATOL):
    for a, b in zip(expected_model.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(b, a, atol=atol)
    expected = _optimizer_values(expected_model.optimizer)
    got = _optimizer_values(model.optimizer)
    assert len(got) == len(expected)
    for a, b in zip(expected, got):
        np.testing.assert_allclose(b, a, atol=atol)


@pytest.mark.parametrize("make_optimizer", [_sgd, _adam], ids=["sgd_momentum", "adam"])
@pytest.mark.parametrize(
    "config",
    [
        pytest.param({}, id="data_parallel"),
        pytest.param(
            {"zero.level": "v1"}, id="zero_v1", marks=pytest.mark.combines("zero_v1+data_parallel")
        ),
    ],
)
def test_keras_then_trainer_then_saved_and_keras_equals_keras(make_optimizer, config, tmp_path):
    x, y = mlp_data()
    reference = _compiled(make_optimizer)
    _keras_fit(reference, x, y, epochs=3)
    model = _compiled(make_optimizer)
    _keras_fit(model, x, y)
    trainer = _trainer(model, **config)
    trainer.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    if config:  # the slots were held in pieces: parts of variables on each device
        spans = trainer.engine.update.piece_spans().values()
        assert any(start is not None for _, _, start, _ in spans)
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    _keras_fit(loaded, x, y)
    _assert_same_state(reference, loaded)


def test_trainer_then_keras_in_the_same_process_equals_keras():
    """No save in between: the model's own optimizer holds the state after `fit`, and a
    second EPLTrainer `fit` starts from what Keras trained in between."""
    x, y = mlp_data()
    reference = _compiled(_adam)
    _keras_fit(reference, x, y, epochs=4)
    model = _compiled(_adam)
    trainer = _trainer(model)
    trainer.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    _keras_fit(model, x, y)
    trainer.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    _keras_fit(model, x, y)
    _assert_same_state(reference, model)


def test_a_new_trainer_on_a_model_another_trainer_trained_continues_its_optimizer():
    """A model never compiled gets its optimizer from the trainer (`model.optimizer`, the
    home of the state); a second EPLTrainer given no optimizer takes that one, here in
    another mode (2 stages of 2 micro-batches). Before, it took a fresh SGD(0.01): after
    the second epoch the weights were 3.6e-2 from two epochs of Keras's Adam, the
    optimizer held 2 variables instead of Adam's 10 and `iterations` was 4 instead of 8."""
    x, y = mlp_data()
    reference = _compiled(_adam)
    _keras_fit(reference, x, y, epochs=2)
    model = mlp()
    first = epl.EPLTrainer(model, LOSS, _adam(), config={"cluster.virtual_devices": 2})
    first.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    second = epl.EPLTrainer(
        model,
        LOSS,
        stages={"dense_in": 0, "logits": 1},
        config={"cluster.virtual_devices": 2, "pipeline.num_micro_batch": 2},
    )
    assert second.optimizer is first.optimizer
    second.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    _assert_same_state(reference, model)


def test_compiling_a_new_optimizer_after_fit_is_refused_and_a_new_trainer_follows_it():
    """`model.compile(optimizer=...)` between two fits of one trainer: Keras trains on with
    the new optimizer. Before, the trainer went on with its old one while the model held
    the new one (what callbacks set the learning rate of and `model.save` saves): the
    weights ended 3.9e-2 from Keras's and the model's optimizer was at iteration 0 after
    4 steps. Now that fit is refused by name, and a new EPLTrainer takes the new
    optimizer and trains as Keras does."""
    x, y = mlp_data()
    reference = _compiled(_adam)
    _keras_fit(reference, x, y)
    reference.compile(optimizer=_adam(), loss=LOSS)
    _keras_fit(reference, x, y)
    model = _compiled(_adam)
    trainer = _trainer(model)
    trainer.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    model.compile(optimizer=_adam(), loss=LOSS)
    for call in (
        lambda: trainer.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0),
        lambda: trainer.train_on_batch(x[:BATCH], y[:BATCH]),
    ):
        with pytest.raises(ValueError, match="not the one this EPLTrainer trains with"):
            call()
    assert int(model.optimizer.iterations.numpy()) == 0
    _trainer(model).fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    _assert_same_state(reference, model)


def test_a_layer_frozen_between_fits_is_refused_and_a_new_trainer_goes_on_as_keras():
    """Keras's fine-tuning step: freeze a layer, compile again with the same optimizer,
    fit on; Keras keeps the slots of the variables still trained. Before, the trainer's
    second fit went on training the frozen layer (weights 3.7e-2 from Keras with Adam,
    1.2e-1 with SGD with momentum); a new EPLTrainer trained only the others but took no
    slot from an optimizer built on more variables than the model now trains (a warning)
    and restarted them from zero (2.0e-2 from Keras, slots 1.5e-2). Now the first is
    refused by name and the second equals Keras."""
    x, y = mlp_data()

    def freeze(model):
        model.get_layer("dense_in").trainable = False
        model.compile(optimizer=model.optimizer, loss=LOSS)

    reference = _compiled(_adam)
    _keras_fit(reference, x, y)
    freeze(reference)
    _keras_fit(reference, x, y)
    model = _compiled(_adam)
    trainer = _trainer(model)
    trainer.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    freeze(model)
    with pytest.raises(ValueError, match="trainable variables changed"):
        trainer.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    _trainer(model).fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    _assert_same_state(reference, model)


def _twin_towers(seed=0):
    """Two nested models built by one function: their layers have the same names, so
    their variables the same paths ("fc/kernel" twice), and Keras names both momentum
    slots "fc_kernel_momentum" (T5's encoder and decoder attention-bias tables do too)."""
    keras.utils.set_random_seed(seed)

    def tower(name):
        inputs = keras.Input((6,))
        return keras.Model(inputs, keras.layers.Dense(3, name="fc")(inputs), name=name)

    inputs = keras.Input((6,), name="x")
    outputs = keras.layers.Add()([tower("left")(inputs), tower("right")(inputs)])
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=_sgd(), loss=LOSS)
    return model


def test_variables_sharing_a_path_take_and_give_back_their_own_slots():
    """Before, such slots were matched by name only, so neither went in or came back
    (a warning named them): the trainer restarted their momentum from zero and Keras
    continued from its stale one: weights 0.16 from Keras alone after three epochs."""
    x, y = mlp_data()
    reference = _twin_towers()
    paths = [v.path for v in reference.trainable_variables]
    assert paths == ["fc/kernel", "fc/bias"] * 2
    _keras_fit(reference, x, y, epochs=3)
    model = _twin_towers()
    _keras_fit(model, x, y)
    _trainer(model).fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    _keras_fit(model, x, y)
    _assert_same_state(reference, model)


@pytest.mark.parametrize("save_freq", ["epoch", 2])
def test_model_checkpoint_during_fit_saves_the_current_slots(save_freq, tmp_path):
    """ModelCheckpoint(save_weights_only=False) saves the model with its optimizer: at an
    epoch's end and after a step (`save_freq` in batches), the engine's state of then."""
    x, y = mlp_data()
    reference = _compiled(_adam)
    steps = 2 if save_freq == 2 else len(x) // BATCH
    _keras_fit(reference, x[: steps * BATCH], y[: steps * BATCH])
    model = _compiled(_adam)
    path = str(tmp_path / "ckpt-{epoch}.keras")
    if save_freq == 2:
        path = str(tmp_path / "ckpt-{epoch}-{batch}.keras")
    checkpoint = keras.callbacks.ModelCheckpoint(path, save_freq=save_freq)
    _trainer(model).fit(
        x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[checkpoint]
    )
    saved = path.format(epoch=1, batch=2)
    _assert_same_state(reference, keras.models.load_model(saved))


def test_backup_and_restore_resumes_with_the_optimizer_state(tmp_path):
    """BackupAndRestore saves with `save_weights`, which holds the optimizer's variables,
    and loads them when training begins: into the user's optimizer, which the trainer
    builds when it takes the model (as Keras's fit builds it first), and from there into
    the engine. Two epochs, then a new process's model resumes for the third."""
    x, y = mlp_data()
    reference = _compiled(_adam)
    _keras_fit(reference, x, y, epochs=3)
    backup = str(tmp_path / "backup")
    _trainer(_compiled(_adam)).fit(
        x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(backup, delete_checkpoint=False)],
    )  # fmt: skip
    resumed = _compiled(_adam)
    history = _trainer(resumed).fit(
        x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(backup)],
    )  # fmt: skip
    assert history.epoch == [2]
    _assert_same_state(reference, resumed)


def test_the_model_holds_the_dropout_seed_counters_and_a_new_trainer_continues_them():
    """The write-back gives the model's seed states the lanes' counters (each lane's seed
    offset taken off), and a trainer taking the model takes them (offset again): two
    trainers of one epoch each draw the masks one trainer of two epochs draws (before:
    the model's seed states stayed as built, [seed, 0], and the second trainer drew the
    first epoch's masks again: weights 3.9e-2 apart)."""
    x, y = mlp_data()

    def compiled():
        model = mlp(dropout=0.5)
        model.compile(optimizer=_adam(), loss=LOSS)
        return model

    def fit(model):
        _trainer(model).fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

    reference = compiled()
    _trainer(reference).fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    continued = compiled()
    fit(continued)
    fit(continued)
    _assert_same_state(reference, continued, atol=0)
    seeds = [[v.numpy() for v in m.non_trainable_variables] for m in (reference, continued)]
    np.testing.assert_array_equal(*seeds)
    assert seeds[0][0][1] == 2 * len(x) // BATCH  # the counter: one draw per step


@pytest.mark.combines("ema+data_parallel")
def test_use_ema_is_built_on_the_users_optimizer_and_holds_the_averages(tmp_path):
    """The user's optimizer gets its moving averages (built on the model's variables,
    holding the lanes' averages after fit), and Keras's fit continues from them: three
    one-epoch fits, the middle one EPLTrainer's, equal three of Keras's (each fit ends
    with the weights set to their averages)."""
    x, y = mlp_data()
    reference = _compiled(_ema_sgd)
    for _ in range(3):
        _keras_fit(reference, x, y)
    model = _compiled(_ema_sgd)
    _keras_fit(model, x, y)
    _trainer(model).fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    averages = model.optimizer._model_variables_moving_average
    assert len(averages) == len(model.trainable_variables)
    _keras_fit(model, x, y)
    _assert_same_state(reference, model)


def test_use_ema_on_a_fresh_optimizer_is_built_by_the_trainer():
    x, y = mlp_data()
    reference = _compiled(_ema_sgd)
    _keras_fit(reference, x, y)
    model = mlp()
    epl.EPLTrainer(model, LOSS, _ema_sgd(), config={"cluster.virtual_devices": 2}).fit(
        x, y, batch_size=BATCH, shuffle=False, verbose=0
    )
    assert model.optimizer.built
    for a, b in zip(
        reference.optimizer._model_variables_moving_average,
        model.optimizer._model_variables_moving_average,
        strict=True,
    ):
        np.testing.assert_allclose(b.numpy(), a.numpy(), atol=ATOL)


@pytest.fixture
def mixed_float16():
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    yield
    keras.config.set_dtype_policy(previous)


@pytest.mark.combines("amp+data_parallel")
def test_loss_scale_optimizer_state_goes_in_and_back(mixed_float16, tmp_path):
    """A mixed_float16 model's LossScaleOptimizer stays the model's optimizer: the engine
    starts from its loss scale (halved by Keras at an overflow) and counts on from its
    clean steps, and `model.save` keeps the scale and the slots."""
    x, y = mlp_data()
    model = _compiled(_adam)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    model.fit(x[:BATCH] * 1e5, y[:BATCH], batch_size=BATCH, verbose=0)  # overflows
    _keras_fit(model, x, y)  # 4 clean steps
    assert model.optimizer.dynamic_scale.numpy() == 2.0**14
    assert model.optimizer.step_counter.numpy() == 4
    trainer = _trainer(model)
    trainer.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert trainer.stats_history["loss_scale"] == [2.0**14]
    assert model.optimizer is not trainer.optimizer  # the wrapper around it
    assert model.optimizer.step_counter.numpy() == 8
    assert model.optimizer.iterations.numpy() == 8
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert isinstance(loaded.optimizer, keras.optimizers.LossScaleOptimizer)
    for a, b in zip(_optimizer_values(model.optimizer), _optimizer_values(loaded.optimizer)):
        np.testing.assert_array_equal(b, a)


@pytest.mark.combines("amp+data_parallel")
def test_a_loss_scale_optimizer_compiled_around_a_built_one_gets_the_loss_scale(mixed_float16):
    """Compiled again under mixed_float16 with its built optimizer, a model holds a new,
    unbuilt LossScaleOptimizer around it (as after freezing a layer). Before, the first
    write-back failed: AttributeError, 'LossScaleOptimizer' object has no attribute
    'dynamic_scale'. Now it is built as Keras's fit builds it and holds the scale."""
    x, y = mlp_data()
    model = _compiled(_adam)
    _keras_fit(model, x, y)
    model.compile(optimizer=model.optimizer.inner_optimizer, loss=LOSS)
    assert not model.optimizer.built and model.optimizer.inner_optimizer.built
    trainer = _trainer(model)
    trainer.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert model.optimizer.built
    assert model.optimizer.dynamic_scale.numpy() == trainer.stats_history["loss_scale"][-1]
    assert model.optimizer.iterations.numpy() == 8


@pytest.fixture(scope="module")
def workers_job(tmp_path_factory):
    """One job of 2 workers of one device (epl-launch) that trains each run of
    tests/scripts/train_optimizer_state.py in turn, a trainer each (one job, not one per
    run: the two took 15.8 s in the suite, most of it starting processes). Returns its
    output folder."""
    import train_optimizer_state as script

    tmp_path = tmp_path_factory.mktemp("optimizer_state")
    result = run_launch(os.path.join(SCRIPTS, "train_optimizer_state.py"), tmp_path, 2, 1,
                        *script.RUNS, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return tmp_path / "out"


@pytest.mark.slow
@pytest.mark.timeout(360)
@pytest.mark.parametrize(
    "run",
    [
        pytest.param("zero_v1_over_workers", marks=pytest.mark.combines("zero_v1+multi_worker")),
        pytest.param("stages_on_two_workers", marks=pytest.mark.combines("pipeline+multi_worker")),
    ],
)
def test_every_worker_holds_the_whole_state_where_parts_live_on_other_workers(workers_job, run):
    """2 workers of one device: ZeRO's shards of every slot, or each stage's slots, live
    on one worker only; after fit each worker's optimizer holds all of Keras's state."""
    import train_optimizer_state as script
    import train_span

    reference = train_span.make_model()
    reference.compile(train_span.make_optimizer("adam"), LOSS)
    rows = script.STEPS * train_span.GLOBAL_BATCH
    x, y = train_span.make_data()
    reference.fit(x[:rows], y[:rows], batch_size=train_span.GLOBAL_BATCH, shuffle=False, verbose=0)
    expected = _optimizer_values(reference.optimizer)
    for worker in range(2):
        saved = np.load(workers_job / f"optimizer_{run}_{worker}.npz")
        got = [saved[f"arr_{i}"] for i in range(len(saved.files))]
        assert len(got) == len(expected)
        for a, b in zip(expected, got):
            np.testing.assert_allclose(b, a, atol=1e-5)
