"""Worker script: after `fit`, every worker's Keras model's optimizer holds the whole
trained optimizer state, also where parts of it live only on other workers (ZeRO shards
over the workers, pipeline stages on different workers: master_state.py's exchange).

Run under `epl-launch`. Usage:
  train_optimizer_state.py OUTPUT_DIR [--zero v1] [--stages 2]
Worker w writes OUTPUT_DIR/optimizer_<w>.npz: its model optimizer's variables, in order.
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("--zero", default="", help="zero.level")
    parser.add_argument("--stages", type=int, default=1)
    args = parser.parse_args()
    config = {"communication.timeout_seconds": 60.0}
    if args.zero:
        config["zero.level"] = args.zero
    if args.stages > 1:
        config["pipeline.num_micro_batch"] = 2
    env = epl.init(config)
    import keras

    trainer = epl.EPLTrainer(
        train_span.make_model(),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        train_span.make_optimizer("adam"),
        stages=train_span.STAGE_MAPS[args.stages],
    )
    x, y = train_span.make_data()
    trainer.fit(
        x,
        y,
        batch_size=train_span.GLOBAL_BATCH // trainer.data_shards,
        steps_per_epoch=STEPS,
        verbose=0,
        shuffle=False,
    )
    os.makedirs(args.output_dir, exist_ok=True)
    values = [v.numpy() for v in trainer.model.optimizer.variables]
    np.savez(os.path.join(args.output_dir, f"optimizer_{env.cluster.worker_index}.npz"), *values)


if __name__ == "__main__":
    main()
