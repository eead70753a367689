"""EPL configuration: dotted keys parsed once into one frozen dataclass per section.

`Config` mirrors `epl.Config` (see docs/epl_config.md of EPL): every key is
`"<section>.<name>"`, e.g. `"pipeline.num_micro_batch"`. Values come from, in
increasing precedence: the default, an environment variable
`EPL_<SECTION>_<NAME>`, a config file, and a dict of overrides. Each component
receives only its own section, e.g. `config.pipeline.num_micro_batch`.

This module must stay pure Python (no TensorFlow) so that launchers and tests can
read a config without paying TensorFlow's import time.

To add a key, add one field to its section dataclass with a kind helper
(`_int`, `_bool`, `_enum`, ...); the registry (`KNOWN_KEYS`), environment
variable, parsing and validation follow from it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import yaml

from epl_trainer.config.keys import (  # noqa: F401  (ConfigError, Kind, KeySpec: public here)
    _INVALID,
    ConfigError,
    KeySpec,
    Kind,
    _bool,
    _bool_or_auto,
    _check,
    _enum,
    _int,
    _loss_scale,
    _optional_int,
    _parse_text,
    _positive_number,
    _received,
    _short_repr,
    _str,
)

ZERO_LEVELS = ("", "v0", "v1", "v2")  # zero.level, indexed by DeepSpeed's zero.stage
AUTO_SHARD_CHOICES = ("auto", "files", "data", "off")  # io.auto_shard: tf.distribute's policies
# Keys that spell one setting twice: a source giving either replaces both of a lower one.
_SPELLINGS = (("zero.stage", "zero.level"),)


def spellings(key: str) -> tuple[str, ...]:
    """Every key that sets the same setting as `key` (`zero.stage` and `zero.level`), or
    `(key,)`."""
    return next((names for names in _SPELLINGS if key in names), (key,))


_SECTIONS: dict[str, type] = {}
_KEYS: dict[str, KeySpec] = {}
SECTIONS: Mapping[str, type] = types.MappingProxyType(_SECTIONS)
KNOWN_KEYS: Mapping[str, KeySpec] = types.MappingProxyType(_KEYS)


def _register(section: str):
    """Adds a frozen section dataclass and its fields to the key registry."""

    def register(cls: type) -> type:
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls
        cls.section_name = section
        _SECTIONS[section] = cls
        env_vars = {spec.env_var for spec in _KEYS.values()}
        for field in dataclasses.fields(cls):
            spec = KeySpec(section, field.name, default=field.default, **field.metadata["epl"])
            # Section/key names joined by "_" must not collide in the env namespace.
            assert spec.env_var not in env_vars, spec.env_var
            assert _check(spec, spec.default, "default") == spec.default, spec
            _KEYS[spec.key] = spec
        return cls

    return register


class _Section:
    """Validates and normalises fields, so sections built directly are checked too."""

    section_name: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            spec = _KEYS[f"{self.section_name}.{field.name}"]
            value = _check(spec, getattr(self, field.name), f"Config key {spec.key!r}")
            # Frozen dataclass: normalised enum spellings must bypass __setattr__.
            object.__setattr__(self, field.name, value)


# --- The key table (docs/epl_config.md of EPL, plus cluster.virtual_devices).


@_register("pipeline")
@dataclasses.dataclass(frozen=True)
class PipelineConfig(_Section):
    """Pipeline parallelism."""

    num_micro_batch: int = _int(1, "Number of micro-batches per step.", minimum=1)
    num_stages: int | None = _optional_int(None, "Stage count for automatic pipelines.", minimum=1)
    strategy: str = _enum(
        "PreferBackward",
        "Schedule: backward first (PipeDream), forward first (GPipe), ZB-H1 (backward split "
        "into input and weight gradients) or interleaved 1F1B (pipeline.virtual_stages).",
        choices=("PreferBackward", "PreferForward", "ZeroBubbleH1", "Interleaved1F1B"),
    )
    virtual_stages: int = _int(
        1, "Stages per device (Interleaved1F1B): device d of p runs d, d+p, ...", minimum=1
    )


@_register("gradient_checkpoint")
@dataclasses.dataclass(frozen=True)
class GradientCheckpointConfig(_Section):
    """Recomputation (gradient checkpointing), trading compute for peak memory."""

    type: str = _enum(
        "",
        "How checkpoints are chosen: off, tensors tagged by the user, or automatically.",
        choices=("", "collection", "auto"),
    )
    end_taskgraph: int = _int(
        -1, "Last taskgraph checkpointed (-1: every one); needs type set.", minimum=-1
    )
    check_gradients: bool = _bool(
        False, "Verify the gradients produced with checkpointing; needs type set."
    )


@_register("zero")
@dataclasses.dataclass(frozen=True)
class ZeroConfig(_Section):
    """ZeRO sharding of data-parallel state.

    `stage` is DeepSpeed's numbering of the setting EPL calls `level` (stage 1 / 2 / 3 =
    level v0 / v1 / v2): give either; both are filled, and two that disagree are
    refused."""

    stage: int | None = _optional_int(
        None,
        "ZeRO stage as DeepSpeed numbers it: 0 off, 1 shards optimizer states, 2 also "
        "gradients, 3 also parameters (zero.level v0 / v1 / v2).",
        minimum=0,
        maximum=3,
    )
    level: str = _enum(
        "",
        "EPL's ZeRO level: v0 shards optimizer states, v1 also gradients, v2 also "
        "parameters (DeepSpeed's zero.stage 1 / 2 / 3).",
        choices=ZERO_LEVELS,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stage is None:
            if self.level:
                object.__setattr__(self, "stage", ZERO_LEVELS.index(self.level))
            return
        if self.level and self.level != ZERO_LEVELS[self.stage]:
            raise ConfigError(
                f"zero.stage={self.stage} and zero.level={self.level!r} name different ZeRO "
                "stages (zero.level 'v0' / 'v1' / 'v2' are DeepSpeed's zero.stage 1 / 2 / 3); "
                "give one of them."
            )
        object.__setattr__(self, "level", ZERO_LEVELS[self.stage])


@_register("offload")
@dataclasses.dataclass(frozen=True)
class OffloadConfig(_Section):
    """CPU offload of model state."""

    level: str = _enum("", "Offload level; v0 puts all variables on the CPU.", choices=("", "v0"))


@_register("amp")
@dataclasses.dataclass(frozen=True)
class AmpConfig(_Section):
    """Memory-efficient automatic mixed precision."""

    level: str = _enum("", "Automatic mixed precision level.", choices=("", "O1"))
    debug_log: bool = _bool(False, "Log AMP debug information.")
    loss_scale: int | float | str = _loss_scale("dynamic", "'dynamic' or a fixed loss scale.")
    dtype: str = _enum("float16", "Compute dtype of O1 layers.", choices=("float16", "bfloat16"))
    initial_scale_power: int = _int(16, "Dynamic loss scaling starts at 2**power.", minimum=0)
    loss_scale_window: int = _int(1000, "Clean steps before the loss scale doubles.", minimum=1)
    hysteresis: int = _int(2, "Overflows that halve the loss scale (reset on growth).", minimum=1)
    min_loss_scale: int | float = _positive_number(1, "Lowest loss scale; overflow there: error.")


@_register("optimizer")
@dataclasses.dataclass(frozen=True)
class OptimizerConfig(_Section):
    """Optimizer apply."""

    num_apply_group: int = _int(1, "Groups the apply is split into to save memory.", minimum=1)
    nonfinite_loss: str = _enum(
        "error",
        "A step with non-finite gradients that no dynamic loss scaler can recover "
        "(float32, or AMP with bfloat16 or a fixed loss scale): stop, or skip it.",
        choices=("error", "skip"),
    )
    jit_compile: bool | str = _bool_or_auto(
        "auto",
        "Compile optimizer updates with XLA (plain ops where XLA cannot compile them); "
        "'auto': updates of at least 1M parameters, where XLA's compile pays off.",
    )


@_register("cluster")
@dataclasses.dataclass(frozen=True)
class ClusterConfig(_Section):
    """Device placement."""

    device_place_prefer_intra_node: bool = _bool(True, "Keep each model replica within a node.")
    run_visible_devices: str = _str("", "Devices visible to the run, usually set by the scheduler.")
    colocate_split_and_replicate: bool = _bool(False, "Let taskgraphs share the same devices.")
    virtual_devices: int = _int(0, "CPU devices to create without GPUs (0 = one).", minimum=0)
    intra_op_threads: int = _int(
        0,
        "Threads one op may use (0: the cores divided among the virtual devices).",
        minimum=0,
    )
    inter_op_threads: int = _int(
        0, "Ops run at once (0: TensorFlow's default, one per core).", minimum=0
    )
    startup_timeout_seconds: int | float = _positive_number(900, "Wait for every worker at start.")


@_register("communication")
@dataclasses.dataclass(frozen=True)
class CommunicationConfig(_Section):
    """Gradient communication."""

    num_communicators: int = _int(2, "Communicators in the communication pool.", minimum=1)
    sparse_as_dense: bool = _bool(False, "Communicate sparse gradients as dense tensors.")
    max_splits: int = _int(5, "Maximum number of fused gradient groups.", minimum=1)
    fp16: bool = _bool(False, "Communicate gradients in float16.")
    fp16_scale: int | float = _positive_number(128, "Gradient scale for fp16 communication.")
    clip_after_allreduce: bool = _bool(False, "Clip gradients after the all-reduce, not before.")
    gradients_reduce_method: str = _enum(
        "mean", "How gradients are reduced.", choices=("mean", "sum")
    )
    timeout_seconds: int | float = _positive_number(600, "Collective wait before a peer is dead.")


@_register("batch_norm")
@dataclasses.dataclass(frozen=True)
class BatchNormConfig(_Section):
    """BatchNormalization across data-parallel replicas."""

    synchronized: bool = _bool(
        False,
        "Normalise every BatchNormalization in training over the global batch of all "
        "replicas (each micro-batch across them), as a layer with synchronized=True.",
    )


@_register("checkpoint")
@dataclasses.dataclass(frozen=True)
class CheckpointConfig(_Section):
    """Periodic checkpoints during fit, and automatic resume from the newest one."""

    dir: str = _str("", "Folder for fit's checkpoints; resume from its newest ('' = off).")
    save_steps: int = _int(0, "Save every N steps (0: at each epoch end).", minimum=0)
    keep_max: int = _int(5, "Newest checkpoints kept; older ones are deleted.", minimum=1)
    async_save: bool = _bool(
        False,
        "Save in a background thread: the step hands a snapshot of the state to host "
        "memory and goes on; at most one save in flight.",
    )
    input_state: bool = _bool(
        True,
        "Save the tf.data iterator's state (position, shuffle buffers, seeds) with each "
        "checkpoint, so a resume reads what the uninterrupted run would; off: a resume "
        "skips the batches already taken (exact for a deterministic pipeline only).",
    )


@_register("io")
@dataclasses.dataclass(frozen=True)
class IoConfig(_Section):
    """Input sharding across workers: files, Datasets and global batches."""

    slicing: bool = _bool(False, "Shard the input files across workers automatically.")
    unbalanced_io_slicing: bool = _bool(False, "Let some workers get one extra file.")
    drop_last_files: bool = _bool(False, "Split files evenly and drop the leftovers.")
    global_batches: bool = _bool(False, "fit's data are global batches; each worker takes rows.")
    auto_shard: str = _enum("auto", "How fit shards a tf.data.Dataset.", choices=AUTO_SHARD_CHOICES)


@_register("elastic")
@dataclasses.dataclass(frozen=True)
class ElasticConfig(_Section):
    """A job whose worker count changes between restarts (set by `epl-launch --min_workers`)."""

    max_workers: int = _int(0, "Workers the job is sized for (0 = not elastic).", minimum=0)
    resize_file: str = _str("", "Its appearance stops fit at the next checkpoint (exit 75).")


@_register("auto")
@dataclasses.dataclass(frozen=True)
class AutoConfig(_Section):
    """Automatic parallelisation."""

    auto_parallel: bool = _bool(False, "Enable automatic parallelisation (experimental).")


def _closest(word: str, candidates: list[str]) -> str | None:
    matches = difflib.get_close_matches(word.lower(), candidates, n=1, cutoff=0.6)
    return matches[0] if matches else None


def _lookup(key: str, origin: str = "") -> KeySpec:
    """Returns the spec of `key`, or raises an error suggesting the closest key."""
    spec = _KEYS.get(key)
    if spec is not None:
        return spec
    section, _, name = key.partition(".")
    if section in _SECTIONS:
        # Matching the name within its section avoids suggestions driven by the
        # shared "section." prefix alone (e.g. 'pipeline.xyz' -> 'pipeline.strategy').
        in_section = [k for k in _KEYS if k.startswith(section + ".")]
        names = [k.partition(".")[2] for k in in_section]
        closest = _closest(name, names)
        same_name = [k for k in _KEYS if k.endswith("." + name)]
        if closest is not None:
            closest = f"{section}.{closest}"
        elif same_name:
            closest = same_name[0]
        hint = f" Keys of section {section!r}: {in_section}."
    else:
        closest = _closest(key, list(_KEYS))
        hint = f" Keys are 'section.name'; sections are {list(_SECTIONS)}."
    if closest is not None:
        hint = f" Did you mean {closest!r}?"
    raise ConfigError(f"Unknown config key {key!r}{origin}.{hint}")


def parse_value(key: str, text: str, *, origin: str = "") -> Any:
    """Parses and validates the string form of a value, as for environment variables.

    Args:
      key: a dotted config key, e.g. "pipeline.num_micro_batch".
      text: the value as a string, e.g. "4", "true", "none", "dynamic".
      origin: where the text came from, for error messages, e.g. "--epl_set x=1".

    Returns:
      The value in the key's type, e.g. int 4.

    Raises:
      ConfigError: the key is unknown or the text does not parse or validate.
      TypeError: `text` is not a str.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_value expects text as str. Received: {type(text).__name__}")
    suffix = f" (from {origin})" if origin else ""
    spec = _lookup(key, suffix)
    where = f"{origin} (config key {key!r})" if origin else f"Config key {key!r}"
    return _check(spec, _parse_text(spec, text, where), where)


