"""Config keys: their kinds, how values are checked and parsed, and the declaration helpers
the section dataclasses of config.py use (one `_int(...)`, `_enum(...)` per key).

Pure Python, like config.py.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import numbers
from typing import Any


class ConfigError(ValueError):
    """A config key, value or file is invalid."""


class Kind(enum.Enum):
    """How a key's values are checked (dicts, files) and parsed (env, --epl_set).

    Each value is the type named in error messages.
    """

    INT = "int"
    OPTIONAL_INT = "int or None"
    NUMBER = "int or float"
    BOOL = "bool"
    BOOL_OR_AUTO = "'auto' or a bool"
    STR = "str"
    ENUM = "one of the choices"
    LOSS_SCALE = "'dynamic' or a positive number"


_TRUE_STRINGS = ("true", "1", "yes")
_FALSE_STRINGS = ("false", "0", "no")
_NONE_STRINGS = ("", "none")


@dataclasses.dataclass(frozen=True)
class KeySpec:
    """Type, default and help of one config key."""

    section: str
    name: str
    kind: Kind
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    exclusive_minimum: bool = False
    maximum: float | None = None

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def env_var(self) -> str:
        return f"EPL_{self.section}_{self.name}".upper()

    @property
    def type_name(self) -> str:
        if self.kind == Kind.ENUM:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        return self.kind.value


# --- Checking and parsing values.

_INVALID = object()


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _received(value: Any) -> str:
    return f"Received: {_short_repr(value)} (type {type(value).__name__})"


def _as_int(value: Any) -> Any:
    # bool is an int subclass, but True for a count is almost always a mistake.
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return _INVALID


def _as_number(value: Any) -> Any:
    if isinstance(value, numbers.Integral):
        return _as_int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return _INVALID


def _coerce(spec: KeySpec, value: Any) -> Any:
    """Returns `value` in the key's Python type, or `_INVALID` if its type is wrong."""
    kind = spec.kind
    if kind == Kind.INT:
        return _as_int(value)
    if kind == Kind.OPTIONAL_INT:
        return None if value is None else _as_int(value)
    if kind == Kind.NUMBER:
        return _as_number(value)
    if kind == Kind.BOOL:
        return value if isinstance(value, bool) else _INVALID
    if kind == Kind.BOOL_OR_AUTO:
        if isinstance(value, str):
            return "auto" if value.lower() == "auto" else _INVALID
        return value if isinstance(value, bool) else _INVALID
    if kind in (Kind.STR, Kind.ENUM):
        return value if isinstance(value, str) else _INVALID
    if kind == Kind.LOSS_SCALE:
        if isinstance(value, str):
            return "dynamic" if value.lower() == "dynamic" else _INVALID
        return _as_number(value)
    raise AssertionError(f"unhandled kind {kind!r}")


def _check_range(spec: KeySpec, value: Any, where: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where} must be a finite number. Received: {value!r}")
    if not isinstance(value, (int, float)):
        return
    if spec.maximum is not None and value > spec.maximum:
        raise ConfigError(f"{where} must be <= {spec.maximum}. Received: {value!r}")
    if spec.minimum is None:
        return
    if spec.exclusive_minimum and value <= spec.minimum:
        raise ConfigError(f"{where} must be > {spec.minimum}. Received: {value!r}")
    if value < spec.minimum:
        raise ConfigError(f"{where} must be >= {spec.minimum}. Received: {value!r}")


def _check(spec: KeySpec, value: Any, where: str) -> Any:
    """Validates a Python value for `spec` strictly and returns it normalised.

    `where` names the value's origin (a key, an env variable) in error messages.
    """
    coerced = _coerce(spec, value)
    if coerced is _INVALID:
        raise ConfigError(f"{where} expects {spec.type_name}. {_received(value)}")
    if spec.kind == Kind.ENUM:
        canonical = {choice.lower(): choice for choice in spec.choices}.get(coerced.lower())
        if canonical is None:
            raise ConfigError(
                f"{where} must be one of {list(spec.choices)} (case-insensitive). "
                f"Received: {_short_repr(value)}"
            )
        return canonical
    _check_range(spec, coerced, where)
    return coerced


def _parse_text(spec: KeySpec, text: str, where: str) -> Any:
    """Parses the string form of a value (env variable, --epl_set) by the key's kind."""
    stripped = text.strip()
    lowered = stripped.lower()
    try:
        if spec.kind == Kind.STR:
            return text
        if spec.kind == Kind.ENUM:
            return stripped
        is_bool = lowered in _TRUE_STRINGS + _FALSE_STRINGS
        if spec.kind in (Kind.BOOL, Kind.BOOL_OR_AUTO) and is_bool:
            return lowered in _TRUE_STRINGS
        if spec.kind == Kind.BOOL_OR_AUTO and lowered == "auto":
            return "auto"
        if spec.kind == Kind.OPTIONAL_INT and lowered in _NONE_STRINGS:
            return None
        if spec.kind in (Kind.INT, Kind.OPTIONAL_INT):
            return int(stripped)
        if spec.kind == Kind.LOSS_SCALE and lowered == "dynamic":
            return "dynamic"
        if spec.kind in (Kind.NUMBER, Kind.LOSS_SCALE):
            try:
                return int(stripped)
            except ValueError:
                return float(stripped)
    except ValueError:
        pass
    expected = spec.type_name
    if spec.kind == Kind.BOOL:
        expected = "bool (one of true/false/1/0/yes/no)"
    elif spec.kind == Kind.BOOL_OR_AUTO:
        expected = "'auto' or a bool (one of true/false/1/0/yes/no)"
    elif spec.kind == Kind.OPTIONAL_INT:
        expected = "int, or '' / 'none' for None"
    raise ConfigError(f"{where} expects {expected}. Received: {_short_repr(text)}")


def _key(default: Any, help: str, *, kind: Kind, **extra: Any) -> Any:
    """Declares a section field; `_register` turns its metadata into a `KeySpec`."""
    metadata = {"epl": {"kind": kind, "help": help, **extra}}
    return dataclasses.field(default=default, metadata=metadata)


# One declaration helper per kind keeps each row of the key table on one line.
_int = functools.partial(_key, kind=Kind.INT)
_optional_int = functools.partial(_key, kind=Kind.OPTIONAL_INT)
_positive_number = functools.partial(_key, kind=Kind.NUMBER, minimum=0, exclusive_minimum=True)
_bool = functools.partial(_key, kind=Kind.BOOL)
_bool_or_auto = functools.partial(_key, kind=Kind.BOOL_OR_AUTO)
_str = functools.partial(_key, kind=Kind.STR)
_enum = functools.partial(_key, kind=Kind.ENUM)
_loss_scale = functools.partial(_key, kind=Kind.LOSS_SCALE, minimum=0, exclusive_minimum=True)
