"""Worker script for test_on_batch.py: train_on_batch / test_on_batch / predict_on_batch
with each worker passing its own batch.

Run under `epl-launch` with 2 workers. Usage: train_on_batch.py OUTPUT_DIR
Global batch i is ROWS[i] rows of train_dp's data; worker 0 passes the first
WORKER_0_ROWS[i] of them, worker 1 the rest (uneven: the loss is the mean over the
global batch's rows, which the workers agree on). Worker w writes OUTPUT_DIR/worker_<w>.npz:
its weights after the steps, the returned train and test losses, its predictions.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
sys.path.insert(1, os.path.dirname(__file__))

import numpy as np
import train_dp

import epl_trainer as epl

ROWS = (16, 15, 17)
WORKER_0_ROWS = (8, 9, 6)


def global_rows(step: int) -> slice:
    """Rows of the data in the global batch of `step`."""
    return slice(sum(ROWS[:step]), sum(ROWS[: step + 1]))


def worker_rows(step: int, worker: int) -> slice:
    """Rows of the data that `worker` passes at `step`."""
    rows = global_rows(step)
    cut = rows.start + WORKER_0_ROWS[step]
    return slice(rows.start, cut) if worker == 0 else slice(cut, rows.stop)


def main():
    env = epl.init({"communication.timeout_seconds": 60})
    import keras

    worker = env.cluster.worker_index
    model = train_dp.make_model()
    trainer = epl.EPLTrainer(
        model,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.Adam(0.01),
    )
    x, y = train_dp.make_data()
    losses = [trainer.train_on_batch(x[r], y[r]) for r in map(worker_rows, range(3), [worker] * 3)]
    tested = trainer.test_on_batch(x[worker_rows(2, worker)], y[worker_rows(2, worker)])
    predictions = trainer.predict_on_batch(x[worker_rows(0, worker)])
    os.makedirs(sys.argv[1], exist_ok=True)
    np.savez(
        os.path.join(sys.argv[1], f"worker_{worker}.npz"),
        *model.get_weights(),
        losses=np.array(losses),
        tested=np.array(tested),
        predictions=predictions,
    )
    print(f"worker {worker} steps={int(trainer.optimizer.iterations)}", flush=True)


if __name__ == "__main__":
    main()
