"""Worker script: a tiny KerasHub Llama with its own layout map on the job's mesh.

Run under `epl-launch` with 2 workers of 2 devices. Usage:
  train_kerashub_mesh.py OUTPUT_DIR
The mesh is (workers, 2) over every worker's devices (Keras's `list_devices()`), so the
map's blocks over the batch axis sit on different workers and its decoder blocks compute
tensor parallel within each worker. Trains 4 steps of a global batch of 8 sequences with
Adam; worker w writes OUTPUT_DIR/weights_<w>.npz.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))

import numpy as np

import epl_trainer as epl


def make_llama():
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=64,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=16,
        intermediate_dim=64,
    )
    return keras_hub.models.LlamaCausalLM(backbone, preprocessor=None)


def make_data(rows=32, length=8, vocabulary=64):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, vocabulary, (rows, length + 1)).astype("int32")
    features = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((rows, length), bool)}
    return features, tokens[:, 1:]


def main():
    output_dir = sys.argv[1]
    env = epl.init({})
    import keras
    import keras_hub

    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((len(devices) // 2, 2), ["batch", "model"], devices)
    layout_map = keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    trainer = epl.EPLTrainer(
        make_llama(),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.Adam(0.01),
        strategy=keras.distribution.ModelParallel(layout_map=layout_map),
    )
    x, y = make_data()
    cluster = env.cluster
    trainer.fit(x, y, batch_size=8 // cluster.worker_num, shuffle=False, verbose=0)
    os.makedirs(output_dir, exist_ok=True)
    np.savez(
        os.path.join(output_dir, f"weights_{cluster.worker_index}.npz"),
        *trainer.model.get_weights(),
    )
    print(
        f"worker {cluster.worker_index} replicas={trainer.plan.num_replicas} "
        f"{trainer.plan.layouts_description}",
        flush=True,
    )


if __name__ == "__main__":
    main()
