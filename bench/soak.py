"""Soak: steps/s, threads and resident memory over a long data-parallel run.

Usage: python bench/soak.py [--steps 50000] [--batch 16] [--devices 2] [--config JSON]

`--config` adds config keys to EPLTrainer's, e.g. '{"zero.level": "v1",
"pipeline.num_micro_batch": 2}' for a ZeRO soak, or '{"checkpoint.dir": "/tmp/soak",
"checkpoint.save_steps": 10, "checkpoint.async_save": true}' for asynchronous saves
every 10 steps (the checkpoint folder's contents are printed at the end).

One process. A small model trains `--steps` steps with EPLTrainer on `--devices`
logical CPU devices (data parallel), then the same number with plain Keras `fit`.
Threads (from /proc/self/task) and RSS are read after a 200-step warm-up and at the
end. Before the collective watchdog (epl_trainer/runtime/watchdog.py), every collective left a
timer thread alive for 600 s and a run like this one aborted at ~30,000 threads.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--config", default="{}", help="extra config keys, as JSON")
    args = parser.parse_args()
    extra = json.loads(args.config)

    from epl_trainer.runtime.cluster import configure_tensorflow

    configure_tensorflow(args.devices)
    import keras
    import numpy as np
    import tensorflow as tf

    import epl_trainer as epl
    from epl_trainer.training.memory import process_rss_mib as rss_mib
    from epl_trainer.training.memory import process_threads as threads

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def model():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(64, activation="relu")(inputs)
        return keras.Model(inputs, keras.layers.Dense(4)(hidden))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * 64, 16)).astype("float32")
    y = x[:, :4].argmax(axis=1).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).repeat()

    class Samples(keras.callbacks.Callback):
        """Threads and RSS at each fifth of the run: flat means no growth per step."""

        def __init__(self):
            super().__init__()
            self.taken = []

        def on_train_batch_end(self, batch, logs=None):
            if (batch + 1) % max(args.steps // 5, 1) == 0:
                self.taken.append((threads(), round(rss_mib())))

    def measure(name, fit):
        fit(200, [])  # warm-up: traces the step
        start = (threads(), rss_mib())
        samples = Samples()
        began = time.perf_counter()
        fit(args.steps, [samples])
        seconds = time.perf_counter() - began
        end = (threads(), rss_mib())
        return name, args.steps / seconds, start, end, samples.taken

    trainer = epl.EPLTrainer(
        model(),
        loss,
        keras.optimizers.Adam(1e-3),
        config={"cluster.virtual_devices": args.devices, **extra},
    )
    rows = [
        measure(
            f"EPLTrainer, {trainer.plan.num_replicas} replicas" + (" +config" if extra else ""),
            # The next epoch on every call: with checkpoint.dir each fit resumes from
            # the newest checkpoint, whose epoch count is fit's initial epoch.
            lambda n, callbacks: trainer.fit(
                data,
                steps_per_epoch=n,
                initial_epoch=trainer.epochs_done,
                epochs=trainer.epochs_done + 1,
                callbacks=callbacks,
                verbose=0,
            ),
        )
    ]
    folder = extra.get("checkpoint.dir")
    reference = model()
    reference.compile(keras.optimizers.Adam(1e-3), loss)
    rows.append(
        measure(
            "Keras fit, 1 device",
            lambda n, callbacks: reference.fit(
                data, steps_per_epoch=n, callbacks=callbacks, verbose=0
            ),
        )
    )

    print(f"\n{args.steps} steps of batch {args.batch} after a 200-step warm-up")
    print(f"{'run':<26} {'steps/s':>8} {'threads start':>14} {'threads end':>12} "
          f"{'RSS start MiB':>14} {'RSS end MiB':>12}")  # fmt: skip
    for name, rate, (t0, r0), (t1, r1), _ in rows:
        print(f"{name:<26} {rate:>8.0f} {t0:>14} {t1:>12} {r0:>14.1f} {r1:>12.1f}")
    print("\n(threads, RSS MiB) at each fifth of the run:")
    for name, *_, taken in rows:
        print(f"{name:<26} {taken}")
    if folder:
        every = extra.get("checkpoint.save_steps", 0)
        print(f"checkpoints every {every} steps; {folder} holds {sorted(os.listdir(folder))}")


if __name__ == "__main__":
    main()
