"""Worker script for the multi-worker DeepSpeed-config test: trains with a DeepSpeed JSON.

Run under `epl-launch` (TF_CONFIG set). Usage: train_deepspeed.py DS_CONFIG OUTPUT_DIR
Worker w writes OUTPUT_DIR/weights_<w>.npz and its resolved batch sizes to batch_<w>.txt; the
config's monitors write where it says (only worker 0 should).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))

import numpy as np
from train_dp import make_data, make_model

import epl_trainer as epl


def main():
    ds_config, output_dir = sys.argv[1:3]
    cluster = epl.init().cluster
    import keras

    trainer = epl.EPLTrainer(
        make_model(),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        config=ds_config,
    )
    x, y = make_data()
    trainer.fit(
        x, y, epochs=1, steps_per_epoch=3, verbose=0, shuffle=False
    )  # batch from the config
    os.makedirs(output_dir, exist_ok=True)
    np.savez(
        os.path.join(output_dir, f"weights_{cluster.worker_index}.npz"),
        *trainer.model.get_weights(),
    )
    with open(os.path.join(output_dir, f"batch_{cluster.worker_index}.txt"), "w") as f:
        f.write(repr(trainer.deepspeed.batch))


if __name__ == "__main__":
    main()
