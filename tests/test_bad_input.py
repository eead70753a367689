"""Bad input of every kind is a clear error: its type and message are part of the API.

One table: config dicts, config files and environment variables, TF_CONFIG, checkpoints,
datasets and launcher arguments. Each case builds the bad input under `tmp_path`, runs
the public entry point that receives it, and checks the exception type and message. A
property test then throws random config dicts at `Config`.
"""

import contextlib
import io
import json
import os
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from _models import LOSS, mlp, mlp_data
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import epl_trainer as epl
from epl_trainer.config.sections import KNOWN_KEYS, SECTIONS, Config, ConfigError
from epl_trainer.runtime import launcher
from epl_trainer.runtime.cluster import ClusterError, parse_tf_config
from epl_trainer.training.checkpoint import CheckpointError


class CliExit(Exception):
    """What `epl-launch` did with bad arguments: its exit code and its stderr."""

    def __init__(self, code: int, stderr: str):
        super().__init__(f"exit {code}: {stderr}")


def _cli(tmp_path, *argv):
    """Runs `epl-launch` in-process; a non-zero exit becomes CliExit."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = launcher.main(["--log_dir", str(tmp_path / "logs"), *argv])
    if code:
        raise CliExit(code, stderr.getvalue())


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _tf_config(value):
    return {"TF_CONFIG": value if isinstance(value, str) else json.dumps(value)}


def _trainer(model=None, **config):
    return epl.EPLTrainer(
        model or mlp(),
        LOSS,
        keras.optimizers.Adam(0.01),
        config={"cluster.virtual_devices": 1, **config},
    )


def _saved_checkpoint(tmp_path) -> str:
    """A real checkpoint of the MLP (2 steps); returns its folder."""
    trainer = _trainer()
    x, y = mlp_data(16)
    trainer.fit(x, y, batch_size=8, verbose=0, shuffle=False)
    return trainer.save_checkpoint(str(tmp_path / "ckpt"))


def _restore_after(damage):
    """A case: save a checkpoint, damage it with `damage(folder)`, restore it."""

    def run(tmp_path):
        folder = _saved_checkpoint(tmp_path)
        damage(folder)
        _trainer().restore_checkpoint(str(tmp_path / "ckpt"))

    return run


def _data_file(folder):
    (name,) = [n for n in os.listdir(folder) if n.endswith(".bin")]
    return os.path.join(folder, name)


def _truncate(folder):
    with open(_data_file(folder), "r+b") as f:
        f.truncate(8)


def _flip_bytes(folder):
    # Same size, different content: only the entries' hashes can tell.
    path = _data_file(folder)
    Path(path).write_bytes(bytes(b ^ 0xFF for b in Path(path).read_bytes()))


# A format-1 checkpoint's folder held metadata.json beside its data, and no manifest.
_OLD_FORMAT = ("manifest.json", "metadata.json")


def _edit_metadata(change):
    def damage(folder):
        path = Path(folder) / "manifest.json"
        metadata = json.loads(path.read_text())
        change(metadata)
        path.write_text(json.dumps(metadata))

    return damage


def _fit(dataset, model=None):
    return lambda tmp_path: _trainer(model).fit(dataset(), verbose=0)


def _xy_dataset(x_shape=(16, 6), with_labels=True, as_dict=False):
    def make():
        x = np.zeros(x_shape, "float32")
        y = np.zeros((x_shape[0],), "int32")
        features = {"wrong_name": x} if as_dict else x
        return tf.data.Dataset.from_tensor_slices((features, y) if with_labels else features).batch(
            8
        )

    return make


def _two_input_model():
    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    out = keras.layers.Dense(3)(keras.layers.Concatenate()([a, b]))
    return keras.Model({"a": a, "b": b}, out)


CASES = [
    # ---- config: dicts
    (
        "unknown key",
        lambda p: Config({"pipeline.num_micro_batches": 2}),
        ConfigError,
        r"Unknown config key 'pipeline.num_micro_batches'.*Did you mean 'pipeline.num_micro_batch'",
    ),
    (
        "string for an int",
        lambda p: Config({"pipeline.num_micro_batch": "4"}),
        ConfigError,
        r"'pipeline.num_micro_batch' expects int\. Received: '4' \(type str\)",
    ),
    (
        "bool for an int",
        lambda p: Config({"checkpoint.keep_max": True}),
        ConfigError,
        r"'checkpoint.keep_max' expects int\. Received: True",
    ),
    (
        "zero timeout",
        lambda p: Config({"communication.timeout_seconds": 0}),
        ConfigError,
        r"'communication.timeout_seconds' must be > 0\. Received: 0",
    ),
    (
        "infinite timeout",
        lambda p: Config({"communication.timeout_seconds": float("inf")}),
        ConfigError,
        r"'communication.timeout_seconds' must be a finite number",
    ),
    (
        "bad enum",
        lambda p: Config({"optimizer.nonfinite_loss": "ignore"}),
        ConfigError,
        r"must be one of \['error', 'skip'\].*Received: 'ignore'",
    ),
    (
        "keep_max below 1",
        lambda p: Config({"checkpoint": {"keep_max": 0}}),
        ConfigError,
        r"'checkpoint.keep_max' must be >= 1\. Received: 0",
    ),
    (
        "section not a mapping",
        lambda p: Config({"checkpoint": ["dir"]}),
        ConfigError,
        r"Config section 'checkpoint' must be a mapping",
    ),
    (
        "env variable not a number",
        lambda p: Config(environ={"EPL_COMMUNICATION_TIMEOUT_SECONDS": "soon"}),
        ConfigError,
        r"EPL_COMMUNICATION_TIMEOUT_SECONDS.*expects int or float\. Received: 'soon'",
    ),
    # ---- config: files
    (
        "file not JSON",
        lambda p: Config.from_file(_write(p, "c.json", '{"pipeline.num_micro_batch": 2,}')),
        ConfigError,
        r"Config file '.*c\.json' is not valid JSON",
    ),
    (
        "file not YAML",
        lambda p: Config.from_file(_write(p, "c.yaml", "pipeline: [1, 2\n")),
        ConfigError,
        r"Config file '.*c\.yaml' is not valid YAML",
    ),
    (
        "YAML python tag (safe loader)",
        lambda p: Config.from_file(
            _write(p, "c.yaml", "pipeline: !!python/object/apply:os.system ['echo pwned']\n")
        ),
        ConfigError,
        r"is not valid YAML.*could not determine a constructor for the tag",
    ),
    (
        "file holds a list",
        lambda p: Config.from_file(_write(p, "c.yml", "- pipeline.num_micro_batch\n")),
        ConfigError,
        r"must hold a mapping of config keys at the top level\. Received: list",
    ),
    (
        "file wrong type names the file",
        lambda p: Config.from_file(_write(p, "c.json", '{"checkpoint.save_steps": 1.5}')),
        ConfigError,
        r"In config file '.*c\.json': Config key 'checkpoint.save_steps' expects int",
    ),
    (
        "file suffix",
        lambda p: Config.from_file(_write(p, "c.toml", "")),
        ConfigError,
        r"must end in \.json, \.yaml or \.yml\. Received suffix: '\.toml'",
    ),
    # ---- TF_CONFIG
    (
        "TF_CONFIG not JSON",
        lambda p: parse_tf_config(_tf_config("{cluster: worker}")),
        ClusterError,
        r"TF_CONFIG is not valid JSON",
    ),
    (
        "TF_CONFIG not an object",
        lambda p: parse_tf_config(_tf_config([1])),
        ClusterError,
        r"TF_CONFIG must be a JSON object",
    ),
    (
        "TF_CONFIG without task",
        lambda p: parse_tf_config(_tf_config({"cluster": {"worker": ["h:1"]}})),
        ClusterError,
        r'needs a "cluster" object and a "task" object',
    ),
    (
        "TF_CONFIG worker not a list",
        lambda p: parse_tf_config(
            _tf_config({"cluster": {"worker": "h:1"}, "task": {"type": "worker", "index": 0}})
        ),
        ClusterError,
        r'cluster\["worker"\] must be a list of "host:port" strings',
    ),
    (
        "TF_CONFIG index out of range",
        lambda p: parse_tf_config(
            _tf_config({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 5}})
        ),
        ClusterError,
        r"task 'worker' index 5 is not in the cluster",
    ),
    (
        "TF_CONFIG index as a string",
        lambda p: parse_tf_config(
            _tf_config({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": "0"}})
        ),
        ClusterError,
        r"task 'worker' index '0' is not in the cluster",
    ),
    (
        "TF_CONFIG parameter server",
        lambda p: parse_tf_config(
            _tf_config({"cluster": {"worker": ["h:1"], "ps": ["h:2"]}, "task": {"type": "ps"}})
        ),
        ClusterError,
        r"This process is a 'ps' task",
    ),
    # ---- checkpoints
    (
        "no checkpoint",
        lambda p: _trainer().restore_checkpoint(str(p)),
        CheckpointError,
        r"No checkpoint in '.*': '.*latest' does not exist",
    ),
    (
        "pointer corrupted",
        _restore_after(lambda d: (Path(d).parent / "latest").write_text("\x00garbage")),
        CheckpointError,
        r"Checkpoint pointer '.*latest' is corrupted",
    ),
    (
        "pointer names a missing folder",
        _restore_after(lambda d: (Path(d).parent / "latest").write_text("ckpt-99")),
        CheckpointError,
        r"names 'ckpt-99', which does not exist",
    ),
    (
        "manifest not JSON",
        _restore_after(lambda d: (Path(d) / "manifest.json").write_text("{")),
        CheckpointError,
        r"Checkpoint manifest '.*manifest\.json' is corrupted",
    ),
    (
        "manifest missing",
        _restore_after(lambda d: os.remove(os.path.join(d, "manifest.json"))),
        CheckpointError,
        r"Checkpoint '.*ckpt-2' is incomplete: '.*ckpt-2/manifest\.json' is missing",
    ),
    (
        "checkpoint of the old format",
        _restore_after(lambda d: os.rename(*[os.path.join(d, n) for n in _OLD_FORMAT])),
        CheckpointError,
        r"Checkpoint '.*ckpt-2' is in epl_trainer's checkpoint format 1 \(metadata\.json: lane "
        r"0's state under positional keys of the layout that wrote it\)\. This version reads "
        r"formats 2 and 3",
    ),
    (
        "data file truncated",
        _restore_after(_truncate),
        CheckpointError,
        r"Checkpoint file '.*shard-0\.bin' is truncated or corrupted: it has 8 "
        r"bytes, \d+ were written",
    ),
    (
        "data file missing",
        _restore_after(lambda d: os.remove(_data_file(d))),
        CheckpointError,
        r"Checkpoint file '.*shard-0\.bin' is missing",
    ),
    (
        "data file bytes flipped",
        _restore_after(_flip_bytes),
        CheckpointError,
        r"Checkpoint data '.*shard-0\.bin' is corrupted: 'dense.*' \(\d+ bytes at offset \d+\) "
        r"does not match the hash it was written with",
    ),
    (
        "future format version",
        _restore_after(_edit_metadata(lambda m: m.update(format_version=99))),
        CheckpointError,
        r"manifest\.json' has format_version 99; this version of epl_trainer reads formats 2 and 3",
    ),
    (
        "checkpoint of a different model",
        lambda p: (
            _saved_checkpoint(p),
            _trainer(mlp(width=32)).restore_checkpoint(str(p / "ckpt")),
        ),
        CheckpointError,
        r"ckpt-2' was written for a different model: it holds 'dense_in/kernel' with shape "
        r"\[6, 16\] float32, where this model has 'dense_in/kernel' with shape \[6, 32\] float32",
    ),
    (
        "corrupt checkpoint is not overwritten by auto-resume",
        lambda p: (
            _saved_checkpoint(p),
            _truncate(_data_file_folder(p)),
            _trainer(**{"checkpoint.dir": str(p / "ckpt")}).fit(
                *mlp_data(16), verbose=0, shuffle=False
            ),
        ),
        CheckpointError,
        r"is truncated or corrupted",
    ),
    # ---- datasets
    (
        "dataset without labels",
        _fit(_xy_dataset(with_labels=False)),
        ValueError,
        r"must yield \(features, labels\) pairs or \(features, labels, sample_weight\) triples",
    ),
    (
        "dataset feature width",
        _fit(_xy_dataset(x_shape=(16, 7))),
        ValueError,
        r"do not match the model's inputs: input 0 expects shape \(None, 6\), the dataset "
        r"gives \(None, 7\)",
    ),
    (
        "dataset rank",
        _fit(_xy_dataset(x_shape=(16, 6, 1))),
        ValueError,
        r"input 0 expects shape \(None, 6\), the dataset gives \(None, 6, 1\)",
    ),
    (
        "dataset dict keys",
        _fit(_xy_dataset(x_shape=(16, 3), as_dict=True), model=_two_input_model()),
        ValueError,
        r"do not match the model's inputs: missing key\(s\) \['a', 'b'\]",
    ),
    (
        "dataset with y",
        lambda p: _trainer().fit(_xy_dataset()(), np.zeros(16), verbose=0),
        ValueError,
        r"When x is a tf\.data\.Dataset, y must be None",
    ),
    (
        "dataset with sample_weight",
        lambda p: _trainer().fit(_xy_dataset()(), sample_weight=np.ones(16), verbose=0),
        ValueError,
        r"When x is a tf\.data\.Dataset, sample_weight must be None",
    ),
    (
        "per-output sample weights",
        lambda p: _trainer().fit(
            *mlp_data(16), sample_weight=[np.ones(16)] * 2, verbose=0, shuffle=False
        ),
        ValueError,
        r"sample_weight must be one array of shape \(num_samples,\).*Received: a list of 2",
    ),
    (
        "class_weight with sample_weight",
        lambda p: _trainer().fit(
            *mlp_data(16),
            class_weight={0: 2.0},
            sample_weight=np.ones(16),
            verbose=0,
            shuffle=False,
        ),
        ValueError,
        r"You cannot `class_weight` and `sample_weight` at the same time",
    ),
    (
        "validation_split of a dataset",
        lambda p: _trainer().fit(_xy_dataset()(), validation_split=0.5, verbose=0),
        ValueError,
        r"validation_split is only supported for NumPy arrays.*Received: x of type",
    ),
    (
        "validation_freq not an int or list",
        lambda p: _trainer().fit(
            *mlp_data(16),
            validation_data=mlp_data(16),
            validation_freq="1",
            verbose=0,
            shuffle=False,
        ),
        ValueError,
        r"Expected `validation_freq` to be a list or int\. Received: validation_freq='1'",
    ),
    (
        "shuffle of an unknown kind",
        lambda p: _trainer().fit(*mlp_data(16), shuffle="epoch", verbose=0),
        ValueError,
        r'shuffle must be True, False or "batch"\. Received: \'epoch\'',
    ),
    (
        "numpy lengths differ",
        lambda p: _trainer().fit(
            np.zeros((16, 6), "float32"), np.zeros(15), verbose=0, shuffle=False
        ),
        ValueError,
        r"All input arrays must have the same length\. Received lengths \[15, 16\]",
    ),
    # ---- launcher arguments (never through a shell: a script name is just a path)
    (
        "launcher zero workers",
        lambda p: _cli(p, "--num_workers", "0", "--gpu_per_worker", "1", "x.py"),
        CliExit,
        r"(?s)exit 2: .*argument --num_workers: must be >= 1\. Received: num_workers=0",
    ),
    (
        "launcher negative restarts",
        lambda p: _cli(p, "--num_workers", "1", "--gpu_per_worker", "1", "--max_restarts=-1", "x"),
        CliExit,
        r"(?s)exit 2: .*argument --max_restarts: must be >= 0\. Received: max_restarts=-1",
    ),
    (
        "launcher timeout not a number",
        lambda p: _cli(p, "--num_workers", "1", "--gpu_per_worker", "1", "--timeout", "1h", "x"),
        CliExit,
        r"(?s)exit 2: .*argument --timeout: must be a number of seconds\. Received: timeout='1h'",
    ),
    (
        "launcher shell syntax is a file name",
        lambda p: _cli(p, "--num_workers", "1", "--gpu_per_worker", "1", "t.py; touch pwned"),
        CliExit,
        r"(?s)exit 2: .*Script not found\. Received: script='t\.py; touch pwned'",
    ),
    (
        "launcher unsupported script",
        lambda p: _cli(p, "--num_workers", "1", "--gpu_per_worker", "1", _write(p, "run.rb", "")),
        CliExit,
        r"(?s)exit 2: .*Unsupported script type '\.rb'",
    ),
    (
        "launcher missing count",
        lambda p: _cli(p, "--gpu_per_worker", "1", "x.py"),
        CliExit,
        r"(?s)exit 2: .*the following arguments are required: --num_workers",
    ),
]


def _data_file_folder(tmp_path):
    return str(tmp_path / "ckpt" / (tmp_path / "ckpt" / "latest").read_text())


def test_the_table_covers_every_kind_of_input():
    assert len(CASES) >= 25
    assert len({name for name, *_ in CASES}) == len(CASES)


@pytest.mark.parametrize(("name", "run", "error", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_clear_error(tmp_path, name, run, error, message):
    with pytest.raises(error, match=message) as info:
        run(tmp_path)
    assert type(info.value) is error  # exactly this type, not a subclass or a wrapper


@pytest.mark.timeout(60)
def test_nothing_is_run_through_a_shell(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = _write(
        tmp_path,
        "ok; touch pwned.py",
        "import pathlib, sys\npathlib.Path('received').write_text(repr(sys.argv[1:]))\n",
    )
    argv = ["--num_workers", "1", "--gpu_per_worker", "1", script, "$(touch pwned2)", "`id`"]
    _cli(tmp_path, *argv)
    assert (tmp_path / "received").read_text() == repr(["$(touch pwned2)", "`id`"])
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()


# ---- random config dicts: only ConfigError, whatever the input

_KEYS = st.one_of(
    st.sampled_from(list(KNOWN_KEYS)),
    st.sampled_from(list(SECTIONS)),
    st.text(max_size=12),
)
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=4),
    st.complex_numbers(max_magnitude=10),
    st.sampled_from(["error", "skip", "SKIP", "dynamic", "/tmp/x", "", "none", "1e3"]),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.tuples(inner, inner),
        st.dictionaries(_KEYS, inner, max_size=3),
    ),
    max_leaves=6,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_KEYS, _VALUES, max_size=6))
def test_random_config_dicts_raise_only_config_error(param_dict):
    try:
        config = Config(param_dict, environ={})
    except ConfigError:
        return
    assert Config(config.to_dict(), environ={}) == config


def test_a_tf_distribute_strategy_scope_is_refused_by_name():
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        with pytest.raises(ValueError, match=r"cannot run under a tf.distribute strategy.*OneDe"):
            epl.EPLTrainer(model, config={"cluster.virtual_devices": 2})


def test_a_none_input_array_is_refused_by_position():
    x = keras.Input((3,), name="x")
    model = keras.Model(x, keras.layers.Dense(1)(x))
    trainer = epl.EPLTrainer(model, "mse", "sgd", config={"cluster.virtual_devices": 2})
    with pytest.raises(ValueError, match=r"None for input\(s\) at flat position\(s\) \[0\]"):
        trainer.fit([None], np.ones((4, 1)), verbose=0)
