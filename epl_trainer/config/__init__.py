"""Configuration: the typed config and its sections (`sections`), the keys' kinds and
checks (`keys`), the `profiler` section (`profiler`: sections.py is at the size cap).
Pure Python, the lowest layer: it imports nothing else of ours (the absl flags that
build a Config live in `runtime/flags.py`).

`epl_trainer.config.Config` stays the import path users know.
"""

from epl_trainer.config import profiler  # noqa: F401  (registers the profiler section)
from epl_trainer.config.sections import SECTIONS, Config, ConfigError

__all__ = ["SECTIONS", "Config", "ConfigError"]
