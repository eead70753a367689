"""Tests for epl_trainer.config.sections (pure Python, no TensorFlow)."""

import dataclasses
import json
import pickle

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epl_trainer.config.sections import (
    KNOWN_KEYS,
    SECTIONS,
    AmpConfig,
    Config,
    ConfigError,
    PipelineConfig,
    parse_value,
)

# Written out by hand from docs/epl_config.md, plus cluster.virtual_devices and the
# DeepSpeed-style loss-scaling keys of amp, so that a changed default in the registry is
# caught rather than silently mirrored.
EXPECTED_DEFAULTS = {
    "pipeline.num_micro_batch": 1,
    "pipeline.num_stages": None,
    "pipeline.strategy": "PreferBackward",
    "pipeline.virtual_stages": 1,
    "gradient_checkpoint.type": "",
    "gradient_checkpoint.end_taskgraph": -1,
    "gradient_checkpoint.check_gradients": False,
    "zero.stage": None,
    "zero.level": "",
    "offload.level": "",
    "amp.level": "",
    "amp.debug_log": False,
    "amp.loss_scale": "dynamic",
    "amp.dtype": "float16",
    "amp.initial_scale_power": 16,
    "amp.loss_scale_window": 1000,
    "amp.hysteresis": 2,
    "amp.min_loss_scale": 1,
    "optimizer.num_apply_group": 1,
    "optimizer.nonfinite_loss": "error",
    "optimizer.jit_compile": "auto",
    "cluster.device_place_prefer_intra_node": True,
    "cluster.run_visible_devices": "",
    "cluster.colocate_split_and_replicate": False,
    "cluster.virtual_devices": 0,
    "cluster.intra_op_threads": 0,
    "cluster.inter_op_threads": 0,
    "cluster.startup_timeout_seconds": 900,
    "communication.num_communicators": 2,
    "communication.sparse_as_dense": False,
    "communication.max_splits": 5,
    "communication.fp16": False,
    "communication.fp16_scale": 128,
    "communication.clip_after_allreduce": False,
    "communication.gradients_reduce_method": "mean",
    "communication.timeout_seconds": 600,
    "batch_norm.synchronized": False,
    "checkpoint.dir": "",
    "checkpoint.save_steps": 0,
    "checkpoint.keep_max": 5,
    "checkpoint.async_save": False,
    "checkpoint.input_state": True,
    "io.slicing": False,
    "io.unbalanced_io_slicing": False,
    "io.drop_last_files": False,
    "io.global_batches": False,
    "io.auto_shard": "auto",
    "elastic.max_workers": 0,
    "elastic.resize_file": "",
    "auto.auto_parallel": False,
    "profiler.flops": False,
    "profiler.profile_step": 1,
    "profiler.module_depth": -1,
    "profiler.top_modules": 1,
    "profiler.detailed": True,
    "profiler.output_file": "",
    "profiler.peak_tflops": 0,
}

SECTION_CLASSES = {
    "pipeline": "PipelineConfig",
    "gradient_checkpoint": "GradientCheckpointConfig",
    "zero": "ZeroConfig",
    "offload": "OffloadConfig",
    "amp": "AmpConfig",
    "optimizer": "OptimizerConfig",
    "cluster": "ClusterConfig",
    "communication": "CommunicationConfig",
    "batch_norm": "BatchNormConfig",
    "checkpoint": "CheckpointConfig",
    "io": "IoConfig",
    "elastic": "ElasticConfig",
    "auto": "AutoConfig",
    "profiler": "ProfilerConfig",
}


def make(param_dict=None, **environ):
    """Config with an explicit environment, so the test runner's env cannot leak in."""
    return Config(param_dict, environ=environ)


# --- Keys and defaults.


def test_every_documented_key_has_its_default():
    config = make()
    assert config.to_dict() == EXPECTED_DEFAULTS
    assert list(KNOWN_KEYS) == list(EXPECTED_DEFAULTS)
    for key, expected in EXPECTED_DEFAULTS.items():
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        assert value == expected and type(value) is type(expected), key


