"""The codecs: `none`, `fp16`, and blockwise `int8` / `int4` / `int2`. Pure tensor code.

All multi-byte values on the wire are little-endian. n = numel, B = block size, nb = ⌈n/B⌉.

none — raw fp32, lossless. Layout: n × float32. Size 4n.
    Decode rejects NaN/Inf (the encoder never sends them).

fp16 — IEEE binary16. Layout: n × float16. Size 2n.
    Encode rounds to nearest-even after clamping to ±65504, so a value beyond the fp16 range
    saturates to ±65504 instead of becoming ±Inf. Error: |x − x̂| ≤ 2^-11·|x| for 2^-14 ≤ |x| ≤ 65504,
    ≤ 2^-25 below (fp16 subnormals), |x| − 65504 above. Decode rejects Inf/NaN half patterns.

int8 / int4 / int2 — blockwise quantization, one scale per block of B consecutive elements (the last
block may be short). Layout: nb scales (2 bytes each), then the n codes packed densely, so the size is
    2·nb + ⌈n·bits/8⌉    (int8 B=256: 1.0078 B/elem; int4 B=64: 0.53125; int2 B=64: 0.28125).
The scale d is a bfloat16 (the top 16 bits of an fp32) rounded *up* from absmax/top, where absmax is the
block's largest |x| and top the largest level in units of d. bf16 rather than fp16 because it has
fp32's exponent range (a block of 1e-6 or 1e30 values keeps a usable scale) at the same 2 bytes; its
8-bit significand costs < 2^-7 of resolution, and rounding up keeps the top level ≥ absmax. Scales
below fp32's smallest normal (2^-126) become 0 (the block decodes to zeros), so no decoded value is
ever subnormal; the scale is capped so that top·d is finite. The decoder rejects a scale with the sign
bit set, a subnormal, or one above the cap.

    int8 — mid-tread: code c ∈ [−127, 127] stored as a two's-complement byte, x̂ = c·d,
        d ≈ absmax/127. Zero is exact, so entries that did not move stay at zero without error
        feedback (int8 is the codec meant to run without it). Code −128 is rejected by the decoder.
        Error: |x − x̂| ≤ d/2·(1 + 2^-15).
    int4 / int2 — mid-rise: code k ∈ [0, 2^b − 1], x̂ = (2k − (2^b − 1))·d, i.e. the 2^b levels are
        the odd multiples of d: {±d, ±3d} for int2 (= {±s/3, ±s} with s ≈ absmax), ±d … ±15d for int4,
        d ≈ absmax/(2^b − 1). Every code buys a level (mid-tread would spend one of int2's four codes on
        nothing and give {−s, 0, s} with twice the worst-case error); there is no exact zero, which
        error feedback, run with these codecs, corrects over rounds. Codes are packed low bits
        first: element i sits in byte i // (8/b) at bit (i mod (8/b))·b; unused high bits of the last
        byte must be zero. Error: |x − x̂| ≤ d·(1 + 2^-15).
    For all three, d ≤ (absmax/top)·(1 + 2^-7)·(1 + 2^-23) with top = 127, 15, 3: the worst case is
    ≈ absmax/254, absmax/15, absmax/3. Exceptions: a block with absmax/top < 2^-126 decodes to zeros
    (error ≤ absmax), and the bound is not promised for |x| within 2^-7 of fp32's maximum, where the
    scale is capped. Rounding is deterministic (round-to-nearest), never stochastic: it is the encoder's
    output that peers share, and error feedback already removes the bias that stochastic rounding would.

Decode is exact arithmetic: x̂ = (small integer) × (scale with an 8-bit significand) fits in fp32's
24-bit significand and never leaves the normal range, so the result has no rounding at all and is
identical on every machine.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

import torch

from dilocod.codecs.base import (
    Codec,
    CodecError,
    Payload,
    all_finite,
    check_input,
    check_numel,
    check_payload,
    le_view,
    payload_u8,
    require_finite,
    to_le_bytes,
)

CODEC_NAMES = ("none", "fp16", "int8", "int4", "int2")
DEFAULT_BLOCK_SIZE = {"int8": 256, "int4": 64, "int2": 64}
# The codecs a peer runs with error feedback: the coarse ones, whose per-round bias would otherwise
# stall training (fp16 and int8 are fine without; see dilocod.codecs.feedback).
FEEDBACK_CODECS = ("int4", "int2")

FP16_MAX = 65504.0
_FP32_MAX = 3.4028234663852886e38
_MIN_NORMAL_BITS = 0x00800000  # fp32 bit pattern of 2^-126
_MIN_NORMAL_BF16 = _MIN_NORMAL_BITS >> 16


class NoneCodec(Codec):
    """Raw little-endian fp32: the reference every lossy codec is measured against."""

    name = "none"
    lossless = True

    def encoded_size(self, numel: int) -> int:
        return 4 * check_numel(numel)

    def encode(self, x: torch.Tensor) -> bytes:
        x = check_input(x)
        require_finite(x)
        return to_le_bytes(x)

    def decode(self, data: Payload, numel: int) -> torch.Tensor:
        check_payload(data, numel, self.encoded_size(numel), self.name)
        out = le_view(payload_u8(data), torch.float32)
        if not all_finite(out):
            raise CodecError("none payload holds NaN or Inf")
        return out


class Fp16Codec(Codec):
    """IEEE half precision, saturating at ±65504."""

    name = "fp16"
    lossless = False

    def encoded_size(self, numel: int) -> int:
        return 2 * check_numel(numel)

    def encode(self, x: torch.Tensor) -> bytes:
        x = check_input(x)
        require_finite(x)
        # Clamp first: the cast alone would turn anything ≥ 65520 into Inf.
        return to_le_bytes(x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16))

    def decode(self, data: Payload, numel: int) -> torch.Tensor:
        check_payload(data, numel, self.encoded_size(numel), self.name)
        out = le_view(payload_u8(data), torch.float16).to(torch.float32)  # widening is exact
        if not all_finite(out):
            raise CodecError("fp16 payload holds NaN or Inf")
        return out


def _bf16_value(bits16: int) -> float:
    return float(struct.unpack("<f", struct.pack("<I", bits16 << 16))[0])


def _max_scale_bits(top: int) -> int:
    """The largest bf16 pattern d with top·d ≤ fp32 max, so no decoded value overflows."""
    bits = struct.unpack("<I", struct.pack("<f", _FP32_MAX / top))[0] >> 16
    while _bf16_value(bits) * top > _FP32_MAX:  # exact in float64: 8-bit × 4-bit significands
        bits -= 1
    return bits


def _blockwise(
    x: torch.Tensor,
    per_block: torch.Tensor,
    size: int,
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """fn(rows of x, matching column of per_block) over the full blocks and the short tail, flattened.

    Works on views (no padding to nb·B), so a huge block size costs nothing extra.
    """
    full = x.numel() // size
    parts = []
    if full:
        parts.append(fn(x[: full * size].view(full, size), per_block[:full, None]).reshape(-1))
    if x.numel() > full * size:
        parts.append(fn(x[full * size :].view(1, -1), per_block[full:, None]).reshape(-1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _absmax(rows: torch.Tensor) -> torch.Tensor:
    """max |x| of each row, without materialising |x|. Both reductions and `maximum` propagate NaN.

    (Row-wise amax + amin is several times faster than row-wise aminmax on CPU.)
    """
    return torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_())


def _block_absmax(x: torch.Tensor, size: int) -> torch.Tensor:
    full = x.numel() // size
    parts = []
    if full:
        parts.append(_absmax(x[: full * size].view(full, size)))
    if x.numel() > full * size:
        parts.append(_absmax(x[full * size :].view(1, -1)))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class BlockQuantCodec(Codec):
    """int8 (mid-tread) or int4/int2 (mid-rise) with one bf16 scale per block; see the module docstring."""

    lossless = False

    def __init__(self, name: str, bits: int, block_size: int, midrise: bool) -> None:
        if bits not in (2, 4, 8):
            raise ValueError(f"bits must be 2, 4 or 8, got {bits}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.name = name
        self.bits = bits
        self.block_size = block_size
        self.midrise = midrise
        self.num_levels = 1 << bits
        # The largest level in units of d: the scale is absmax / top.
        self.top = self.num_levels - 1 if midrise else (self.num_levels >> 1) - 1
        self.per_byte = 8 // bits
        self.max_scale_bits = _max_scale_bits(self.top)
        self._shifts = torch.arange(0, 8, bits, dtype=torch.uint8)  # bit offset of each code in a byte

    def __repr__(self) -> str:
        return f"BlockQuantCodec({self.name!r}, block_size={self.block_size})"

    @property
    def alignment(self) -> int:
        return self.block_size

    def num_blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def encoded_size(self, numel: int) -> int:
        numel = check_numel(numel)
        return 2 * self.num_blocks(numel) + -(-numel * self.bits // 8)

    def encode(self, x: torch.Tensor) -> bytes:
        x = check_input(x)
        if x.numel() == 0:
            return b""
        absmax = _block_absmax(x, self.block_size)
        require_finite(absmax)  # the max propagates NaN, so this covers every element
        scale_bits = self._scale_bits(absmax)
        scale = (scale_bits << 16).view(torch.float32)
        # Dividing by 1 where the scale is 0 keeps the codes finite; they decode to 0 anyway.
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = _blockwise(x, safe, self.block_size, self._quantize)
        return to_le_bytes(scale_bits.to(torch.int16)) + self._pack(codes)

    def _scale_bits(self, absmax: torch.Tensor) -> torch.Tensor:
        """bf16 bit patterns (in int32) of absmax/top rounded up; 0 below the normal range; capped."""
        bits = torch.div(absmax, self.top).view(torch.int32)
        up = (bits + 0xFFFF) >> 16  # ceil(bits / 2^16): positive floats order like their bit patterns
        up = torch.where(bits < _MIN_NORMAL_BITS, torch.zeros_like(up), up)
        return up.clamp(max=self.max_scale_bits)

    def _quantize(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self.midrise:
            # Nearest odd multiple of d: k = ⌊x/(2d) + 2^b/2⌋, clamped to the code range.
            # In place after the division: fresh 16 MB buffers cost more than the arithmetic.
            k = torch.div(x, torch.mul(scale, 2.0)).add_(self.num_levels / 2).floor_()
            return k.clamp_(0, self.num_levels - 1).to(torch.uint8)
        return torch.div(x, scale).round_().clamp_(-self.top, self.top).to(torch.int8)

    def _pack(self, codes: torch.Tensor) -> bytes:
        if self.bits == 8:
            return to_le_bytes(codes)
        pad = -codes.numel() % self.per_byte
        if pad:
            codes = torch.cat([codes, torch.zeros(pad, dtype=torch.uint8)])
        cols = codes.view(-1, self.per_byte)
        packed = cols[:, 0].clone()
        for j in range(1, self.per_byte):
            packed.bitwise_or_(cols[:, j] << (j * self.bits))
        return to_le_bytes(packed)

    def decode(self, data: Payload, numel: int) -> torch.Tensor:
        check_payload(data, numel, self.encoded_size(numel), self.name)
        if numel == 0:
            return torch.empty(0, dtype=torch.float32)
        u8 = payload_u8(data)
        nb = self.num_blocks(numel)
        scale = self._decode_scales(u8[: 2 * nb])
        levels = self._unpack(u8[2 * nb :], numel)
        return _blockwise(levels, scale, self.block_size, torch.mul)  # exact: see the module docstring

    def _decode_scales(self, raw: torch.Tensor) -> torch.Tensor:
        bits = le_view(raw, torch.int16).to(torch.int32)
        ok = (bits == 0) | ((bits >= _MIN_NORMAL_BF16) & (bits <= self.max_scale_bits))
        if not bool(ok.all()):
            raise CodecError(f"{self.name} payload has a negative, subnormal or out-of-range scale")
        return (bits << 16).view(torch.float32)

    def _unpack(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        """The level of each element in units of d, as exact small integers in fp32."""
        if self.bits == 8:
            codes = raw.view(torch.int8)
            if bool((codes == -128).any()):
                raise CodecError("int8 payload has code -128")
            return codes.to(torch.float32)
        codes = ((raw[:, None] >> self._shifts) & (self.num_levels - 1)).view(-1)
        if bool(codes[numel:].any()):
            raise CodecError(f"{self.name} payload has nonzero padding bits")
        levels = codes[:numel].to(torch.float32)
        return levels.mul_(2.0).sub_(self.num_levels - 1)


def make_codec(name: str, block_size: int | None = None) -> Codec:
    """The codec for `averaging.compression`; `block_size` applies to int8/int4/int2 and is ignored otherwise."""
    if name == "none":
        return NoneCodec()
    if name == "fp16":
        return Fp16Codec()
    if name in DEFAULT_BLOCK_SIZE:
        bits = int(name[3:])
        size = DEFAULT_BLOCK_SIZE[name] if block_size is None else block_size
        return BlockQuantCodec(name, bits, size, midrise=bits < 8)
    raise ValueError(f"averaging.compression must be one of {', '.join(CODEC_NAMES)}, got {name!r}")


def bytes_per_element(codec: Codec, numel: int = 1 << 20) -> float:
    """Payload bytes per element at a large length (fp32 is 4.0); for logs and the benchmark table."""
    return codec.encoded_size(numel) / numel if numel else math.nan
