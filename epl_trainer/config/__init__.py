"""Configuration: the typed config and its sections (`sections`), the keys' kinds and
checks (`keys`), the `profiler` section (`profiler`: sections.py is at the size cap),
absl flags and the environment (`flags`). Pure Python except `flags`.

`epl_trainer.config.Config` stays the import path users know.
"""

from epl_trainer.config import profiler  # noqa: F401  (registers the profiler section)
from epl_trainer.config.sections import SECTIONS, Config, ConfigError

__all__ = ["SECTIONS", "Config", "ConfigError"]
