"""A tiny declarative schema system for the msgpack messages peers exchange.

Peers are strangers and some of them lie, so `decode` treats its input as hostile: any bytes at all
either become a record that satisfies the schema or raise `ProtoError` with a one-line reason. The
size of the input is checked before msgpack sees it, and msgpack is told how large a container may
claim to be, so a short message cannot make us allocate much.

Each message is a msgpack map: the envelope keys `_s` (schema name) and `_v` (schema version) plus
the schema's fields. Keys starting with `_` are reserved for the envelope.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import msgpack

KINDS = frozenset({"int", "float", "str", "bytes", "bool", "hex", "list_str", "list_int"})

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_HEX_RE = re.compile(r"[0-9a-f]*")

# Extra room in the msgpack container limits beyond what a valid record needs, so that a record
# with a few unknown fields or a slightly too long list still decodes far enough to get a precise
# error naming the field, while a hostile length prefix is still refused up front.
_CONTAINER_SLACK = 16

# Untrusted values end up in error messages; keep those messages short and on one line.
_MAX_SHOWN = 60


class ProtoError(ValueError):
    """A message (incoming or outgoing) does not satisfy its schema."""


@dataclass(frozen=True)
class Field:
    """One field of a schema.

    `min`/`max` bound the value of numeric kinds and the length of str/bytes/hex (characters or
    bytes) and of lists (number of items); `item_max` bounds the length of each list_str item and the
    value of each list_int item (list_int items are ints from 0 to `item_max`).
    """

    name: str
    kind: str
    optional: bool = False
    min: float | None = None
    max: float | None = None
    item_max: int = 256
    choices: tuple[str, ...] | None = None
    allow_nan: bool = False

    def __post_init__(self) -> None:
        # These are programming errors in a schema definition, caught at import time.
        if self.kind not in KINDS:
            raise ValueError(f"field {self.name!r}: unknown kind {self.kind!r}")
        if not self.name or self.name.startswith("_"):
            raise ValueError(f"field name {self.name!r} is empty or reserved (leading '_')")
        if self.choices is not None and self.kind != "str":
            raise ValueError(f"field {self.name!r}: choices only apply to kind 'str'")
        if self.allow_nan and self.kind != "float":
            raise ValueError(f"field {self.name!r}: allow_nan only applies to kind 'float'")


@dataclass(frozen=True)
class Schema:
    """A versioned message type with a hard bound on its encoded size."""

    name: str
    version: int
    fields: tuple[Field, ...]
    max_bytes: int
    # The oldest version still accepted. A message whose meaning changed (a ticket whose weight now comes
    # from a field older senders lack) raises it, so old senders are refused by name instead of misread.
    min_version: int = 1

    def __post_init__(self) -> None:
        if self.version < 1:
            raise ValueError(f"schema {self.name!r}: version must be >= 1")
        if not 1 <= self.min_version <= self.version:
            raise ValueError(f"schema {self.name!r}: min_version must be in 1..version")
        if self.max_bytes < 1:
            raise ValueError(f"schema {self.name!r}: max_bytes must be >= 1")
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise ValueError(f"schema {self.name!r}: duplicate field names")


class _Invalid(Exception):
    """Raised by the per-kind checkers; the caller adds schema and field to the message."""


class _Pairs(list[tuple[Any, Any]]):
    """A decoded msgpack map kept as key/value pairs, so that duplicate keys can be rejected."""


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def _fail(schema: Schema, field: str | None, problem: str) -> NoReturn:
    where = f"{schema.name} v{schema.version}"
    if field is not None:
        where += f": field {field!r}"
    raise ProtoError(f"{where}: {problem}")


def _type_name(value: Any) -> str:
    return type(value).__name__


# ---------------------------------------------------------------- per-kind checks


def _check_bounds(field: Field, amount: float, what: str) -> None:
    # NaN compares false both ways, so it passes bounds; whether NaN is allowed is decided earlier.
    if field.min is not None and amount < field.min:
        raise _Invalid(f"{what} {_show(amount)} is below the minimum {_show(field.min)}")
    if field.max is not None and amount > field.max:
        raise _Invalid(f"{what} {_show(amount)} is above the maximum {_show(field.max)}")


def _is_int(value: Any) -> bool:
    # bool is a subclass of int in Python but a different msgpack type; never accept it as a number.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(field: Field, value: Any) -> int:
    if not _is_int(value):
        raise _Invalid(f"expected int, got {_type_name(value)}")
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise _Invalid(f"value {_show(value)} does not fit in int64")
    _check_bounds(field, value, "value")
    return int(value)


def _check_float(field: Field, value: Any) -> float:
    # Ints are accepted for float fields (some encoders pack 0.0 as 0); they are normalised to float.
    if _is_int(value):
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise _Invalid(f"value {_show(value)} does not fit in int64")
        value = float(value)
    elif not isinstance(value, float):
        raise _Invalid(f"expected float, got {_type_name(value)}")
    if math.isinf(value):
        raise _Invalid(f"value {value} is not finite")
    if math.isnan(value) and not field.allow_nan:
        raise _Invalid("value is NaN, which this field does not allow")
    _check_bounds(field, value, "value")
    return float(value)


def _check_str(field: Field, value: Any) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"expected str, got {_type_name(value)}")
    _check_bounds(field, len(value), "length")
    if field.choices is not None and value not in field.choices:
        raise _Invalid(f"value {_show(value)} is not one of {field.choices}")
    return str(value)


def _check_hex(field: Field, value: Any) -> str:
    text = _check_str(field, value)
    if not _HEX_RE.fullmatch(text):
        raise _Invalid(f"value {_show(text)} is not a lowercase hex string")
    return text


def _check_bytes(field: Field, value: Any) -> bytes:
    if not isinstance(value, bytes | bytearray):
        raise _Invalid(f"expected bytes, got {_type_name(value)}")
    _check_bounds(field, len(value), "length")
    return bytes(value)


def _check_bool(field: Field, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Invalid(f"expected bool, got {_type_name(value)}")
    return value


def _check_list_str(field: Field, value: Any) -> list[str]:
    # Exact types only: a decoded msgpack map is a list subclass (_Pairs) and must not pass.
    if type(value) not in (list, tuple):
        raise _Invalid(f"expected list of str, got {_type_name(value)}")
    _check_bounds(field, len(value), "number of items")
    items: list[str] = []
    for index, item in enumerate(value):
        if not isinstance(item, str):
            raise _Invalid(f"item {index}: expected str, got {_type_name(item)}")
        if len(item) > field.item_max:
            raise _Invalid(f"item {index}: length {len(item)} is above the maximum {field.item_max}")
        items.append(str(item))
    return items


def _check_list_int(field: Field, value: Any) -> list[int]:
    if type(value) not in (list, tuple):  # exact types, as for list_str
        raise _Invalid(f"expected list of int, got {_type_name(value)}")
    _check_bounds(field, len(value), "number of items")
    for index, item in enumerate(value):
        if not _is_int(item):
            raise _Invalid(f"item {index}: expected int, got {_type_name(item)}")
        if not 0 <= item <= field.item_max:
            raise _Invalid(f"item {index}: value {_show(item)} is outside 0..{field.item_max}")
    return [int(item) for item in value]


_CHECKERS: dict[str, Callable[[Field, Any], Any]] = {
    "int": _check_int,
    "float": _check_float,
    "str": _check_str,
    "hex": _check_hex,
    "bytes": _check_bytes,
    "bool": _check_bool,
    "list_str": _check_list_str,
    "list_int": _check_list_int,
}


# ---------------------------------------------------------------- records


def _validate_fields(schema: Schema, record: Mapping[Any, Any]) -> dict[str, Any]:
    """Checks every field of `record` (without envelope) and returns the normalised values."""
    known = {f.name for f in schema.fields}
    for key in record:
        if key not in known:
            _fail(schema, _show(key) if not isinstance(key, str) else key, "unknown field")
    values: dict[str, Any] = {}
    for field in schema.fields:
        values[field.name] = _validate_one(schema, field, record)
    return values


def _validate_one(schema: Schema, field: Field, record: Mapping[Any, Any]) -> Any:
    if field.name not in record:
        if field.optional:
            return None
        _fail(schema, field.name, "missing required field")
    value = record[field.name]
    if value is None:
        if field.optional:
            return None
        _fail(schema, field.name, "is null but the field is not optional")
    try:
        return _CHECKERS[field.kind](field, value)
    except _Invalid as exc:
        _fail(schema, field.name, str(exc))


def encode(schema: Schema, record: Mapping[str, Any]) -> bytes:
    """Validates `record` against `schema` and packs it with its envelope.

    Bad outgoing records raise ProtoError too: better to fail loudly here than to publish something
    every other peer will reject. Optional fields that are None are left out of the encoding.
    """
    if not isinstance(record, Mapping):
        _fail(schema, None, f"record must be a mapping, got {_type_name(record)}")
    values = _validate_fields(schema, record)
    body: dict[str, Any] = {"_s": schema.name, "_v": schema.version}
    body.update((name, value) for name, value in values.items() if value is not None)
    try:
        data = msgpack.packb(body, use_bin_type=True)
    except (ValueError, TypeError, OverflowError) as exc:
        # Validation passed, so this is e.g. a str with a lone surrogate that UTF-8 cannot encode.
        _fail(schema, None, f"cannot pack record: {_show(str(exc))}")
    if len(data) > schema.max_bytes:
        _fail(schema, None, f"encoded size {len(data)} bytes exceeds the limit of {schema.max_bytes}")
    return bytes(data)


def _unpack_limits(schema: Schema) -> dict[str, int]:
    """msgpack container limits: no valid record needs more, and these cap what a header can claim."""
    limit = schema.max_bytes
    list_items = [
        int(f.max) if f.max is not None else limit
        for f in schema.fields
        if f.kind in ("list_str", "list_int")
    ]
    longest_list = max(list_items, default=0)
    return {
        "max_str_len": limit,
        "max_bin_len": limit,
        "max_ext_len": limit,
        "max_array_len": min(limit, longest_list + _CONTAINER_SLACK),
        "max_map_len": min(limit, len(schema.fields) + 2 + _CONTAINER_SLACK),
    }


def _unpack(schema: Schema, data: bytes) -> Any:
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            object_pairs_hook=_Pairs,
            **_unpack_limits(schema),
        )
    except Exception as exc:
        # Whatever msgpack raises on hostile input (format, incomplete, extra data, nesting depth,
        # bad UTF-8, limits, ...) means the same thing to us: not a valid message.
        _fail(schema, None, f"not valid msgpack: {type(exc).__name__}: {_show(str(exc))}")


def _pairs_to_dict(schema: Schema, pairs: _Pairs) -> dict[Any, Any]:
    # Duplicate keys would let two decoders disagree about a record; refuse them outright.
    result: dict[Any, Any] = {}
    for key, value in pairs:
        if key in result:
            _fail(schema, _show(key) if not isinstance(key, str) else key, "duplicate key")
        result[key] = value
    return result


def _check_envelope(schema: Schema, fields: dict[Any, Any]) -> None:
    """Removes `_s` and `_v` from `fields` after checking them."""
    if "_s" not in fields:
        _fail(schema, "_s", "missing schema name")
    name = fields.pop("_s")
    if name != schema.name:
        _fail(schema, "_s", f"wrong schema {_show(name)}, expected {schema.name!r}")
    if "_v" not in fields:
        _fail(schema, "_v", "missing schema version")
    version = fields.pop("_v")
    if not _is_int(version):
        _fail(schema, "_v", f"expected int, got {_type_name(version)}")
    if version > schema.version:
        _fail(schema, "_v", f"unsupported version {_show(version)} (newest known is {schema.version})")
    if version < 1:
        _fail(schema, "_v", f"invalid version {_show(version)}")
    if version < schema.min_version:
        _fail(
            schema,
            "_v",
            f"version {_show(version)} is no longer accepted (oldest accepted is {schema.min_version}): "
            "the sender runs an older dilocod",
        )


def decode(schema: Schema, data: bytes) -> dict[str, Any]:
    """Decodes untrusted bytes into a plain dict of the schema's fields, or raises ProtoError.

    Optional fields that are absent come back as None. Records with an older version are accepted
    (fields added since then are optional) down to the schema's `min_version`; records with a newer
    version, or older than `min_version`, are rejected.
    """
    if not isinstance(data, bytes):
        _fail(schema, None, f"expected bytes, got {_type_name(data)}")
    # Checked before unpacking so that oversized input costs nothing.
    if len(data) > schema.max_bytes:
        _fail(schema, None, f"message is {len(data)} bytes, above the limit of {schema.max_bytes}")
    top = _unpack(schema, data)
    if not isinstance(top, _Pairs):
        _fail(schema, None, f"top level must be a map, got {_type_name(top)}")
    fields = _pairs_to_dict(schema, top)
    _check_envelope(schema, fields)
    return _validate_fields(schema, fields)
