"""The import paths modules had before they moved into subpackages, kept working.

`import epl_trainer.trainer`, `from epl_trainer.flags import config_from_flags` and
`python -m epl_trainer.launcher` still work: a finder on `sys.meta_path` answers each old
name with the module at its new path (the same module object, so patching either name
patches both). The package's own code uses the new paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

_TRAINING = (
    "checkpoint compiled data end_of_data fit_inputs io losses memory metric_sync "
    "metrics model_fn model_inputs model_setup monitors optimizers pipeline_models plot "
    "schedules start_state trainer trainer_checkpoints trainer_data trainer_inference "
    "trainer_objectives"
)
_RUNTIME = "cluster elastic env launch_elastic launch_job launcher plan_cli slurm watchdog"
# core/engine's modules that became part of a parallelism's folder. (`split`, `pipeline`
# and `update` are the folders' own names now, so those three old paths cannot alias.)
_ENGINE = {
    "zero_layout": "zero.layout",
    "zero_exchange": "zero.exchange",
    "zero_params": "zero.params",
    "zero_gather": "zero.gather",
    "boundaries": "pipeline.boundaries",
    "exchange": "pipeline.exchange",
    "split_lanes": "split.lanes",
    "amp": "precision.amp",
    "finite": "precision.finite",
    "reduce": "update.reduce",
    "apply": "update.apply",
    "slots": "update.slots",
}

MOVED: dict[str, str] = {
    **{f"epl_trainer.{name}": f"epl_trainer.training.{name}" for name in _TRAINING.split()},
    **{f"epl_trainer.{name}": f"epl_trainer.runtime.{name}" for name in _RUNTIME.split()},
    "epl_trainer.config_keys": "epl_trainer.config.keys",
    "epl_trainer.flags": "epl_trainer.config.flags",
    **{
        f"epl_trainer.core.engine.{old}": f"epl_trainer.core.engine.{new}"
        for old, new in _ENGINE.items()
    },
}


class _AliasLoader(importlib.abc.Loader):
    """Loads an old name as the module at its new path."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self._own = (module.__spec__, module.__loader__)
        return module

    def exec_module(self, module) -> None:
        # Nothing to run (`create_module` returned the imported module), but the import
        # system has just stamped the old name's spec on it: give the module its own back.
        module.__spec__, module.__loader__ = self._own

    def get_code(self, fullname):
        # runpy (`python -m old.name`) runs the target's code as __main__.
        spec = importlib.util.find_spec(self.target)
        return spec.loader.get_code(self.target)


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(new))


def install() -> None:
    """Puts the finder on `sys.meta_path` once."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