def test_sections_are_named_dataclasses():
    config = make()
    assert {name: cls.__name__ for name, cls in SECTIONS.items()} == SECTION_CLASSES
    for section, class_name in SECTION_CLASSES.items():
        assert type(getattr(config, section)).__name__ == class_name


def test_known_keys_have_help_type_and_env_var():
    for key, spec in KNOWN_KEYS.items():
        assert spec.key == key
        assert spec.help and spec.help.isascii(), key
        assert spec.type_name
        assert spec.env_var == "EPL_" + key.upper().replace(".", "_")


def test_sections_are_frozen():
    config = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.pipeline.num_micro_batch = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.pipeline = PipelineConfig()


def test_sections_built_directly_are_validated():
    assert PipelineConfig(strategy="preferforward").strategy == "PreferForward"
    with pytest.raises(ConfigError, match=r"'pipeline.num_micro_batch' must be >= 1"):
        PipelineConfig(num_micro_batch=0)
    with pytest.raises(ConfigError, match=r"'amp.level'"):
        dataclasses.replace(AmpConfig(), level="O2")


# --- Environment variables and precedence.


def test_env_overrides_defaults():
    config = make(
        EPL_PIPELINE_NUM_MICRO_BATCH="4",
        EPL_GRADIENT_CHECKPOINT_TYPE="auto",
        EPL_CLUSTER_VIRTUAL_DEVICES="2",
        EPL_AMP_DEBUG_LOG="Yes",
        EPL_PIPELINE_NUM_STAGES="none",
        EPL_AMP_LOSS_SCALE="1024",
        EPL_COMMUNICATION_FP16_SCALE="0.5",
        EPL_CLUSTER_RUN_VISIBLE_DEVICES="0,1",
    )
    assert config.pipeline.num_micro_batch == 4
    assert config.gradient_checkpoint.type == "auto"
    assert config.cluster.virtual_devices == 2
    assert config.amp.debug_log is True
    assert config.pipeline.num_stages is None
    assert config.amp.loss_scale == 1024 and isinstance(config.amp.loss_scale, int)
    assert config.communication.fp16_scale == 0.5
    assert config.cluster.run_visible_devices == "0,1"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("true", True), ("FALSE", False), ("1", True), ("0", False), ("yes", True), ("No", False)],
)
def test_env_bool_spellings(text, expected):
    assert make(EPL_IO_SLICING=text).io.slicing is expected


def test_env_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("EPL_OPTIMIZER_NUM_APPLY_GROUP", "3")
    assert Config().optimizer.num_apply_group == 3


def test_precedence_dict_over_env_over_default():
    config = make(
        {"pipeline.num_micro_batch": 8},
        EPL_PIPELINE_NUM_MICRO_BATCH="4",
        EPL_AMP_LEVEL="o1",
    )
    assert config.pipeline.num_micro_batch == 8  # dict beats env
    assert config.amp.level == "O1"  # env beats default
    assert config.zero.level == ""  # default
    table = config.describe()
    assert "dict" in _describe_row(table, "pipeline.num_micro_batch")
    assert "env" in _describe_row(table, "amp.level")
    assert "default" in _describe_row(table, "zero.level")


def _describe_row(table, key):
    (row,) = [line for line in table.splitlines() if line.split()[0] == key]
    return row.split()


@pytest.mark.parametrize(
    ("name", "value", "expected_type"),
    [
        ("EPL_PIPELINE_NUM_MICRO_BATCH", "four", "int"),
        ("EPL_PIPELINE_NUM_STAGES", "2.5", "int, or '' / 'none' for None"),
        ("EPL_AMP_DEBUG_LOG", "maybe", "bool"),
        ("EPL_AMP_LOSS_SCALE", "static", "'dynamic' or a positive number"),
        ("EPL_COMMUNICATION_FP16_SCALE", "big", "int or float"),
    ],
)
def test_env_parse_error_names_variable_type_and_value(name, value, expected_type):
    with pytest.raises(ConfigError) as info:
        make(**{name: value})
    message = str(info.value)
    assert name in message
    assert f"expects {expected_type}" in message
    assert repr(value) in message