# --- Sources: environment, dicts, files.


def _read_env(environ: Mapping[str, str] | None) -> dict[str, Any]:
    # Only known variable names are read: the EPL_ prefix is shared with launcher
    # variables, so unknown EPL_* names cannot be treated as typos.
    environ = os.environ if environ is None else environ
    values = {}
    for key, spec in _KEYS.items():
        if spec.env_var in environ:
            origin = f"Environment variable {spec.env_var}"
            values[key] = parse_value(key, environ[spec.env_var], origin=origin)
    return values


def _dict_items(param_dict: Mapping[Any, Any]):
    """Yields (dotted key, value) from flat dotted keys and/or nested sections."""
    for raw_key, value in param_dict.items():
        if not isinstance(raw_key, str):
            raise ConfigError(f"Config keys must be str. {_received(raw_key)}")
        if raw_key in _SECTIONS:
            # A YAML section whose keys are all commented out loads as None.
            section = {} if value is None else value
            if not isinstance(section, Mapping):
                raise ConfigError(
                    f"Config section {raw_key!r} must be a mapping of its keys. {_received(value)}"
                )
            for name, item in section.items():
                if not isinstance(name, str):
                    raise ConfigError(
                        f"Keys of config section {raw_key!r} must be str. {_received(name)}"
                    )
                yield f"{raw_key}.{name}", item
        elif "." not in raw_key and isinstance(value, Mapping):
            closest = _closest(raw_key, list(_SECTIONS))
            hint = f" Did you mean {closest!r}?" if closest else f" Sections: {list(_SECTIONS)}."
            raise ConfigError(f"Unknown config section {raw_key!r}.{hint}")
        else:
            yield raw_key, value


