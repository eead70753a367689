"""DeepSpeed-style JSON configs for EPLTrainer.

`EPLTrainer(model, ..., config="ds_config.json")` recognises a DeepSpeed config and
translates it (see `translate.py` for the steps and docs/guides/deepspeed.md for the key table)
into data: config keys and descriptions of the optimizer, schedule and monitors, from
which the trainer builds the Keras objects (`training/deepspeed_run.py`). Pure Python:
this package imports nothing of ours above `config/`::

    from epl_trainer import deepspeed

    ds = deepspeed.DeepSpeedConfig("ds_config.json", total_num_steps=1000)
    trainer = epl.EPLTrainer(model, loss=..., optimizer=keras.optimizers.AdamW(3e-4), config=ds)
"""

from epl_trainer.deepspeed.batch import BatchSizes, resolve_batch_sizes
from epl_trainer.deepspeed.keys import DeepSpeedConfigError
from epl_trainer.deepspeed.setup import DeepSpeedSetup, TrainerOptimizer
from epl_trainer.deepspeed.translate import TOP_LEVEL_KEYS, DeepSpeedConfig, is_deepspeed_config

__all__ = [
    "TOP_LEVEL_KEYS",
    "BatchSizes",
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DeepSpeedSetup",
    "TrainerOptimizer",
    "is_deepspeed_config",
    "resolve_batch_sizes",
]
