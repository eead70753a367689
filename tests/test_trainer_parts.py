"""The trainer's parts, each on its own (trainer.py is a facade over them).

The whole trainer is tested against Keras everywhere else; here each part's own
contract: what it owns, when it changes, and what it refuses. Small models on 2 logical
devices; the parts are reached through the trainer's attributes, as a user would.
"""

import types

import keras
import numpy as np
import pytest
import tensorflow as tf
from _models import LOSS, mlp, mlp_data

import epl_trainer as epl
from epl_trainer.training.progress import TrainingProgress
from epl_trainer.training.step_stats import StepStats

PARTS = {
    "context",
    "objectives",
    "planner",
    "runtime",
    "progress",
    "stats",
    "feeder",
    "checkpoints",
    "inference",
    "fit_loop",
    "on_batch",
}


def _trainer(model=None, **kwargs):
    config = {"cluster.virtual_devices": 2, **kwargs.pop("config", {})}
    model = mlp() if model is None else model
    return epl.EPLTrainer(model, kwargs.pop("loss", LOSS), "sgd", config=config, **kwargs)


def test_the_trainer_holds_its_parts_and_nothing_else():
    """State lives in a part: a new attribute on the facade fails here, so an implicit
    contract between files cannot grow back."""
    trainer = _trainer()
    assert set(vars(trainer)) == PARTS


# ---- TrainingProgress --------------------------------------------------------------------


def test_progress_takes_a_checkpoint_position_once():
    progress = TrainingProgress()
    assert progress.take_resume() == ((0, 0), False)
    progress.restored_from({"epochs_done": 3, "step_in_epoch": 5, "input_position": 7})
    assert (progress.epochs_done, progress.step_in_epoch) == (3, 5)
    assert progress.take_resume() == ((5, 7), True)
    assert progress.take_resume() == ((0, 0), False)  # consumed by the fit that began
    progress.end_epoch()
    assert (progress.epochs_done, progress.step_in_epoch, progress.input_position) == (4, 0, 0)


# ---- StepStats ---------------------------------------------------------------------------


def _stats(nonfinite_loss="error"):
    optimizer = keras.optimizers.SGD()
    config = types.SimpleNamespace(optimizer=types.SimpleNamespace(nonfinite_loss=nonfinite_loss))
    return StepStats(types.SimpleNamespace(optimizer=optimizer, config=config))


def test_step_stats_keep_the_trainers_values_out_of_the_logs():
    stats = _stats()
    results = {"loss": np.float32(0.5), "loss_scale": np.float32(128.0)}
    logs, own = stats.split(results, {"loss"})
    assert logs == {"loss": 0.5} and own == {"loss_scale": 128.0}
    # A model's own train_step: every result is a log.
    assert stats.split(results, None) == ({"loss": 0.5, "loss_scale": 128.0}, {})
    stats.record({"samples_per_sec": 10.0})
    stats.end_epoch()
    stats.record({"samples_per_sec": 20.0})
    stats.end_epoch()
    assert stats.history == {"samples_per_sec": [10.0, 20.0]}
    assert stats.last == {"samples_per_sec": 20.0}


@pytest.mark.parametrize("mode", ["error", "skip"])
def test_step_stats_name_a_new_nonfinite_step_once(mode, caplog):
    stats = _stats(mode)
    stats.record({"nonfinite_steps": 0})
    assert stats.nonfinite_step(0, 3) is None
    stats.record({"nonfinite_steps": 1})
    where = stats.nonfinite_step(1, 4)
    if mode == "error":
        assert where == "training step 0 (epoch 2, batch 4)"
    else:
        assert where is None and "Non-finite loss at training step 0" in caplog.text
    assert stats.nonfinite_step(1, 5) is None  # the same skipped step is not named again


# ---- ModelPlanner and Objectives ---------------------------------------------------------


def test_an_unbuilt_sequential_waits_for_data_and_is_planned_from_it():
    model = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    trainer = _trainer(model)
    assert trainer.planner.waits_for_data and trainer.engine_plan is None
    x, y = mlp_data(16)
    trainer.feeder.plan_from(x[:, :5], y, None, "train")
    assert not trainer.planner.waits_for_data
    assert trainer.model.built and trainer.plan.num_replicas == 2
    assert trainer.engine is None  # planned, not built: the engine waits for a batch


def test_objectives_refuse_to_train_without_a_loss_and_log_in_keras_order():
    trainer = _trainer(loss=None, metrics=["accuracy"])
    with pytest.raises(ValueError, match="needs a loss to fit: pass loss="):
        trainer.objectives.require_loss("fit")
    trainer = _trainer(metrics=["accuracy"])
    trainer.objectives.require_loss("fit")
    x, y = mlp_data(16)
    spec = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).element_spec
    trainer.objectives.build(spec)
    assert [name for name, _ in trainer.objectives.named()] == ["loss", "accuracy"]
    logs = {"accuracy": 0.25, "loss": 1.5}
    assert trainer.objectives.returned(logs, return_dict=False) == [1.5, 0.25]
    assert trainer.objectives.returned(logs, return_dict=True) is logs


# ---- EngineRuntime -----------------------------------------------------------------------


