"""Wire messages of dilocod: versioned msgpack schemas with strict, size-bounded validation.

Imports only the standard library and msgpack, so any component (or a third-party tool) can use it.
"""

from proto.data import (
    BULK_REPLY,
    DATA_REPLY,
    DATA_REQUEST,
    decode_bulk_reply,
    decode_data_reply,
    decode_data_request,
    encode_bulk_reply,
    encode_data_reply,
    encode_data_request,
)
from proto.records import (
    MANIFEST,
    ROUND_TICKET,
    STATE_META,
    STATUS,
    decode_manifest,
    decode_state_meta,
    decode_status,
    decode_ticket,
    encode_manifest,
    encode_state_meta,
    encode_status,
    encode_ticket,
)
from proto.schema import Field, ProtoError, Schema, decode, encode

__all__ = [
    "BULK_REPLY",
    "DATA_REPLY",
    "DATA_REQUEST",
    "MANIFEST",
    "ROUND_TICKET",
    "STATE_META",
    "STATUS",
    "Field",
    "ProtoError",
    "Schema",
    "decode",
    "decode_bulk_reply",
    "decode_data_reply",
    "decode_data_request",
    "decode_manifest",
    "decode_state_meta",
    "decode_status",
    "decode_ticket",
    "encode",
    "encode_bulk_reply",
    "encode_data_reply",
    "encode_data_request",
    "encode_manifest",
    "encode_state_meta",
    "encode_status",
    "encode_ticket",
]
