"""The codec interface and the byte helpers every codec shares. Pure tensor code: torch + stdlib only.

A codec turns a 1-D fp32 CPU tensor into a payload of exactly `encoded_size(numel)` bytes and back.
The payload carries no header (no magic, no length, no codec id): the receiver knows the codec from
the group's config and `numel` from the schedule, so the only framing check is the exact length.

Determinism contract. `decode` is a pure function of `(data, numel)`: the same bytes decode to
bit-identical tensors on every machine. Every decoder here is a chain of exact operations (a bit
reinterpretation, an exact fp16→fp32 widening, or a small integer times a scale whose significand has
8 bits, which is exact in fp32), so no rounding mode, fused multiply-add, vector width or thread count
can change a bit. The one assumption is the default floating-point environment (no
`torch.set_flush_denormal(True)`), which the rest of dilocod's bit-identical θ_global already needs.
Decoders contain no reductions. Encoders are deterministic too (same input → same bytes on one
machine), but peers never need each other's encoder to agree: only what a payload decodes to matters.

Robustness contract. `decode` validates before it allocates: the length is checked against
`encoded_size(numel)` first (numel is the receiver's own number, never read from the payload), so a
stranger's bytes cost at most one copy of themselves. Any malformed payload (short, long, a non-finite
value, an out-of-range scale or code, nonzero padding bits) raises `CodecError` with a one-line
message; no other exception escapes for a well-typed call.

Non-finite input. `encode` raises `CodecError` on NaN or ±Inf anywhere in its input, so the caller
drops the round instead of averaging garbage into θ_global.
"""

from __future__ import annotations

import math
import sys
from abc import ABC, abstractmethod

import torch

_BIG_ENDIAN = sys.byteorder == "big"

Payload = bytes | bytearray | memoryview  # what decode accepts; encode always returns bytes


class CodecError(ValueError):
    """A payload that does not decode (malformed, truncated, extended) or an input that cannot be encoded."""


class Codec(ABC):
    """Encodes a 1-D fp32 CPU tensor to bytes and back. See the module docstring for the contracts."""

    name: str
    lossless: bool

    @abstractmethod
    def encoded_size(self, numel: int) -> int:
        """The exact byte count of `encode(x)` for any `x` with `numel` elements."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> bytes:
        """The payload for `x` (1-D float32 on the CPU, any length ≥ 0). Raises CodecError on NaN/Inf."""

    @abstractmethod
    def decode(self, data: Payload, numel: int) -> torch.Tensor:
        """A fresh 1-D float32 tensor of `numel` elements. Raises CodecError on any malformed `data`.

        Accepts bytes, bytearray or memoryview."""

    @property
    def wire_name(self) -> str:
        """What names the payload format in the round's group key: the name, with a format version where the
        layout changed under the same name."""
        return self.name

    @property
    def alignment(self) -> int:
        """Blocks start every `alignment` elements from the input's start: encoding the pieces of a split
        whose pieces start at multiples of it gives exactly what encoding the whole input gives."""
        return 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def check_input(x: torch.Tensor) -> torch.Tensor:
    """`x` as a contiguous 1-D fp32 CPU tensor; a wrong kind of tensor is the caller's bug (ValueError)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"codec input must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32 or x.dim() != 1 or x.device.type != "cpu":
        raise ValueError(
            f"codec input must be a 1-D float32 CPU tensor, got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    return x.detach().contiguous()


def all_finite(t: torch.Tensor) -> bool:
    """No NaN and no ±Inf in `t` (float). aminmax is one pass and propagates NaN; isfinite is slower."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def require_finite(t: torch.Tensor) -> None:
    """Raise CodecError if the float tensor `t` holds NaN or Inf."""
    if not all_finite(t):
        raise CodecError("cannot encode a tensor with NaN or Inf values")


def check_payload(data: Payload, numel: int, expected: int, name: str) -> None:
    """Validate the framing before anything is allocated from the payload."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodecError(f"{name} payload must be bytes, got {type(data).__name__}")
    size = memoryview(data).nbytes  # len() of a memoryview counts items, not bytes
    if size != expected:
        raise CodecError(f"{name} payload for {numel} elements must be {expected} bytes, got {size}")


def check_numel(numel: int) -> int:
    """`numel` as a non-negative int (bool is rejected: it is an int by accident, never a length)."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise CodecError(f"numel must be a non-negative int, got {numel!r}")
    return numel


def swap_bytes(u8: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Reverse the byte order of each `itemsize`-byte item of a flat uint8 tensor."""
    if itemsize == 1:
        return u8
    return u8.view(-1, itemsize).flip(1).contiguous().view(-1)


def to_le_bytes(t: torch.Tensor) -> bytes:
    """The little-endian bytes of a contiguous 1-D tensor (the wire is little-endian on every host)."""
    if t.numel() == 0:
        return b""
    u8 = t.contiguous().view(torch.uint8)
    if _BIG_ENDIAN:
        u8 = swap_bytes(u8, t.element_size())
    return u8.numpy().tobytes()


def payload_u8(data: Payload) -> torch.Tensor:
    """A uint8 tensor over a private copy of `data` (torch.frombuffer wants a writable buffer)."""
    # tobytes() also flattens a strided or multi-byte-item memoryview into its raw bytes.
    buf = bytearray(data) if isinstance(data, bytes | bytearray) else bytearray(memoryview(data).tobytes())
    if not buf:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buf, dtype=torch.uint8)


def le_view(u8: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret little-endian bytes (a uint8 tensor whose length is a multiple of the item size)."""
    if u8.numel() == 0:
        return torch.empty(0, dtype=dtype)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if _BIG_ENDIAN:
        u8 = swap_bytes(u8, itemsize)
    return u8.contiguous().view(dtype)
