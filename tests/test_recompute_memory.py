"""Gradient checkpointing under data parallelism holds about one recomputed segment per
running replica, however many segments the stage has (core/engine/recompute.py).

A segment's recompute waits for its upstream gradient; nothing waited for the weight
gradients of the segments after it until the reduction after the whole backward. With
two replicas on two inter-op threads, TensorFlow's executor followed each replica's
input-gradient chain and ran the ops only weight gradients need (the FFN's
`BiasAddGrad`, the attention's weight matmuls, the normalisations' sums) after it, so
every segment's activation-sized gradients stayed alive until then: a profile of the
4-layer transformer of `bench/plan_accuracy.py` row 7 freed three later segments' FFN
buffers (2.1 MB each per replica) only after the first segment's backward, and the step
peaked at 114.9 MB (estimate 85.7). The recompute of segment b now also waits for
segment b + 1's weight gradients: 81.6 MB.

Here the same pre-LN blocks, 2 and 6 of them (a segment each), on 16 rows per replica:
4 more blocks added 19.9-21.4 MB to the step's peak before (36.1 -> 56.0 MB), 12.7 with
oneDNN off, and 4.5-5.0 MB after (33.7 -> 38.3), oneDNN on or off: their boundaries and
weight gradients. The peak is the process's
allocator's (on CPU the logical devices share it), above the memory held before the
step, the median of a few steps, in a fresh process with the threads the trainer gives
2 devices on 2 cores (one per op), whatever the machine.
"""

import json
import sys

import pytest
from _memory import median_step_peak, run_fresh

WIDTH, FFN, LENGTH, ROWS = 128, 512, 64, 16  # ROWS per replica
REPLICAS = 2


def _model(blocks: int):
    """Pre-LN transformer blocks on float inputs (the transformer of bench/plan_accuracy.py
    without its embedding)."""
    import keras

    keras.utils.set_random_seed(0)
    inputs = keras.Input((LENGTH, WIDTH))
    h = inputs
    for i in range(blocks):
        a = keras.layers.LayerNormalization(name=f"ln_a{i}")(h)
        a = keras.layers.MultiHeadAttention(4, WIDTH // 4, name=f"attn{i}")(a, a)
        h = keras.layers.Add(name=f"res_a{i}")([h, a])
        f = keras.layers.LayerNormalization(name=f"ln_f{i}")(h)
        f = keras.layers.Dense(FFN, activation="gelu", name=f"up{i}")(f)
        f = keras.layers.Dense(WIDTH, name=f"down{i}")(f)
        h = keras.layers.Add(name=f"res_f{i}")([h, f])
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(inputs, keras.layers.Dense(8, name="head")(h))


def _step_peak(blocks: int, steps: int = 5) -> int:
    """Median peak bytes of a dp-2 checkpointed step above the memory held before it."""
    import keras
    import numpy as np

    import epl_trainer as epl

    trainer = epl.EPLTrainer(
        _model(blocks),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.optimizers.SGD(0.01),
        config={"cluster.virtual_devices": REPLICAS, "gradient_checkpoint.type": "auto"},
        jit_compile=False,  # plain ops: the executor's order is what is measured
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS * REPLICAS, LENGTH, WIDTH)).astype("float32")
    y = rng.integers(0, 8, ROWS * REPLICAS).astype("int32")
    trainer.train_on_batch(x, y)  # trace and build
    assert len(trainer.engine.recomputed[0].segments) >= blocks  # a segment per block
    return median_step_peak(trainer, x, y, steps)


@pytest.mark.slow
@pytest.mark.onednn
def test_checkpointed_data_parallel_peak_does_not_grow_by_a_segment_per_block():
    few, many = run_fresh(__file__, 2), run_fresh(__file__, 6)
    ffn_bytes = ROWS * LENGTH * FFN * 4  # one FFN activation (or its gradient), one replica
    print(
        f"\nstep peak {few / 1e6:.1f} MB (2 blocks), {many / 1e6:.1f} MB (6 blocks); "
        f"one FFN activation per replica {ffn_bytes / 1e6:.1f} MB"
    )
    # Four more blocks add their boundaries and weight gradients; before, each also held
    # its FFN-sized gradients until after the backward, in both replicas (12.7-21.4 MB). Less
    # than one FFN activation per added block, counted once, separates the two.
    assert many - few < 4 * ffn_bytes


if __name__ == "__main__":
    from epl_trainer.runtime.cluster import configure_tensorflow

    # What the trainer gives 2 devices on 2 cores (`runtime/cluster.build_cluster`: cores
    # // devices threads per op), on any machine: each inter-op thread runs one replica.
    configure_tensorflow(REPLICAS, intra_op_threads=1, inter_op_threads=REPLICAS)
    print(json.dumps(_step_peak(int(sys.argv[1]))))
