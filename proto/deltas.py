"""The messages of the pseudo-gradient protocol (`/dilocod/delta/1.0.0`): a scorer asks a contributor for
the Δ it sent in a round, to score it (dilocod/trust/scoring.py).

A contributor keeps the encoded Δ of its last few rounds. The payload is the concatenation of the Δ's
tensors (the round's fragment only, with streaming) as one flat int4 payload (dilocod/codecs), sent in
parts of at most `PART_BYTES`, one request per part, so that no message is large whatever the model. The
reply also repeats what the contributor's ticket said the Δ covers (tokens and chunk parts), so that the
scorer knows which data to score it on.

See docs/protocol.md, "Pseudo-gradients for scoring".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proto.schema import Field, ProtoError, Schema, decode, encode

PART_BYTES = 4 * 2**20  # payload bytes in one reply at most
MAX_TENSORS = 4096  # tensor indices a reply may name (a fragment's)
MAX_SEGMENTS = 32  # chunk parts, as in a round ticket
MAX_POSITION = 2**53
MAX_ERROR = 200
CODECS = ("int4",)

DELTA_REQUEST = Schema(
    name="dilocod.delta.request",
    version=1,
    max_bytes=128,
    fields=(
        Field("outer_step", "int", min=0, max=MAX_POSITION),
        Field("part", "int", min=0, max=2**31),
    ),
)
"""A scorer's request: part `part` of the Δ the contributor sent at outer step `outer_step`."""

DELTA_REPLY = Schema(
    name="dilocod.delta.reply",
    version=1,
    max_bytes=PART_BYTES + 4096,
    fields=(
        Field("outer_step", "int", optional=True, min=0, max=MAX_POSITION),
        Field("codec", "str", optional=True, choices=CODECS),
        Field("numel", "int", optional=True, min=0, max=MAX_POSITION),
        Field("parts", "int", optional=True, min=1, max=2**31),
        Field("part", "int", optional=True, min=0, max=2**31),
        Field("payload", "bytes", optional=True, max=PART_BYTES),
        Field("indices", "list_int", optional=True, max=MAX_TENSORS, item_max=MAX_TENSORS),
        Field("tokens", "int", optional=True, min=0, max=MAX_POSITION),
        Field("chunks", "list_int", optional=True, max=4 * MAX_SEGMENTS, item_max=MAX_POSITION),
        Field("error", "str", optional=True, min=1, max=MAX_ERROR),
    ),
)
"""The contributor's answer, or why not (`error`, e.g. it no longer keeps that round).

- outer_step: the round (the θ_global the Δ is measured from).
- codec: how `payload` is encoded ("int4": dilocod/codecs/quant.py, with its blocks over the whole flat Δ).
- numel: elements of the whole flat Δ; parts: how many parts it is cut into; part: which this one is
  (parts split the encoded bytes, so the concatenated payloads decode as one).
- indices: the tensors of θ_global the Δ covers, in order (absent: all of them).
- tokens, chunks: what its round ticket claimed the Δ covers ((epoch, chunk, lo, hi) groups).
"""

_DATA = ("outer_step", "codec", "numel", "parts", "part", "payload", "tokens")


def encode_delta_request(record: Mapping[str, Any]) -> bytes:
    return encode(DELTA_REQUEST, record)


def decode_delta_request(data: bytes) -> dict[str, Any]:
    return decode(DELTA_REQUEST, data)


def encode_delta_reply(record: Mapping[str, Any]) -> bytes:
    _check_reply(record)
    return encode(DELTA_REPLY, record)


def decode_delta_reply(data: bytes) -> dict[str, Any]:
    record = decode(DELTA_REPLY, data)
    _check_reply(record)
    return record


def _check_reply(record: Mapping[str, Any]) -> None:
    where = f"{DELTA_REPLY.name} v{DELTA_REPLY.version}"
    error = record.get("error")
    present = [k for k in _DATA if record.get(k) is not None]
    if error is not None:
        if present:
            raise ProtoError(f"{where}: an error reply carries no Δ (it has {', '.join(present)})")
        return
    missing = [k for k in _DATA if record.get(k) is None]
    if missing:
        raise ProtoError(f"{where}: missing {', '.join(missing)}")
    if record["part"] >= record["parts"]:
        raise ProtoError(f"{where}: part {record['part']} of {record['parts']}")
    chunks = record.get("chunks")
    if chunks is not None:
        if len(chunks) % 4:
            raise ProtoError(f"{where}: field 'chunks': {len(chunks)} items, not groups of 4")
        for i in range(0, len(chunks), 4):
            if chunks[i + 2] >= chunks[i + 3]:
                raise ProtoError(f"{where}: field 'chunks': a part with lo >= hi")
