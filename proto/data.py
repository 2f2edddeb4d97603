"""The headers of the dataset-file protocol (`/dilocod/data/1.0.0`, peers/datashare.py), and the reply that
advertises a node's HTTP path for the same files (`/dilocod/data-bulk/1.0.0`, peers/databulk.py).

A request names one file of the run's prepared dataset and a byte range; the reply header says how large
the file is and how many raw bytes follow it, or why none do. The bytes themselves are not msgpack: they
follow the reply header as they are, so the framing costs nothing per byte.

See docs/protocol.md, "Dataset files".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proto.schema import Field, ProtoError, Schema, decode, encode

MAX_NAME = 255  # characters; a file name, never a path
MAX_FILE_BYTES = 2**53  # any real file; keeps offsets exact as floats in other tools
MAX_ERROR = 200

DATA_REQUEST = Schema(
    name="dilocod.data.request",
    version=1,
    max_bytes=512,
    fields=(
        Field("name", "str", min=1, max=MAX_NAME),
        Field("offset", "int", min=0, max=MAX_FILE_BYTES),
        Field("length", "int", optional=True, min=0, max=MAX_FILE_BYTES),
    ),
)
"""A request for the bytes of one dataset file from `offset` (to its end, or `length` bytes at most).

- name: the file's name as the dataset's index lists it (`train-00000.bin`), never a path: a name with
  "/", "\\", "..", a NUL or another control character is refused before the server looks it up.
- offset: the first byte wanted; a resumed download asks from the size of what it already holds.
- length (optional): how many bytes at most; absent means up to the end of the file.
"""

DATA_REPLY = Schema(
    name="dilocod.data.reply",
    version=1,
    max_bytes=512,
    fields=(
        Field("size", "int", optional=True, min=0, max=MAX_FILE_BYTES),
        Field("length", "int", optional=True, min=0, max=MAX_FILE_BYTES),
        Field("error", "str", optional=True, min=1, max=MAX_ERROR),
    ),
)
"""The server's answer to a DATA_REQUEST, followed by `length` raw bytes of the file from the offset asked.

- size: the whole file's size in bytes, so the requester can tell a different file from a short one.
- length: how many bytes follow this header; offset + length ≤ size.
- error: why nothing follows ("not found", "bad request: …", "busy", …). A reply has either an error
  or both size and length, never both kinds.
"""


BULK_REPLY = Schema(
    name="dilocod.data.bulk",
    version=1,
    max_bytes=64,
    fields=(Field("port", "int", optional=True, min=1, max=65535),),
)
"""A node's answer on `/dilocod/data-bulk/1.0.0` (to an empty request): the TCP port where it serves the same
dataset files over plain HTTP (peers/databulk.py).

- port (optional): the port; absent: no HTTP path. The requester joins it to the IP of its libp2p connection
  to this node: a node names no host, so it cannot send joiners to another machine.
"""


def name_problem(name: str) -> str | None:
    """Why `name` cannot be a dataset file name, or None. Shared by both sides so a client never asks for
    what a server would refuse, and a server never hands a path-like name to its lookup."""
    if not name or len(name) > MAX_NAME:
        return "empty or too long"
    if "/" in name or "\\" in name or ".." in name:
        return "a path, not a file name"
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "has control characters"
    return None


def encode_data_request(record: Mapping[str, Any]) -> bytes:
    _check_name(record.get("name"))
    return encode(DATA_REQUEST, record)


def decode_data_request(data: bytes) -> dict[str, Any]:
    record = decode(DATA_REQUEST, data)
    _check_name(record["name"])
    return record


def encode_data_reply(record: Mapping[str, Any]) -> bytes:
    _check_reply(record)
    return encode(DATA_REPLY, record)


def decode_data_reply(data: bytes) -> dict[str, Any]:
    record = decode(DATA_REPLY, data)
    _check_reply(record)
    return record


def encode_bulk_reply(record: Mapping[str, Any]) -> bytes:
    return encode(BULK_REPLY, record)


def decode_bulk_reply(data: bytes) -> dict[str, Any]:
    return decode(BULK_REPLY, data)


def _check_name(name: object) -> None:
    if isinstance(name, str) and (problem := name_problem(name)) is not None:
        raise ProtoError(f"{DATA_REQUEST.name} v{DATA_REQUEST.version}: field 'name': {problem}")


def _check_reply(record: Mapping[str, Any]) -> None:
    where = f"{DATA_REPLY.name} v{DATA_REPLY.version}"
    size, length, error = record.get("size"), record.get("length"), record.get("error")
    if error is not None:
        if size is not None or length is not None:
            raise ProtoError(f"{where}: an error reply carries no size or length")
        return
    if size is None or length is None:
        raise ProtoError(f"{where}: a reply without error needs both size and length")
    if isinstance(size, int) and isinstance(length, int) and length > size:
        raise ProtoError(f"{where}: field 'length': {length} is above the file's size {size}")
