"""Pseudo-gradient parts as codec payloads on hivemind's wire: framing, strict decoding, requantizing.

The codec itself is pure tensor code given by the caller (`dilocod.codecs` fits `PartCodec`); this module
only carries its bytes as a flat uint8 tensor in hivemind's uncompressed framing, so hivemind's closed
codec enum is not a limit, and turns anything malformed from a stranger into None rather than an error.
"""

from __future__ import annotations

from typing import Protocol

import torch
from hivemind.compression import CompressionBase, CompressionInfo, deserialize_torch_tensor
from hivemind.proto import runtime_pb2


class PartCodec(Protocol):
    """How parts travel when the run compresses them; pure tensor functions (`dilocod.codecs` fits).

    `encode` turns a 1-D fp32 CPU tensor into exactly `encoded_size(numel)` bytes and raises on NaN/Inf;
    `decode` turns such bytes back into `numel` fp32 values, bit-identically on every machine, and raises
    on anything malformed. Encoding is blockwise with blocks of `alignment` elements counted from the
    start of the input. `wire_name` identifies the payload format: peers only meet peers with the same one.
    """

    name: str

    @property
    def wire_name(self) -> str: ...

    @property
    def alignment(self) -> int: ...

    def encoded_size(self, numel: int) -> int: ...

    def encode(self, x: torch.Tensor) -> bytes: ...

    def decode(self, data: bytes | bytearray | memoryview, numel: int) -> torch.Tensor: ...


class CodecCompression(CompressionBase):
    """hivemind's hook for the sender's parts: each part goes out as its codec payload.

    The payload travels as a flat uint8 tensor in hivemind's uncompressed framing (`dtype` "uint8",
    `size` [payload bytes]), so hivemind can carry it and nothing in its closed codec enum is needed.
    The compression ratio reported to hivemind is 1: parts keep `part_size_bytes / 4` elements, so the
    split of every tensor into parts is the same whatever the codec.
    """

    compression_type = runtime_pb2.CompressionType.NONE

    def __init__(self, codec: PartCodec) -> None:
        self.codec = codec

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> runtime_pb2.Tensor:
        return payload_message(encode_or_empty(self.codec, tensor))

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return deserialize_torch_tensor(serialized_tensor)  # the payload as a uint8 tensor

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 1.0


def encode_or_empty(codec: PartCodec, part: torch.Tensor) -> bytes:
    """The part's payload; an empty one if it cannot be encoded (NaN/Inf), which every reducer screens out."""
    try:
        return codec.encode(part.detach().reshape(-1).to(torch.float32).contiguous())
    except Exception:
        return b""


def payload_message(payload: bytes) -> runtime_pb2.Tensor:
    return runtime_pb2.Tensor(
        compression=runtime_pb2.CompressionType.NONE,
        buffer=payload,
        size=[len(payload)],
        dtype="uint8",
        requires_grad=False,
    )


def decode_message(codec: PartCodec, message: runtime_pb2.Tensor, numel: int) -> torch.Tensor | None:
    """A stranger's part payload decoded to `numel` fp32 values, or None if it is malformed in any way."""
    try:
        framed = (
            message.compression == runtime_pb2.CompressionType.NONE
            and message.dtype == "uint8"
            and list(message.size) == [len(message.buffer)]
        )
        return codec.decode(message.buffer, numel) if framed else None
    except Exception:  # a malformed payload is screened out, never raised
        return None


def decode_payload_tensor(codec: PartCodec, payload: torch.Tensor, numel: int) -> torch.Tensor | None:
    """An averaged part that hivemind already deserialized (it must be the flat uint8 payload), decoded."""
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        return None
    try:
        return codec.decode(payload.contiguous().numpy().tobytes(), numel)
    except Exception:
        return None


def requantize(codec: PartCodec, part: torch.Tensor) -> tuple[torch.Tensor, bytes]:
    """(decode(encode(part)), encode(part)); a part that cannot be encoded becomes zeros, like a failed check."""
    flat = part.reshape(-1).to(torch.float32).contiguous()
    try:
        payload = codec.encode(flat)
    except Exception:
        payload = codec.encode(torch.zeros_like(flat))
    return codec.decode(payload, flat.numel()).reshape(part.shape), payload
