"""The state-parts protocol (`/dilocod/state/1.0.0`, peers/state/share.py): θ_global and the outer momentum
served in parts, so that a joiner downloads them from several donors at once.

A joiner first asks each donor for the **head** of the snapshot it serves: its `STATE_META`, the shape of
every tensor, the part size and the sha256 of every part. It then asks for **parts** by index, each from
one donor; the reply header is followed by the part's raw bytes (the tensors' fp32 bytes laid end to end,
in order), so the framing costs nothing per byte. A donor keeps the snapshot a joiner downloads from
until the joiner has stopped asking for it, even when its own state has moved on meanwhile.

See docs/protocol.md, "State parts".
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from proto.schema import Field, ProtoError, Schema, decode, encode

MAX_PARTS = 4096  # parts of one snapshot: 256 GB at 64 MiB a part
MAX_TENSORS = 100_000  # as STATE_META's num_tensors
MAX_PART_BYTES = 1 << 30
MAX_STATE_BYTES = 2**53
MAX_ERROR = 200
_SHAPE = re.compile(r"(0|[1-9][0-9]{0,11})(x(0|[1-9][0-9]{0,11})){0,7}|")  # "128x384"; "" is a scalar

STATE_REQUEST = Schema(
    name="dilocod.state.request",
    version=1,
    max_bytes=512,
    fields=(
        Field("kind", "str", choices=("head", "part")),
        Field("proof", "bytes", max=64),
        Field("snapshot", "hex", optional=True, min=64, max=64),
        Field("index", "int", optional=True, min=0, max=MAX_PARTS - 1),
    ),
)
"""A joiner's request: the head of the donor's current snapshot, or one part of a snapshot it named.

- kind: "head" or "part".
- proof: the requester's run-key proof (`RunAuth.member_proof` of its peer id; empty in a run without a
  secret). A donor serves the run's members only.
- snapshot (part): the id the donor's head gave; index (part): which part, from 0.
"""

STATE_HEAD = Schema(
    name="dilocod.state.head",
    version=1,
    max_bytes=1 << 20,
    fields=(
        Field("meta", "bytes", optional=True, max=4096),
        Field("snapshot", "hex", optional=True, min=64, max=64),
        Field("part_bytes", "int", optional=True, min=1, max=MAX_PART_BYTES),
        Field("total_bytes", "int", optional=True, min=0, max=MAX_STATE_BYTES),
        Field("shapes", "list_str", optional=True, max=MAX_TENSORS, item_max=120),
        Field("digests", "list_str", optional=True, max=MAX_PARTS, item_max=64),
        Field("error", "str", optional=True, min=1, max=MAX_ERROR),
    ),
)
"""The donor's answer to a head request: the snapshot a joiner may ask parts of, or why there is none.

- meta: the snapshot's `STATE_META` record (outer step, θ hash, tensor counts), as the whole-state
  download sends it.
- snapshot: the id to name in part requests (the donor's own; two donors' ids differ).
- part_bytes, total_bytes: the part size and the snapshot's size; part i covers bytes
  [i·part_bytes, min((i + 1)·part_bytes, total_bytes)). The part size follows the state's size
  (`peers.state.share.part_size`), so donors of one state declare the same parts.
- shapes: each tensor's shape ("128x384"), in order; fp32 throughout. Their sizes sum to total_bytes.
- digests: the sha256 of each part, hex. A joiner holds every donor to the list most of them declare.
- error: why nothing is served ("no state yet", "not a member", "busy"); a reply has either an error or
  all of the other fields.
"""

STATE_PART = Schema(
    name="dilocod.state.part",
    version=1,
    max_bytes=512,
    fields=(
        Field("index", "int", optional=True, min=0, max=MAX_PARTS - 1),
        Field("length", "int", optional=True, min=0, max=MAX_PART_BYTES),
        Field("error", "str", optional=True, min=1, max=MAX_ERROR),
    ),
)
"""The donor's answer to a part request, followed by `length` raw bytes (the part asked), or an error
("unknown snapshot": it no longer holds it; "bad request: …"; "busy")."""

_HEAD_FIELDS = ("meta", "snapshot", "part_bytes", "total_bytes", "shapes", "digests")


def encode_state_request(record: Mapping[str, Any]) -> bytes:
    _check_request(record)
    return encode(STATE_REQUEST, record)


def decode_state_request(data: bytes) -> dict[str, Any]:
    record = decode(STATE_REQUEST, data)
    _check_request(record)
    return record


def encode_state_head(record: Mapping[str, Any]) -> bytes:
    _check_head(record)
    return encode(STATE_HEAD, record)


def decode_state_head(data: bytes) -> dict[str, Any]:
    record = decode(STATE_HEAD, data)
    _check_head(record)
    return record


def encode_state_part(record: Mapping[str, Any]) -> bytes:
    _check_one_kind(STATE_PART, record, ("index", "length"))
    return encode(STATE_PART, record)


def decode_state_part(data: bytes) -> dict[str, Any]:
    record = decode(STATE_PART, data)
    _check_one_kind(STATE_PART, record, ("index", "length"))
    return record


def parse_shape(text: str) -> tuple[int, ...]:
    """ "128x384" → (128, 384); "" → () (a scalar)."""
    if not _SHAPE.fullmatch(text):
        raise ProtoError(f"{STATE_HEAD.name} v{STATE_HEAD.version}: field 'shapes': bad shape {text[:40]!r}")
    return tuple(int(d) for d in text.split("x")) if text else ()


def format_shape(shape: Sequence[int]) -> str:
    return "x".join(str(int(d)) for d in shape)


def _check_request(record: Mapping[str, Any]) -> None:
    where = f"{STATE_REQUEST.name} v{STATE_REQUEST.version}"
    is_part = record.get("kind") == "part"
    has = record.get("snapshot") is not None, record.get("index") is not None
    if is_part and not all(has):
        raise ProtoError(f"{where}: a part request needs both snapshot and index")
    if not is_part and any(has):
        raise ProtoError(f"{where}: a head request carries no snapshot or index")


def _check_head(record: Mapping[str, Any]) -> None:
    _check_one_kind(STATE_HEAD, record, _HEAD_FIELDS)
    if record.get("error") is not None:
        return
    where = f"{STATE_HEAD.name} v{STATE_HEAD.version}"
    total, part = record["total_bytes"], record["part_bytes"]
    elements = 0
    for text in record["shapes"]:
        count = 1
        for d in parse_shape(text):
            count *= d
        elements += count
    if 4 * elements != total:
        raise ProtoError(f"{where}: its shapes hold {4 * elements} bytes, not total_bytes {total}")
    if len(record["digests"]) != -(-total // part):
        raise ProtoError(f"{where}: {len(record['digests'])} digests for {-(-total // part)} parts")
    if any(len(d) != 64 or d.strip("0123456789abcdef") for d in record["digests"]):
        raise ProtoError(f"{where}: field 'digests': not all are sha256 hex digests")


def _check_one_kind(schema: Schema, record: Mapping[str, Any], fields: Sequence[str]) -> None:
    where = f"{schema.name} v{schema.version}"
    present = [record.get(name) is not None for name in fields]
    if record.get("error") is not None:
        if any(present):
            raise ProtoError(f"{where}: an error reply carries nothing else")
    elif not all(present):
        raise ProtoError(f"{where}: a reply without error needs {', '.join(fields)}")