def _flatten(param_dict: Any) -> dict[str, Any]:
    """Validates a user dict into {dotted key: normalised value}."""
    if not isinstance(param_dict, Mapping):
        raise TypeError(f"Config expects param_dict as a mapping. {_received(param_dict)}")
    values: dict[str, Any] = {}
    for key, value in _dict_items(param_dict):
        spec = _lookup(key)
        if key in values:
            raise ConfigError(
                f"Config key {key!r} is set twice (as a dotted key and inside its section)."
            )
        values[key] = _check(spec, value, f"Config key {key!r}")
    return values


def _read_file(path: str | os.PathLike) -> Any:
    """Loads a JSON or YAML file; every failure names the file."""
    name = os.fspath(path)
    suffix = Path(name).suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise ConfigError(
            f"Config file {name!r} must end in .json, .yaml or .yml. Received suffix: {suffix!r}"
        )
    try:
        text = Path(name).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"Config file {name!r} does not exist.") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"Cannot read config file {name!r}: {err}") from err
    if suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"Config file {name!r} is not valid JSON: {err}") from err
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"Config file {name!r} is not valid YAML: {err}") from err
    # An empty YAML file (or one with only comments) means "no settings".
    return {} if data is None else data


# --- Config.

_Layers = list[tuple[str, dict[str, Any]]]


