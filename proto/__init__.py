"""Wire messages of dilocod: versioned msgpack schemas with strict, size-bounded validation.

Imports only the standard library and msgpack, so any component (or a third-party tool) can use it.
"""

from proto.records import (
    ROUND_TICKET,
    STATE_META,
    STATUS,
    decode_state_meta,
    decode_status,
    decode_ticket,
    encode_state_meta,
    encode_status,
    encode_ticket,
)
from proto.schema import Field, ProtoError, Schema, decode, encode

__all__ = [
    "ROUND_TICKET",
    "STATE_META",
    "STATUS",
    "Field",
    "ProtoError",
    "Schema",
    "decode",
    "decode_state_meta",
    "decode_status",
    "decode_ticket",
    "encode",
    "encode_state_meta",
    "encode_status",
    "encode_ticket",
]
