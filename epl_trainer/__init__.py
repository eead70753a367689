"""epl_trainer: EPL-style distributed training for TensorFlow 2 / Keras 3.

Imports are lazy so that light entry points (the `epl-launch` launcher, the config
module) start without loading TensorFlow.
"""

import importlib

from epl_trainer.runtime import onednn

onednn.choose_default()  # before TensorFlow loads: it reads the variable once

__version__ = "0.1.0"

_EXPORTS = {
    "Config": "epl_trainer.config.sections",
    "ConfigError": "epl_trainer.config.sections",
    "init": "epl_trainer.runtime.env",
    "Env": "epl_trainer.runtime.env",
    "replicate": "epl_trainer.annotations.strategies",
    "split": "epl_trainer.annotations.strategies",
    "set_default_strategy": "epl_trainer.annotations.strategies",
    "Strategy": "epl_trainer.annotations.strategies",
    "EPLTrainer": "epl_trainer.training.trainer",
    "DeepSpeedConfig": "epl_trainer.deepspeed",
    "ModelSpec": "epl_trainer.training.model_fn",
    "plot_schedule": "epl_trainer.training.plot",
    "add_to_collection": "epl_trainer.annotations.checkpoints",
    "get_collection": "epl_trainer.annotations.checkpoints",
    # Errors a user may want to catch.
    "ClusterError": "epl_trainer.runtime.cluster",
    "WorkerLostError": "epl_trainer.runtime.cluster",
    "CheckpointError": "epl_trainer.training.checkpoint",
    "NonFiniteLossError": "epl_trainer.training.trainer",
    "MinLossScaleError": "epl_trainer.core.engine.precision.amp",
    "PlanError": "epl_trainer.core.plan.ir",
    "SplitError": "epl_trainer.core.plan.ir",
    "DeepSpeedConfigError": "epl_trainer.deepspeed.keys",
}

# Submodules reachable as attributes (`epl.io.slice_files`, `epl.layers.MoE`), by their module.
_SUBMODULES = {"io": "epl_trainer.training.io", "layers": "epl_trainer.layers"}

__all__ = [*_EXPORTS, *_SUBMODULES, "__version__"]


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name])
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'epl_trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
