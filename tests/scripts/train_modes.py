"""Worker script of tests/test_feature_modes.py: one job of 2 workers x 2 devices trains
several trainers in turn, each with a set of features switched on in a multi-worker mode.

Run under `epl-launch` (TF_CONFIG set). Usage:
  train_modes.py OUTPUT_DIR RUN [RUN ...]
RUNS names the runs: `layout` "multi_worker" is data parallelism over the 4 devices of
both workers (2 replicas per worker, the gradients all-reduced across the workers);
"stages_across_workers" is 2 replicas of a 2-stage pipeline, each with stage 0 on worker
0 and stage 1 on worker 1 (cluster.device_place_prefer_intra_node=False). Worker w writes
OUTPUT_DIR/<run>_<w>.npz, its Keras model's weights after `fit`, and prints what
its engine ran (`summary`).
"""

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
sys.path.insert(1, os.path.dirname(__file__))

import numpy as np

import epl_trainer as epl

GLOBAL_BATCH, STEPS = 16, 4
STAGES = {"dense_a|dense_b": 0, "norm|join|logits": 1}
AMP = {"amp.level": "O1", "amp.dtype": "float16"}
# Each run: its layout, config keys, trainer arguments and whether the optimizer keeps
# moving averages (use_ema). Settings that do not combine (rules.REFUSALS: EMA with ZeRO,
# jit_compile with gradient checkpointing) are in different runs.
RUNS = {
    "mw_zero_v0_recompute_amp": dict(
        layout="multi_worker",
        config={"zero.level": "v0", "gradient_checkpoint.type": "auto", **AMP},
        steps_per_execution=2,
    ),
    "mw_jit_ema": dict(layout="multi_worker", jit_compile=True, ema=True, steps_per_execution=2),
    "saw_zero_v2_amp": dict(
        layout="stages_across_workers", config={"zero.level": "v2", **AMP}, steps_per_execution=2
    ),
    "saw_zero_v0_jit": dict(
        layout="stages_across_workers",
        config={"zero.level": "v0"},
        jit_compile=True,
        steps_per_execution=2,
    ),
    "saw_ema_jit": dict(
        layout="stages_across_workers", jit_compile=True, ema=True, steps_per_execution=2
    ),
}


def make_optimizer(ema: bool):
    import keras

    # Momentum gives ZeRO a slot to shard.
    return keras.optimizers.SGD(0.1, momentum=0.9, use_ema=ema, ema_momentum=0.9)


def make_trainer(run: str, model, devices=None):
    """The trainer of `run` (on `devices` virtual devices of one process if given: the
    single-process reference of the same settings)."""
    import keras

    spec = RUNS[run]
    config = {"pipeline.num_micro_batch": 2, **spec.get("config", {})}
    staged = spec["layout"] == "stages_across_workers"
    if staged:
        config["cluster.device_place_prefer_intra_node"] = False
    if devices is not None:
        config["cluster.virtual_devices"] = devices
    return epl.EPLTrainer(
        model,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        make_optimizer(spec.get("ema", False)),
        stages=STAGES if staged else None,
        config=config,
        jit_compile=spec.get("jit_compile", False),
        steps_per_execution=spec.get("steps_per_execution", 1),
    )


def summary(trainer) -> str:
    """What the trainer's engine runs: the data shards, whether XLA compiles the stages
    (builder.py wraps their calls), the recomputed stages and the update's kind."""
    program = trainer.engine.program
    calls = program.hooks.stage_calls
    compiled = all(c.__qualname__.startswith("compiled_stage_call") for c in calls)
    return (
        f"data_shards={trainer.data_shards} compiled={compiled} "
        f"recomputed={sorted(program.recomputed)} update={type(program.update.inner).__name__}"
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir")
    parser.add_argument("runs", nargs="+", choices=sorted(RUNS))
    args = parser.parse_args()
    cluster = epl.init({"communication.timeout_seconds": 60}).cluster
    import train_span  # tests/scripts: the model with a skip connection across the stages

    os.makedirs(args.output_dir, exist_ok=True)
    x, y = train_span.make_data()
    for run in args.runs:
        trainer = make_trainer(run, train_span.make_model())
        trainer.fit(
            x,
            y,
            batch_size=GLOBAL_BATCH // trainer.data_shards,
            epochs=1,
            steps_per_epoch=STEPS,
            verbose=0,
            shuffle=False,
        )
        path = os.path.join(args.output_dir, f"{run}_{cluster.worker_index}.npz")
        np.savez(path, *trainer.model.get_weights())
        print(f"worker {cluster.worker_index} {run} {summary(trainer)}", flush=True)


if __name__ == "__main__":
    main()
