"""Tests for epl_trainer.runtime.flags (absl flags -> Config, no TensorFlow)."""

import json

import pytest
from absl import flags

from epl_trainer.config.sections import Config, ConfigError
from epl_trainer.runtime import flags as epl_flags


def parsed_flags(argv):
    """Fresh FlagValues with the EPL flags, parsed from `argv` (argv[0] is the program)."""
    flag_values = flags.FlagValues()
    epl_flags.define_flags(flag_values)
    flag_values(argv)
    return flag_values


def test_flags_defined_on_global_flags_at_import():
    assert "epl_config" in flags.FLAGS
    assert "epl_set" in flags.FLAGS


def test_define_flags_is_idempotent():
    flag_values = flags.FlagValues()
    epl_flags.define_flags(flag_values)
    epl_flags.define_flags(flag_values)
    epl_flags.define_flags()  # Global FLAGS, already defined at import.
    flag_values(["prog"])
    assert flag_values.epl_config is None
    assert flag_values.epl_set == []


def test_precedence_set_over_file_over_env(tmp_path):
    path = tmp_path / "f.json"
    path.write_text(json.dumps({"pipeline.num_micro_batch": 2, "zero.level": "v1"}))
    flag_values = parsed_flags(
        [
            "prog",
            f"--epl_config={path}",
            "--epl_set",
            "pipeline.num_micro_batch=8",
            "--epl_set=amp.level=o1",
        ]
    )
    environ = {"EPL_ZERO_LEVEL": "v0", "EPL_IO_SLICING": "true", "EPL_AMP_LEVEL": ""}
    config = epl_flags.config_from_flags(flag_values, environ=environ)
    assert config.pipeline.num_micro_batch == 8  # --epl_set > file
    assert config.amp.level == "O1"  # --epl_set > env
    assert config.zero.level == "v1"  # file > env
    assert config.io.slicing is True  # env > default
    assert config.optimizer.num_apply_group == 1  # default


def test_set_values_are_parsed_per_type():
    flag_values = parsed_flags(
        [
            "prog",
            "--epl_set=pipeline.num_micro_batch=4",
            "--epl_set=pipeline.num_stages=none",
            "--epl_set=amp.loss_scale=256",
            "--epl_set=communication.fp16=yes",
            "--epl_set=communication.fp16_scale=0.5",
            "--epl_set=cluster.run_visible_devices=0,1",
        ]
    )
    config = epl_flags.config_from_flags(flag_values, environ={})
    assert config.pipeline.num_micro_batch == 4
    assert config.pipeline.num_stages is None
    assert config.amp.loss_scale == 256
    assert config.communication.fp16 is True
    assert config.communication.fp16_scale == 0.5
    assert config.cluster.run_visible_devices == "0,1"


def test_later_set_wins_and_no_file_uses_defaults():
    flag_values = parsed_flags(["prog", "--epl_set=io.slicing=true", "--epl_set=io.slicing=0"])
    config = epl_flags.config_from_flags(flag_values, environ={})
    assert config == Config(environ={})


def test_set_without_equals_is_an_error():
    flag_values = parsed_flags(["prog", "--epl_set", "pipeline.num_micro_batch"])
    with pytest.raises(ConfigError, match=r"--epl_set expects KEY=VALUE.*'pipeline.num_micro"):
        epl_flags.config_from_flags(flag_values, environ={})


def test_set_errors_name_the_flag():
    flag_values = parsed_flags(["prog", "--epl_set=pipeline.num_micro_batch=four"])
    with pytest.raises(ConfigError, match=r"--epl_set 'pipeline.num_micro_batch=four'.*int"):
        epl_flags.config_from_flags(flag_values, environ={})
    flag_values = parsed_flags(["prog", "--epl_set=pipeline.num_micro_batches=4"])
    with pytest.raises(ConfigError, match=r"Did you mean 'pipeline.num_micro_batch'"):
        epl_flags.config_from_flags(flag_values, environ={})


def test_missing_config_file_is_an_error(tmp_path):
    flag_values = parsed_flags(["prog", f"--epl_config={tmp_path / 'nope.yaml'}"])
    with pytest.raises(ConfigError, match=r"nope\.yaml' does not exist"):
        epl_flags.config_from_flags(flag_values, environ={})
