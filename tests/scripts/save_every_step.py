"""A job that saves a checkpoint after every step, for the kill sweep (test_kill_sweep.py).

Usage: save_every_step.py OUTPUT_DIR [--async_save] [--epochs E] [--keep_max M]

Trains train_ft's MLP with Adam on one device; `checkpoint.dir` is OUTPUT_DIR/ckpt with
`save_steps=1`, so a second run of the same command resumes the first. Prints `READY` once
the first step is done (the test kills it at a random moment after that) and writes
OUTPUT_DIR/weights.npz when the job is finished.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np
import train_ft

import epl_trainer as epl


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--async_save", action="store_true")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--keep_max", type=int, default=2)
    args = parser.parse_args()

    import keras

    class Ready(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if not getattr(self, "said", False):
                print("READY", flush=True)
                self.said = True

    config = {
        "cluster.virtual_devices": 1,
        "checkpoint.dir": os.path.join(args.out, "ckpt"),
        "checkpoint.save_steps": 1,
        "checkpoint.keep_max": args.keep_max,
        "checkpoint.async_save": args.async_save,
    }
    model = train_ft.make_model()
    trainer = epl.EPLTrainer(
        model,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.Adam(0.01),
        config=config,
    )
    x, y = train_ft.make_data()
    ids = np.arange(len(x), dtype="int64")
    trainer.fit(
        {"x": x, "id": ids},
        y,
        batch_size=train_ft.GLOBAL_BATCH,
        epochs=args.epochs,
        shuffle=False,
        verbose=0,
        callbacks=[Ready()],
    )
    np.savez(os.path.join(args.out, "weights.npz"), *model.get_weights())


if __name__ == "__main__":
    main()