def test_env_range_and_enum_errors_name_variable():
    with pytest.raises(ConfigError, match=r"EPL_PIPELINE_NUM_MICRO_BATCH .* must be >= 1"):
        make(EPL_PIPELINE_NUM_MICRO_BATCH="0")
    with pytest.raises(
        ConfigError, match=r"EPL_ZERO_LEVEL .* must be one of \['', 'v0', 'v1', 'v2'\]"
    ):
        make(EPL_ZERO_LEVEL="v3")


def test_unrelated_epl_env_vars_are_ignored():
    assert make(EPL_WORKER_INDEX="3") == make()


# --- Dict validation.


def test_unknown_key_suggests_closest():
    with pytest.raises(
        ConfigError,
        match=r"^Unknown config key 'pipeline.num_micro_batches'\. "
        r"Did you mean 'pipeline.num_micro_batch'\?$",
    ):
        make({"pipeline.num_micro_batches": 4})
    with pytest.raises(ConfigError, match=r"Did you mean 'communication.fp16_scale'\?"):
        make({"communication": {"fp16_scal": 4}})
    with pytest.raises(ConfigError, match=r"Did you mean 'pipeline.num_micro_batch'\?"):
        make({"num_micro_batch": 4})
    with pytest.raises(ConfigError, match=r"Did you mean 'pipeline.num_micro_batch'\?"):
        make({"amp.num_micro_batch": 4})


def test_unknown_key_without_close_match_lists_keys():
    with pytest.raises(ConfigError, match=r"Keys of section 'pipeline': \['pipeline.num_micro"):
        make({"pipeline.xyzzy": 1})
    with pytest.raises(ConfigError, match=r"Unknown config key 'xyzzy'.*sections are"):
        make({"xyzzy": 1})


def test_unknown_section_suggests_closest():
    with pytest.raises(ConfigError, match=r"Unknown config section 'pipline'\. .*'pipeline'"):
        make({"pipline": {"num_micro_batch": 4}})
    with pytest.raises(ConfigError, match=r"Did you mean 'pipeline.num_micro_batch'\?"):
        make({"pipline.num_micro_batch": 4})


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("pipeline.num_micro_batch", "4", r"expects int\. Received: '4' \(type str\)"),
        ("pipeline.num_micro_batch", True, r"expects int\. Received: True \(type bool\)"),
        ("pipeline.num_micro_batch", 2.0, r"expects int\. Received: 2\.0 \(type float\)"),
        ("pipeline.num_stages", "2", r"expects int or None\. Received: '2' \(type str\)"),
        ("amp.debug_log", 1, r"expects bool\. Received: 1 \(type int\)"),
        ("optimizer.jit_compile", "on", r"expects 'auto' or a bool\. Received: 'on' \(type str\)"),
        ("amp.loss_scale", "128", r"expects 'dynamic' or a positive number\. Received: '128'"),
        ("communication.fp16_scale", None, r"expects int or float\. Received: None"),
        ("cluster.run_visible_devices", 0, r"expects str\. Received: 0 \(type int\)"),
        ("zero.level", 1, r"expects one of '', 'v0', 'v1', 'v2'\. Received: 1 \(type int\)"),
    ],
)
def test_wrong_type_names_key_type_and_value(key, value, expected):
    with pytest.raises(ConfigError, match=rf"^Config key '{key}' {expected}"):
        make({key: value})


