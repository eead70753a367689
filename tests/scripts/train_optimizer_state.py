"""Worker script: after `fit`, every worker's Keras model's optimizer holds the whole
trained optimizer state, also where parts of it live only on other workers (ZeRO shards
over the workers, pipeline stages on different workers: master_state.py's exchange).

Run under `epl-launch`. Usage:
  train_optimizer_state.py OUTPUT_DIR RUN [RUN ...]
RUNS names the runs, a trainer each, in turn in the same job. Worker w writes
OUTPUT_DIR/optimizer_<run>_<w>.npz: its model optimizer's variables, in order.
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))

import numpy as np
import train_span

import epl_trainer as epl

STEPS = 3
# run -> (its config keys, its stage count): ZeRO v1 shards every slot over the two
# workers; two stages put each stage's slots on one worker.
RUNS = {
    "zero_v1_over_workers": ({"zero.level": "v1"}, 1),
    "stages_on_two_workers": ({"pipeline.num_micro_batch": 2}, 2),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("runs", nargs="+", choices=sorted(RUNS))
    args = parser.parse_args()
    env = epl.init({"communication.timeout_seconds": 60.0})
    import keras

    os.makedirs(args.output_dir, exist_ok=True)
    x, y = train_span.make_data()
    for run in args.runs:
        config, stages = RUNS[run]
        trainer = epl.EPLTrainer(
            train_span.make_model(),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            train_span.make_optimizer("adam"),
            stages=train_span.STAGE_MAPS[stages],
            config=config,
        )
        trainer.fit(
            x,
            y,
            batch_size=train_span.GLOBAL_BATCH // trainer.data_shards,
            steps_per_epoch=STEPS,
            verbose=0,
            shuffle=False,
        )
        values = [v.numpy() for v in trainer.model.optimizer.variables]
        name = f"optimizer_{run}_{env.cluster.worker_index}.npz"
        np.savez(os.path.join(args.output_dir, name), *values)


if __name__ == "__main__":
    main()
