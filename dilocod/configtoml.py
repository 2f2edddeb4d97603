"""Reading a config: a TOML file and `--set section.key=value` overrides, type-checked strictly against the
frozen dataclasses of `dilocod.config` (unknown keys, wrong types and bad values are one-line errors)."""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A bad config file, key or value; the message is one line naming it."""


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None


def apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) != 2 or not all(parts):
        raise ConfigError(f"bad --set '{item}': expected section.key=value")
    section, name = parts
    value: Any
    try:  # a TOML literal (number, bool, quoted string, array); otherwise the bare text is a string
        value = _Bare(text.strip(), tomllib.loads(f"v = {text.strip()}")["v"])
    except tomllib.TOMLDecodeError:
        value = text.strip()
    target = raw.setdefault(section, {})
    if not isinstance(target, dict):
        raise ConfigError(f"bad --set '{item}': '{section}' is not a section")
    target[name] = value


def build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"config section '{prefix.rstrip('.') or 'root'}' must be a table")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in known:
            raise ConfigError(f"unknown config key '{prefix}{key}'")
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            values[f.name] = build(typing.cast(type, hint), raw[f.name], f"{f.name}.")
        else:
            values[f.name] = _coerce(raw[f.name], hint, f"{prefix}{f.name}")
    return cls(**values)


@dataclass(frozen=True)
class _Bare:
    """A `--set` value as typed and as TOML reads it: `--set adversary.mode=nan` is the string "nan"
    for a string key but NaN for a float key, `--set run.id=2024` the string "2024" for run.id."""

    text: str
    parsed: Any


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Accept `value` for a field of type `hint`, strictly (a bool is not a number, 1.5 is not an int)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, typing.get_args(hint), key)
    if isinstance(value, _Bare):
        value = value.text if hint is str and not isinstance(value.parsed, str) else value.parsed
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hint is str and isinstance(value, str):
        return value
    if origin is tuple and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    expected = _EXPECTED.get(hint, "a list of strings" if origin is tuple else str(hint))
    raise ConfigError(f"config key '{key}' must be {expected}, got {value!r}")


def _coerce_union(value: Any, options: tuple[Any, ...], key: str) -> Any:
    """The first option that accepts `value`, in declaration order (`int | str`: `--set x=2` is 2, `x=auto`
    is "auto"); with str the last resort, a bare `--set` word is text rather than what TOML makes of it."""
    parsed = value.parsed if isinstance(value, _Bare) else value
    if parsed is None and type(None) in options:
        return None
    kinds = [option for option in options if option is not type(None)]
    for option in kinds:
        if option is str and isinstance(value, _Bare):
            return value.text if not isinstance(value.parsed, str) else value.parsed
        try:
            return _coerce(value, option, key)
        except ConfigError:
            continue
    if len(kinds) == 1:
        return _coerce(value, kinds[0], key)  # raises the single type's own message
    expected = " or ".join(_EXPECTED.get(option, str(option)) for option in kinds)
    raise ConfigError(f"config key '{key}' must be {expected}, got {parsed!r}")


_EXPECTED = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