def test_int_accepted_for_float_field_and_kept_as_given():
    assert make({"communication.fp16_scale": 64}).communication.fp16_scale == 64
    assert make({"communication.fp16_scale": 0.5}).communication.fp16_scale == 0.5
    assert make({"amp.loss_scale": 2.5}).amp.loss_scale == 2.5
    assert make({"amp.loss_scale": "DYNAMIC"}).amp.loss_scale == "dynamic"
    assert make({"optimizer.jit_compile": "Auto"}).optimizer.jit_compile == "auto"
    assert make({"optimizer.jit_compile": False}).optimizer.jit_compile is False


def test_amp_loss_scaling_keys():
    # DeepSpeed's quickstart "fp16" section, spelled as amp keys.
    amp = make(
        {
            "amp": {
                "level": "O1",
                "initial_scale_power": 12,
                "loss_scale_window": 500,
                "hysteresis": 1,
                "min_loss_scale": 0.25,
            }
        }
    ).amp
    assert (amp.initial_scale_power, amp.loss_scale_window, amp.hysteresis) == (12, 500, 1)
    assert amp.min_loss_scale == 0.25 and amp.dtype == "float16"
    env = make(EPL_AMP_DTYPE="bfloat16", EPL_AMP_MIN_LOSS_SCALE="2", EPL_AMP_HYSTERESIS="3").amp
    assert (env.dtype, env.min_loss_scale, env.hysteresis) == ("bfloat16", 2, 3)
    with pytest.raises(ConfigError, match=r"'amp.dtype' must be one of \['float16', 'bfloat16'\]"):
        make({"amp.dtype": "float8"})


@pytest.mark.parametrize(
    ("key", "value", "canonical"),
    [
        ("pipeline.strategy", "preferforward", "PreferForward"),
        ("pipeline.strategy", "PREFERBACKWARD", "PreferBackward"),
        ("amp.level", "o1", "O1"),
        ("communication.gradients_reduce_method", "SUM", "sum"),
        ("gradient_checkpoint.type", "Auto", "auto"),
        ("zero.level", "V1", "v1"),
        ("offload.level", "V0", "v0"),
        ("amp.dtype", "BFloat16", "bfloat16"),
    ],
)
def test_enums_are_case_insensitive_and_normalised(key, value, canonical):
    assert make({key: value}).to_dict()[key] == canonical


def test_bad_enum_lists_allowed_values():
    with pytest.raises(
        ConfigError,
        match=r"'pipeline.strategy' must be one of "
        r"\['PreferBackward', 'PreferForward', 'ZeroBubbleH1', 'Interleaved1F1B'\] "
        r".*Received: 'Interleaved'",
    ):
        make({"pipeline.strategy": "Interleaved"})


@pytest.mark.parametrize(
    ("key", "value", "bound"),
    [
        ("pipeline.num_micro_batch", 0, ">= 1"),
        ("pipeline.num_stages", 0, ">= 1"),
        ("optimizer.num_apply_group", -2, ">= 1"),
        ("cluster.virtual_devices", -1, ">= 0"),
        ("communication.num_communicators", 0, ">= 1"),
        ("communication.max_splits", 0, ">= 1"),
        ("communication.fp16_scale", 0, "> 0"),
        ("amp.loss_scale", -1.0, "> 0"),
        ("amp.initial_scale_power", -1, ">= 0"),
        ("amp.loss_scale_window", 0, ">= 1"),
        ("amp.hysteresis", 0, ">= 1"),
        ("amp.min_loss_scale", 0, "> 0"),
    ],
)
def test_range_errors_name_key_and_value(key, value, bound):
    with pytest.raises(ConfigError, match=rf"'{key}' must be {bound}\. Received: {value}"):
        make({key: value})


def test_non_finite_numbers_rejected():
    with pytest.raises(ConfigError, match=r"'amp.loss_scale' must be a finite number"):
        make({"amp.loss_scale": float("inf")})
    with pytest.raises(ConfigError, match=r"'communication.fp16_scale' must be a finite"):
        make({"communication.fp16_scale": float("nan")})


