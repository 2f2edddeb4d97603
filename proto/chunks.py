"""The messages of the chunk-schedule protocol (`/dilocod/chunks/1.0.0`): a trainer and the run's chunk
coordinator keep each other's view of the trainer's chunk leases current.

The run's training split is cut into chunks (dilocod/data/schedule.py). A trainer holds a lease on one or
two chunks at a time; it reports how far into each it has trained, and asks for leases up to the number
it wants. The coordinator answers with every lease the trainer holds after that report, with the offset
the coordinator has for each, so one request both renews leases and hands out new ones, and a trainer
that restarts learns what it still holds. Integers are flattened into lists of fixed-size groups.

See docs/protocol.md, "Chunk schedule".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proto.schema import Field, ProtoError, Schema, decode, encode

MAX_LEASES = 4  # leases one trainer may hold or ask for; the coordinator grants at most 2
MAX_TOKENS = 2**53  # positions in a train stream; exact as floats in other tools
MAX_ERROR = 200
HELD_GROUP = 3  # epoch, chunk, offset
LEASE_GROUP = 5  # epoch, chunk, lo, size, offset

CHUNK_REQUEST = Schema(
    name="dilocod.chunks.request",
    version=1,
    max_bytes=512,
    fields=(
        Field("held", "list_int", max=HELD_GROUP * MAX_LEASES, item_max=MAX_TOKENS),
        Field("want", "int", min=0, max=MAX_LEASES),
    ),
)
"""A trainer's report and request.

- held: for each lease the trainer believes it holds, (epoch, chunk, offset): the tokens of the chunk it
  has trained (offset = the chunk's size: finished).
- want: how many leases it wants to hold after this request (0: report only, e.g. when it stops).
"""

CHUNK_REPLY = Schema(
    name="dilocod.chunks.reply",
    version=1,
    max_bytes=1024,
    fields=(
        Field("leases", "list_int", optional=True, max=LEASE_GROUP * MAX_LEASES, item_max=MAX_TOKENS),
        Field("lease_seconds", "float", optional=True, min=0, max=1e7),
        Field("error", "str", optional=True, min=1, max=MAX_ERROR),
        # The run's progress through its dataset, so every trainer can show it.
        Field("epoch", "int", optional=True, min=0, max=MAX_TOKENS),
        Field("epoch_fraction", "float", optional=True, min=0, max=1),
        Field("tokens_trained", "int", optional=True, min=0, max=MAX_TOKENS),
        Field("chunks_trained", "int", optional=True, min=0, max=MAX_TOKENS),
        Field("chunks_total", "int", optional=True, min=0, max=MAX_TOKENS),
    ),
)
"""The coordinator's answer: every lease the trainer holds now, (epoch, chunk, lo, size, offset) each
(lo: where the chunk starts in the train stream; offset: the furthest point either side has reported),
how long a lease lives without a report, and the run's progress through the dataset (epoch, fraction of
it trained, tokens and chunks trained in all, chunks per epoch). Or why not (`error`). A lease the trainer named in `held`
and that is missing here is no longer its own (finished, or expired and handed on): it stops training it.
"""


def encode_chunk_request(record: Mapping[str, Any]) -> bytes:
    _check_groups(CHUNK_REQUEST, "held", record.get("held"), HELD_GROUP)
    return encode(CHUNK_REQUEST, record)


def decode_chunk_request(data: bytes) -> dict[str, Any]:
    record = decode(CHUNK_REQUEST, data)
    _check_groups(CHUNK_REQUEST, "held", record["held"], HELD_GROUP)
    return record


def encode_chunk_reply(record: Mapping[str, Any]) -> bytes:
    _check_reply(record)
    return encode(CHUNK_REPLY, record)


def decode_chunk_reply(data: bytes) -> dict[str, Any]:
    record = decode(CHUNK_REPLY, data)
    _check_reply(record)
    return record


def groups(values: list[int], size: int) -> list[tuple[int, ...]]:
    """[a, b, c, d, e, f] → [(a, b, c), (d, e, f)] for size 3."""
    return [tuple(values[i : i + size]) for i in range(0, len(values), size)]


def _check_groups(schema: Schema, name: str, values: object, size: int) -> None:
    if isinstance(values, list | tuple) and len(values) % size:
        raise ProtoError(
            f"{schema.name} v{schema.version}: field {name!r}: {len(values)} items, not groups of {size}"
        )


def _check_reply(record: Mapping[str, Any]) -> None:
    where = f"{CHUNK_REPLY.name} v{CHUNK_REPLY.version}"
    leases, error = record.get("leases"), record.get("error")
    if (leases is None) == (error is None):
        raise ProtoError(f"{where}: a reply carries either leases or an error")
    _check_groups(CHUNK_REPLY, "leases", leases, LEASE_GROUP)
    for _epoch, chunk, _lo, size, offset in groups(list(leases or []), LEASE_GROUP):
        if offset > size or size == 0:
            raise ProtoError(
                f"{where}: field 'leases': chunk {chunk} offset {offset} outside its size {size}"
            )