def test_the_runtime_builds_the_engine_once_and_keeps_the_model_in_step():
    trainer = _trainer()
    runtime = trainer.runtime
    with pytest.raises(ValueError, match="memory_report\\(\\) needs the engine"):
        runtime.memory_report()
    runtime.load_from_model()  # nothing to load into yet: no error
    x, y = mlp_data(16)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    engine = runtime.ensure_for(dataset)
    assert runtime.ensure(None) is engine and trainer.engine is engine
    # A set_weights on the Keras model reaches the engine at a load; the engine's values
    # reach the model at a write-back.
    zeros = [np.zeros_like(w) for w in trainer.model.get_weights()]
    trainer.model.set_weights(zeros)
    runtime.load_from_model()
    trainer.model.set_weights([np.ones_like(w) for w in zeros])
    runtime.write_back()
    assert all(np.all(w == 0) for w in trainer.model.get_weights())


def test_a_callback_hook_that_may_set_weights_runs_between_a_write_back_and_a_load():
    trainer = _trainer()
    x, y = mlp_data(16)
    trainer.runtime.ensure_for(tf.data.Dataset.from_tensor_slices((x, y)).batch(8))
    seen = {}

    class SetsWeights(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen["kernel"] = self.model.get_weights()[0].copy()
            self.model.set_weights([w * 0 for w in self.model.get_weights()])

    engine_kernel = trainer.engine.state.trainable[0][0].numpy()
    trainer.model.set_weights([w + 1 for w in trainer.model.get_weights()])  # stale model
    callbacks = keras.callbacks.CallbackList([SetsWeights()], model=trainer.model)
    trainer.runtime.run_hook(callbacks, "on_epoch_end", 0)
    np.testing.assert_array_equal(seen["kernel"], engine_kernel)  # written back before
    assert not np.any(trainer.engine.state.trainable[0][0].numpy())  # taken back after


# ---- DataFeeder --------------------------------------------------------------------------


def test_the_feeder_draws_the_shuffling_seed_once_and_deals_arrays_in_order():
    trainer = _trainer()
    x, y = mlp_data(16)
    assert trainer.feeder.shuffle_seed is None
    np.random.seed(0)
    seed = trainer.feeder.agreed_seed()
    np.random.seed(1)
    assert trainer.feeder.agreed_seed() == seed == trainer.feeder.shuffle_seed
    dataset, passes = trainer.feeder.fit_dataset(x, y, None, 4, shuffle=False)
    assert passes is None
    batches = [xb.numpy() for xb, _ in dataset]
    np.testing.assert_array_equal(np.concatenate(batches), x)
    with pytest.raises(ValueError, match='shuffle must be True, False or "batch"'):
        trainer.feeder.fit_dataset(x, y, None, 4, shuffle="rows")


# ---- CheckpointManager -------------------------------------------------------------------


def test_the_checkpoint_manager_saves_and_restores_the_progress(tmp_path):
    trainer = _trainer()
    with pytest.raises(ValueError, match="Nothing to save yet"):
        trainer.checkpoints.save(str(tmp_path))
    x, y = mlp_data(32)
    trainer.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    path = trainer.checkpoints.save(str(tmp_path))
    assert path.endswith("ckpt-8")
    other = _trainer()
    other.checkpoints.restore(str(tmp_path))
    assert other.progress.epochs_done == 2 and other.progress.restored
    for ours, theirs in zip(other.model.get_weights(), trainer.model.get_weights()):
        np.testing.assert_array_equal(ours, theirs)


# ---- InferenceRunner ---------------------------------------------------------------------


def test_inference_runs_batches_in_calls_with_the_batch_hooks_around_each():
    trainer = _trainer(steps_per_execution=3)
    calls = []

    class Hooks(keras.callbacks.Callback):
        def on_test_batch_begin(self, batch, logs=None):
            calls.append(("begin", batch))

        def on_test_batch_end(self, batch, logs=None):
            calls.append(("end", batch))

    callbacks = keras.callbacks.CallbackList([Hooks()], model=trainer.model)
    dataset = tf.data.Dataset.range(7).batch(1)
    ran = []

    def run_call(iterator, count):
        taken = len(list(iterator.__next__() for _ in range(min(count, 7 - sum(ran)))))
        ran.append(taken)
        return taken, {}

    seen = trainer.inference.run_in_calls(dataset, iter(dataset), 0, callbacks, "test", run_call)
    assert seen == 7 and ran == [3, 3, 1]  # steps_per_execution batches per call
    assert calls == [("begin", 0), ("end", 2), ("begin", 3), ("end", 5), ("begin", 6), ("end", 6)]


# ---- placement -------------------------------------------------------------------------


@pytest.mark.parametrize("zero", ["", "v2"])
def test_placement_is_each_devices_bytes_of_model_variables(zero):
    """Whole copies on each data-parallel device; under ZeRO v2 the pieces, half each."""
    trainer = _trainer(config={"zero.level": zero} if zero else {})
    with pytest.raises(ValueError, match="needs the engine"):
        trainer.placement()
    x, y = mlp_data(16)
    trainer.fit(x, y, batch_size=8, verbose=0)
    placement = trainer.placement()
    whole = sum(int(np.prod(v.shape)) * 4 for v in trainer.model.variables)
    assert len(placement) == 2
    if zero:
        assert sum(placement.values()) == whole
        assert all(abs(held - whole / 2) <= whole * 0.1 for held in placement.values())
    else:
        assert list(placement.values()) == [whole, whole]
