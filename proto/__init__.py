"""Wire messages of dilocod: versioned msgpack schemas with strict, size-bounded validation.

Imports only the standard library and msgpack, so any component (or a third-party tool) can use it.
"""

from proto.data import (
    DATA_REPLY,
    DATA_REQUEST,
    decode_data_reply,
    decode_data_request,
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
from proto.state import (
    STATE_HEAD,
    STATE_PART,
    STATE_REQUEST,
    decode_state_head,
    decode_state_part,
    decode_state_request,
    encode_state_head,
    encode_state_part,
    encode_state_request,
)

__all__ = [
    "DATA_REPLY",
    "DATA_REQUEST",
    "MANIFEST",
    "ROUND_TICKET",
    "STATE_HEAD",
    "STATE_META",
    "STATE_PART",
    "STATE_REQUEST",
    "STATUS",
    "Field",
    "ProtoError",
    "Schema",
    "decode",
    "decode_data_reply",
    "decode_data_request",
    "decode_manifest",
    "decode_state_head",
    "decode_state_meta",
    "decode_state_part",
    "decode_state_request",
    "decode_status",
    "decode_ticket",
    "encode",
    "encode_data_reply",
    "encode_data_request",
    "encode_manifest",
    "encode_state_head",
    "encode_state_meta",
    "encode_state_part",
    "encode_state_request",
    "encode_status",
    "encode_ticket",
]
