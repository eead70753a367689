"""Worker script for test_user_steps.py: a model's own train_step across workers.

Run under `epl-launch`. Usage: train_user_step.py OUTPUT_DIR
Each worker trains train_dp's model as a `HalvedGradients` model (its own train_step),
once with SGD and once with Adam, on its 8-row batches of train_dp's data (the global
batch is the workers' batches together), and writes OUTPUT_DIR/worker_<w>.npz: the
weights after each run and each run's epoch losses; then, with SGD, as a model whose
train_step logs its loss tensor (`step_loss`: the epoch's logged value).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
sys.path.insert(1, os.path.dirname(__file__))

import numpy as np
import train_dp

import epl_trainer as epl

PER_WORKER_BATCH, STEPS = 8, 3


def halved_gradients_model():
    """train_dp's model with a train_step of its own (the gradients halved)."""
    return train_dp.with_own_step(train_dp.make_model())


def loss_tensor_model():
    """train_dp's model with a train_step of its own that logs the step's loss tensor (no
    metric): Keras's fit logs the last batch's loss, the global batch's."""
    import keras
    import tensorflow as tf

    class LogsLossTensor(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return {"step_loss": loss}

    model = train_dp.make_model()
    return LogsLossTensor(model.inputs, model.outputs)


OPTIMIZERS = {"sgd": ("SGD", 0.1), "adam": ("Adam", 0.01)}


def main():
    env = epl.init({"communication.timeout_seconds": 60, "io.auto_shard": "off"})
    import keras

    worker = env.cluster.worker_index
    x, y = train_dp.make_data()
    saved = {}
    for name, (cls, rate) in OPTIMIZERS.items():
        model = halved_gradients_model()
        model.compile(
            getattr(keras.optimizers, cls)(rate),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        trainer = epl.EPLTrainer(model)
        history = trainer.fit(
            x, y, batch_size=PER_WORKER_BATCH, steps_per_epoch=STEPS, shuffle=False, verbose=0
        )
        for i, value in enumerate(model.get_weights()):
            saved[f"{name}_{i}"] = value
        saved[f"{name}_loss"] = np.array(history.history["loss"])
    model = loss_tensor_model()
    model.compile(
        keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    history = epl.EPLTrainer(model).fit(
        x, y, batch_size=PER_WORKER_BATCH, steps_per_epoch=STEPS, shuffle=False, verbose=0
    )
    saved["step_loss"] = np.array(history.history["step_loss"])
    os.makedirs(sys.argv[1], exist_ok=True)
    np.savez(os.path.join(sys.argv[1], f"worker_{worker}.npz"), **saved)
    print(f"worker {worker} done", flush=True)


if __name__ == "__main__":
    main()