class Config:
    """EPL's `epl.Config`: every key's value, grouped into frozen section dataclasses.

    Precedence, highest first: `param_dict` > environment variable
    `EPL_<SECTION>_<NAME>` > default (`Config.from_file` puts the file between the
    overrides and the environment).

    Args:
      param_dict: {dotted key: value} and/or {section: {name: value}}. Values are
        checked strictly: no string to number coercion, bool is not an int.
      environ: the environment to read `EPL_*` variables from; `os.environ` if None.

    Raises:
      ConfigError: an unknown key or section, or a value of the wrong type or range.
      TypeError: `param_dict` is not a mapping.
    """

    pipeline: PipelineConfig
    gradient_checkpoint: GradientCheckpointConfig
    zero: ZeroConfig
    offload: OffloadConfig
    amp: AmpConfig
    optimizer: OptimizerConfig
    cluster: ClusterConfig
    communication: CommunicationConfig
    batch_norm: BatchNormConfig
    checkpoint: CheckpointConfig
    io: IoConfig
    auto: AutoConfig

    def __init__(
        self,
        param_dict: Mapping[str, Any] | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        layers = [("env", _read_env(environ))]
        if param_dict is not None:
            layers.append(("dict", _flatten(param_dict)))
        self._set_layers(layers)

    def _set_layers(self, layers: _Layers) -> None:
        values = {key: spec.default for key, spec in _KEYS.items()}
        sources = dict.fromkeys(_KEYS, "default")
        for source, layer in layers:  # Lowest precedence first.
            for spellings in _SPELLINGS:
                if any(key in layer for key in spellings):
                    values.update((key, _KEYS[key].default) for key in spellings)
                    sources.update(dict.fromkeys(spellings, "default"))
            values.update(layer)
            sources.update(dict.fromkeys(layer, source))
        for section, cls in _SECTIONS.items():
            keys = [key for key, spec in _KEYS.items() if spec.section == section]
            built = cls(**{_KEYS[key].name: values[key] for key in keys})
            object.__setattr__(self, section, built)
            # What the section made of its keys (the other spelling of a setting filled).
            values.update((key, getattr(built, _KEYS[key].name)) for key in keys)
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_sources", sources)

    @classmethod
    def _from_layers(cls, layers: _Layers) -> Config:
        config = cls.__new__(cls)
        config._set_layers(layers)
        return config

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike,
        overrides: Mapping[str, Any] | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> Config:
        """Loads a `.json`, `.yaml` or `.yml` file whose top level is a config dict.

        Precedence: `overrides` > file > environment > default.

        Raises:
          ConfigError: the file is missing, unparsable, not a mapping, or holds an
            invalid key or value (the message names the file).
        """
        data = _read_file(path)
        name = os.fspath(path)
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"Config file {name!r} must hold a mapping of config keys at the top level. "
                f"Received: {type(data).__name__}"
            )
        try:
            from_file = _flatten(data)
        except ConfigError as err:
            raise ConfigError(f"In config file {name!r}: {err}") from err
        layers = [("env", _read_env(environ)), ("file", from_file)]
        if overrides is not None:
            layers.append(("dict", _flatten(overrides)))
        return cls._from_layers(layers)

    @classmethod
    def load(cls, source: Any = None, *, environ: Mapping[str, str] | None = None) -> Config:
        """Returns a Config from None (defaults), a Config, a dict or a file path.

        Raises:
          TypeError: `source` is none of these.
        """
        if isinstance(source, Config):
            return source
        if source is None or isinstance(source, Mapping):
            return cls(source, environ=environ)
        if isinstance(source, (str, os.PathLike)):
            return cls.from_file(source, environ=environ)
        raise TypeError(
            f"Config.load expects None, a Config, a dict or a file path. {_received(source)}"
        )

    def replace(self, overrides: Mapping[str, Any]) -> Config:
        """Returns a new Config with validated `overrides` applied on top of this one."""
        current = [(source, {key: self._values[key]}) for key, source in self._sources.items()]
        return self._from_layers([*current, ("dict", _flatten(overrides))])

    def merge(self, other: Config) -> Config:
        """Returns this config with every key `other` sets (any key not at its default
        source) taken from `other`: a trainer's `config=` on top of `epl.init()`'s.

        A key `other` read from the environment is taken only where this config has
        nothing above the environment for it: both read the same variables, and the
        environment is the lowest source. Before, `epl.init({"pipeline.num_micro_batch":
        4})` with `EPL_PIPELINE_NUM_MICRO_BATCH=2` set trained with 2 as soon as the
        trainer got a `config=` of other keys."""
        current = [(source, {key: self._values[key]}) for key, source in self._sources.items()]

        def below_env(key: str) -> bool:
            return all(self._sources[k] in ("default", "env") for k in spellings(key))

        given = [
            (source, {key: other._values[key]})
            for key, source in other._sources.items()
            if source != "default" and (source != "env" or below_env(key))
        ]
        return self._from_layers([*current, *given])

    def given_keys(self) -> frozenset[str]:
        """The keys a source set (environment, file, dict; a spelling set through the
        other one too), as opposed to those left at their defaults."""
        return frozenset(key for key in _KEYS if self._source_of(key) != "default")

    def to_dict(self) -> dict[str, Any]:
        """Returns {dotted key: value} for every known key."""
        return dict(self._values)

    def describe(self) -> str:
        """Returns a human-readable table of key, value, default and source."""
        rows = [("key", "value", "default", "source")]
        for key, spec in _KEYS.items():
            rows.append((key, repr(self._values[key]), repr(spec.default), self._source_of(key)))
        widths = [max(len(cell) for cell in column) for column in zip(*rows, strict=True)]
        lines = ("  ".join(map(str.ljust, row, widths)).rstrip() for row in rows)
        return "\n".join(lines)

    def _source_of(self, key: str) -> str:
        """Where `key`'s value came from; a spelling filled in from another one that was
        given (`zero.level` from `zero.stage`) names that one, not "default"."""
        source = self._sources[key]
        if source == "default":
            for other in spellings(key):
                if self._sources[other] != "default":
                    return f"{self._sources[other]}(via:{other})"
        return source

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Config):
            return NotImplemented
        return self._values == other._values

    def __hash__(self) -> int:
        return hash(tuple(self._values.items()))

    def __repr__(self) -> str:
        changed = {
            key: value
            for key, value in self._values.items()
            if value != _KEYS[key].default or type(value) is not type(_KEYS[key].default)
        }
        return f"Config({changed})" if changed else "Config()"

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(
            f"Config is immutable; use config.replace({{...}}). Received: setting {name!r}"
        )

    def __delattr__(self, name: str) -> None:
        raise dataclasses.FrozenInstanceError(f"Config is immutable. Received: deleting {name!r}")