def test_nested_flat_and_mixed_dicts_agree():
    flat = make({"pipeline.num_micro_batch": 4, "amp.level": "O1"})
    nested = make({"pipeline": {"num_micro_batch": 4}, "amp": {"level": "O1"}})
    mixed = make({"pipeline": {"num_micro_batch": 4}, "amp.level": "O1"})
    assert flat == nested == mixed
    assert make({"pipeline": None}) == make()  # An empty YAML section.


def test_key_set_twice_is_an_error():
    with pytest.raises(ConfigError, match=r"'pipeline.num_micro_batch' is set twice"):
        make({"pipeline.num_micro_batch": 4, "pipeline": {"num_micro_batch": 8}})


def test_malformed_dicts():
    with pytest.raises(ConfigError, match=r"Config keys must be str\. Received: 3 \(type int\)"):
        make({3: 4})
    with pytest.raises(ConfigError, match=r"section 'pipeline' must be a mapping"):
        make({"pipeline": [1]})
    with pytest.raises(TypeError, match=r"param_dict as a mapping.*type list"):
        make([("pipeline.num_micro_batch", 4)])


# --- Files.


def test_json_file(tmp_path):
    path = tmp_path / "epl.json"
    path.write_text(json.dumps({"pipeline": {"num_micro_batch": 4}, "zero.level": "v1"}))
    config = Config.from_file(path, environ={})
    assert config.pipeline.num_micro_batch == 4
    assert config.zero.level == "v1"
    assert "file" in _describe_row(config.describe(), "zero.level")


def test_describe_names_the_spelling_that_filled_a_setting():
    """zero.level filled in from a given zero.stage was labelled "default"."""
    table = Config({"zero": {"stage": 2}}, environ={}).describe()
    assert _describe_row(table, "zero.stage") == ["zero.stage", "2", "None", "dict"]
    assert _describe_row(table, "zero.level") == [
        "zero.level",
        "'v1'",
        "''",
        "dict(via:zero.stage)",
    ]


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".YAML"])
def test_yaml_file(tmp_path, suffix):
    path = tmp_path / f"epl{suffix}"
    path.write_text(
        "pipeline:\n  num_micro_batch: 4\n  num_stages: null\n"
        "amp.level: o1\namp.loss_scale: 128\ngradient_checkpoint:\n"
    )
    config = Config.from_file(str(path), environ={})
    assert config.pipeline.num_micro_batch == 4
    assert config.amp.level == "O1"
    assert config.amp.loss_scale == 128


def test_file_precedence(tmp_path):
    path = tmp_path / "epl.yaml"
    path.write_text("pipeline.num_micro_batch: 4\npipeline.num_stages: 2\n")
    environ = {"EPL_PIPELINE_NUM_MICRO_BATCH": "2", "EPL_PIPELINE_NUM_STAGES": "3"}
    environ["EPL_OPTIMIZER_NUM_APPLY_GROUP"] = "5"
    config = Config.from_file(path, {"pipeline.num_stages": 6}, environ=environ)
    assert config.pipeline.num_micro_batch == 4  # file > env
    assert config.pipeline.num_stages == 6  # overrides > file
    assert config.optimizer.num_apply_group == 5  # env > default


def test_empty_yaml_file_means_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing set\n")
    assert Config.from_file(path, environ={}) == make()


@pytest.mark.parametrize(
    ("name", "text", "kind"),
    [("bad.json", '{"pipeline": ', "JSON"), ("bad.yaml", "pipeline: [1, 2\n", "YAML")],
)
def test_invalid_file_error_names_file(tmp_path, name, text, kind):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"'{path}' is not valid {kind}: .+"):
        Config.from_file(path, environ={})


@pytest.mark.parametrize(("name", "text"), [("list.json", "[1, 2]"), ("str.yaml", "hello\n")])
def test_non_mapping_top_level(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"'{path}' must hold a mapping .*at the top level"):
        Config.from_file(path, environ={})


