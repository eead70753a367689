"""absl flags that build an EPL `Config`: `--epl_config=PATH` and `--epl_set KEY=VALUE`.

`--deepspeed_config=PATH` names a DeepSpeed JSON config for the trainer
(`EPLTrainer(config=deepspeed_config_from_flags())`), applied on top of the EPL config.

Importing this module defines both flags on `absl.flags.FLAGS`, so a script only
needs::

    from absl import app
    from epl_trainer.runtime import flags as epl_flags

    def main(argv):
        config = epl_flags.config_from_flags()

    app.run(main)

Precedence, highest first: `--epl_set` > `--epl_config` file > `EPL_*`
environment variables > defaults. No TensorFlow: `deepspeed/` is pure Python, and epl-plan
reads `--epl_set` through `parse_assignments`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from absl import flags

from epl_trainer.config.sections import Config, ConfigError, parse_value
from epl_trainer.deepspeed import DeepSpeedConfig


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines `--epl_config` and `--epl_set` on `flag_values`; safe to call twice."""
    # absl raises DuplicateFlagError on redefinition, and both this module's import
    # and explicit callers (tests, scripts with their own FlagValues) define them.
    if "epl_config" not in flag_values:
        flags.DEFINE_string(
            "epl_config",
            None,
            "Path to an EPL config file (.json, .yaml or .yml).",
            flag_values=flag_values,
        )
    if "epl_set" not in flag_values:
        flags.DEFINE_multi_string(
            "epl_set",
            [],
            "Override one EPL config key as KEY=VALUE, e.g. pipeline.num_micro_batch=4. "
            "Repeatable; later values win.",
            flag_values=flag_values,
        )
    if "deepspeed_config" not in flag_values:
        flags.DEFINE_string(
            "deepspeed_config",
            None,
            "Path to a DeepSpeed JSON config; EPLTrainer translates it on top of the EPL "
            "config (--epl_config, --epl_set).",
            flag_values=flag_values,
        )


def parse_assignments(assignments: Iterable[str]) -> dict[str, Any]:
    """Parses `KEY=VALUE` strings into {key: typed value}, like environment variables.

    Raises:
      ConfigError: an item has no '=', or its key or value is invalid.
    """
    values: dict[str, Any] = {}
    for item in assignments:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(
                f"--epl_set expects KEY=VALUE, e.g. pipeline.num_micro_batch=4. Received: {item!r}"
            )
        key = key.strip()
        # Later items win, as with any repeated command-line option.
        values[key] = parse_value(key, text, origin=f"--epl_set {item!r}")
    return values


def config_from_flags(
    flag_values: flags.FlagValues = flags.FLAGS,
    *,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Builds a Config from parsed `--epl_config` and `--epl_set` flags.

    Args:
      flag_values: parsed flags holding `epl_config` and `epl_set`.
      environ: the environment for `EPL_*` variables; `os.environ` if None.

    Raises:
      ConfigError: the file, a `--epl_set` item, or an environment variable is invalid.
    """
    overrides = parse_assignments(flag_values.epl_set or [])
    path = flag_values.epl_config
    if path:
        return Config.from_file(os.path.expanduser(path), overrides, environ=environ)
    return Config(overrides, environ=environ)


def deepspeed_config_from_flags(flag_values: flags.FlagValues = flags.FLAGS, **kwargs):
    """The `--deepspeed_config` file as a `DeepSpeedConfig` for `EPLTrainer(config=...)`.

    Returns None when the flag is unset, so `EPLTrainer(config=None)` keeps using
    `epl.init()`'s config. `kwargs` go to `DeepSpeedConfig` (e.g. `total_num_steps`).

    Raises:
      DeepSpeedConfigError: the file cannot be read or holds an unknown key.
    """
    path = flag_values.deepspeed_config
    if not path:
        return None
    return DeepSpeedConfig(os.path.expanduser(path), **kwargs)


define_flags()
