"""Reading DeepSpeed config values: "auto", strict types, and errors that name the key.

DeepSpeed validates its config with pydantic models that coerce types and ignore keys
they do not know, so a misspelled `gradient_clipp1ng` silently does nothing. Here every
key is looked up in a table of the keys we translate, the keys we accept because they
only tune DeepSpeed's PyTorch engine, and the DeepSpeed features we do not have; anything
else is an error suggesting the closest known key. Pure Python (no TensorFlow).
"""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Mapping
from typing import Any

from epl_trainer.config.sections import ConfigError

AUTO = "auto"


class DeepSpeedConfigError(ConfigError):
    """A DeepSpeed config key or value is unknown, unsupported or invalid."""


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


def closest(word: str, candidates) -> str | None:
    matches = difflib.get_close_matches(word, sorted(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def check_keys(section: Mapping, known, where: str) -> None:
    """Raises naming every key of `section` that is not in `known`, with a suggestion."""
    if not isinstance(section, Mapping):
        raise DeepSpeedConfigError(
            f"DeepSpeed config {where} must be a JSON object. "
            f"Received: {section!r} (type {type(section).__name__})"
        )
    unknown = [key for key in section if key not in known]
    if not unknown:
        return
    hints = []
    for key in unknown:
        suggestion = closest(str(key), known)
        hints.append(f"{key!r}" + (f" (did you mean {suggestion!r}?)" if suggestion else ""))
    raise DeepSpeedConfigError(
        f"Unknown DeepSpeed config key(s) in {where}: {', '.join(hints)}. DeepSpeed would "
        f"ignore them silently; epl_trainer does not. Known keys: {sorted(known)}"
    )


def _received(value: Any) -> str:
    return f"Received: {value!r} (type {type(value).__name__})"


def as_int(value: Any, where: str, *, minimum: int | None = None) -> int:
    # JSON has one number type; 2e8 or 1.0 for a count is accepted when it is whole.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise DeepSpeedConfigError(
            f"DeepSpeed config {where} must be an integer. {_received(value)}"
        )
    if minimum is not None and value < minimum:
        raise DeepSpeedConfigError(
            f"DeepSpeed config {where} must be >= {minimum}. Received: {value}"
        )
    return int(value)


def as_float(value: Any, where: str, *, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise DeepSpeedConfigError(f"DeepSpeed config {where} must be a number. {_received(value)}")
    if minimum is not None and value < minimum:
        raise DeepSpeedConfigError(
            f"DeepSpeed config {where} must be >= {minimum}. Received: {value}"
        )
    return float(value)


def as_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise DeepSpeedConfigError(
            f"DeepSpeed config {where} must be true or false. {_received(value)}"
        )
    return value


def as_str(value: Any, where: str, choices=None) -> str:
    if not isinstance(value, str):
        raise DeepSpeedConfigError(f"DeepSpeed config {where} must be a string. {_received(value)}")
    if choices is not None and value not in choices:
        raise DeepSpeedConfigError(
            f"DeepSpeed config {where} must be one of {list(choices)}. Received: {value!r}"
        )
    return value


def unsupported(where: str, value: Any, why: str) -> DeepSpeedConfigError:
    """The error for a DeepSpeed setting epl_trainer does not implement."""
    return DeepSpeedConfigError(
        f"DeepSpeed config {where}={value!r} is not supported by epl_trainer: {why}"
    )


def require_value(section: Mapping, key: str, accepted, where: str, why: str) -> None:
    """Accepts `key` only at the value(s) that need no feature we lack."""
    if key in section and section[key] not in accepted:
        raise unsupported(f"{where}.{key}" if where else key, section[key], why)


def is_off(value: Any) -> bool:
    """An optional DeepSpeed feature left off: null, false, {} or {"enabled": false, ...}."""
    if value is None or value is False:
        return True
    return isinstance(value, Mapping) and (not value or value.get("enabled") is False)