def test_missing_file_and_bad_suffix(tmp_path):
    with pytest.raises(ConfigError, match=r"'.*nope\.json' does not exist"):
        Config.from_file(tmp_path / "nope.json", environ={})
    with pytest.raises(ConfigError, match=r"must end in \.json, \.yaml or \.yml"):
        Config.from_file(tmp_path / "epl.toml", environ={})


def test_bad_key_in_file_names_file(tmp_path):
    path = tmp_path / "epl.json"
    path.write_text('{"pipeline.num_micro_batches": 4}')
    with pytest.raises(ConfigError, match=rf"In config file '{path}': .*Did you mean"):
        Config.from_file(path, environ={})


# --- Config.load, replace, dunder methods.


def test_load_dispatch(tmp_path):
    path = tmp_path / "epl.json"
    path.write_text('{"io.slicing": true}')
    config = make({"io.slicing": True})
    assert Config.load(None, environ={}) == make()
    assert Config.load(config) is config
    assert Config.load({"io.slicing": True}, environ={}) == config
    assert Config.load(str(path), environ={}) == config
    assert Config.load(path, environ={}) == config
    with pytest.raises(TypeError, match=r"Config.load expects .*\(type int\)"):
        Config.load(42)


def test_replace_validates_and_keeps_original():
    base = make({"pipeline.num_micro_batch": 2})
    changed = base.replace({"pipeline.num_micro_batch": 4, "amp": {"level": "o1"}})
    assert base.pipeline.num_micro_batch == 2
    assert changed.pipeline.num_micro_batch == 4 and changed.amp.level == "O1"
    with pytest.raises(ConfigError, match=r"Did you mean 'amp.level'"):
        base.replace({"amp.levels": "O1"})


def test_eq_hash_repr_pickle():
    config = make({"pipeline.num_micro_batch": 4, "amp.level": "O1"})
    same = make({"amp": {"level": "o1"}, "pipeline": {"num_micro_batch": 4}})
    assert config == same and hash(config) == hash(same)
    assert config != make()
    assert repr(make()) == "Config()"
    assert repr(config) == "Config({'pipeline.num_micro_batch': 4, 'amp.level': 'O1'})"
    assert pickle.loads(pickle.dumps(config)) == config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.extra = 1


def test_describe_lists_every_key_once():
    lines = make().describe().splitlines()
    assert lines[0].split() == ["key", "value", "default", "source"]
    assert [line.split()[0] for line in lines[1:]] == list(EXPECTED_DEFAULTS)


def test_parse_value():
    assert parse_value("pipeline.num_micro_batch", " 4 ") == 4
    assert parse_value("optimizer.jit_compile", "AUTO") == "auto"
    assert parse_value("optimizer.jit_compile", "false") is False
    with pytest.raises(ConfigError, match=r"expects 'auto' or a bool \(one of true/false"):
        parse_value("optimizer.jit_compile", "sometimes")
    assert parse_value("pipeline.num_stages", "") is None
    assert parse_value("amp.loss_scale", "dynamic") == "dynamic"
    assert parse_value("amp.loss_scale", "0.5") == 0.5
    with pytest.raises(ConfigError, match=r"Did you mean 'io.slicing'"):
        parse_value("io.slicin", "true")


# --- Property tests: malformed input only ever raises ConfigError.

_NEAR_MISS_KEYS = st.sampled_from(list(KNOWN_KEYS)).flatmap(
    lambda key: st.sampled_from(
        [key, key + "s", key[:-1], key.upper(), key.replace(".", "_"), key.split(".")[1]]
    )
)
_KEYS = st.one_of(
    st.sampled_from(list(KNOWN_KEYS)),
    _NEAR_MISS_KEYS,
    st.sampled_from(list(SECTIONS)),
    st.text(max_size=20),
    st.integers(),
    st.none(),
)
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["dynamic", "o1", "SUM", "auto", "PreferForward", "v1", "", "none"]),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(_KEYS, children, max_size=3)
    ),
    max_leaves=6,
)


# Mostly-known keys with scalar values, so that the success path is exercised too.
_PLAUSIBLE_DICTS = st.dictionaries(st.sampled_from(list(KNOWN_KEYS)), _SCALARS, max_size=3)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.dictionaries(_KEYS, _VALUES, max_size=6), _PLAUSIBLE_DICTS))
def test_random_dicts_raise_only_config_error(param_dict):
    try:
        config = make(param_dict)
    except ConfigError:
        return
    values = config.to_dict()
    assert set(values) == set(EXPECTED_DEFAULTS)
    # A valid config round-trips through its own flat dict.
    assert make(values) == config


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(list(KNOWN_KEYS)), st.text(max_size=20))
def test_random_env_strings_raise_only_config_error(key, text):
    spec = KNOWN_KEYS[key]
    try:
        config = make(**{spec.env_var: text})
    except ConfigError as err:
        assert spec.env_var in str(err)
        return
    assert parse_value(key, text) == config.to_dict()[key]


# --- zero.stage (DeepSpeed's numbering) and zero.level (EPL's) name one setting.


@pytest.mark.parametrize("stage, level", [(0, ""), (1, "v0"), (2, "v1"), (3, "v2")])
def test_zero_stage_is_deepspeeds_numbering_of_zero_level(stage, level):
    assert make({"zero.stage": stage}).zero.level == level
    assert make({"zero.stage": stage}).to_dict()["zero.level"] == level
    assert make({"zero.level": level}).zero.stage == (None if level == "" else stage)
    assert make({"zero": {"stage": stage, "level": level}}).zero == make({"zero.stage": stage}).zero
    assert make(EPL_ZERO_STAGE=str(stage)).zero.level == level


def test_zero_stage_and_level_that_disagree_are_refused_naming_both():
    with pytest.raises(ConfigError, match=r"zero.stage=3 and zero.level='v1'.*DeepSpeed"):
        make({"zero.stage": 3, "zero.level": "v1"})
    with pytest.raises(ConfigError, match=r"zero.stage=0 and zero.level='v2'"):
        make({"zero": {"stage": 0, "level": "v2"}})
    with pytest.raises(ConfigError, match=r"zero.stage.*<= 3"):
        make({"zero.stage": 4})


def test_a_later_source_of_either_zero_spelling_wins():
    """Precedence applies to the setting, not to its spelling: a key given over a config
    (replace, a trainer's config= over epl.init's, a dict over the environment) wins
    whichever spelling the lower source used."""
    assert make({"zero.level": "v1"}).replace({"zero.stage": 3}).zero.level == "v2"
    assert make({"zero.stage": 3}).replace({"zero.level": "v0"}).zero.stage == 1
    assert make({"zero.stage": 1}).merge(make({"zero.level": "v2"})).zero.stage == 3
    assert make({"zero.stage": 2}, EPL_ZERO_LEVEL="v2").zero.level == "v1"


def test_merge_keeps_keys_set_above_the_environment():
    """A trainer's config= read the same EPL_* variables as epl.init's config; its
    environment values went over init's dict (num_micro_batch 4 became 2)."""
    environ = {"EPL_PIPELINE_NUM_MICRO_BATCH": "2", "EPL_ZERO_STAGE": "3"}
    base = Config({"pipeline.num_micro_batch": 4, "zero.level": "v1"}, environ=environ)
    merged = base.merge(Config({"amp.level": "O1"}, environ=environ))
    assert merged.pipeline.num_micro_batch == 4 and merged.zero.level == "v1"
    assert merged.amp.level == "O1"
    # Where init set nothing above it, the environment still applies, and a key the
    # trainer's dict sets goes over init's.
    merged = Config({}, environ={}).merge(Config({}, environ=environ))
    assert merged.pipeline.num_micro_batch == 2 and merged.zero.level == "v2"
    assert base.merge(Config({"pipeline.num_micro_batch": 8})).pipeline.num_micro_batch == 8
