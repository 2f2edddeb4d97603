"""`topk`: the k largest-magnitude values of every chunk, their positions, and 2, 4 or 8 bits for each value.
Pure tensor code.

n = numel, C = chunk size, nc = ⌈n/C⌉ chunks (the last may be short, of length U), k values kept per chunk
(k_i = min(k, the chunk's length)), K = Σ k_i, L = ⌊log2(C/k)⌋ (0 when k > C/2; 6 for 64 of 4096), b = the
value bits.

Layout, little-endian throughout:
    the indices within their chunks, Elias–Fano coded (each chunk's indices strictly increasing):
        the L low bits of each of the K indices, chunk by chunk, packed low bits first into one bit
            stream;
        then each chunk's upper vector of k_i + ⌊(length − 1)/2^L⌋ + 1 bits, in which the chunk's i-th
            index (from 0) sets bit (index >> L) + i;
        the whole section zero-padded to a byte;
    then the K values as the blockwise codec with one block per chunk (`quant.BlockQuantCodec`, block
        size k): nc bf16 scales, then the K codes (b = 2 and 4 mid-rise, b = 8 mid-tread, as `int2`,
        `int4` and `int8`).
Size: ⌈(K·L + Σ upper widths)/8⌉ + 2·nc + ⌈K·b/8⌉. With C = 4096, k = 64 (1.56 %), b = 2: 8 + 2 bits per
kept value and a 16-bit scale per 64 of them, 0.0200 bytes an element against fp32's 4 (200×; int4 is
0.53, 7.5×; int2 0.28, 14×). Fixed 12-bit indices would cost 12 bits; a k-subset of 4096 positions holds
log2 C(4096, 64) / 64 = 7.4 bits of entropy an index, and Elias–Fano's 8 are within 0.6 of it while
keeping the payload's size fixed for a given n (an adaptive code such as Golomb–Rice on the gaps averages
about the same but varies with the data, and the part sizes of the exchange are agreed in advance).

Which k: a chunk's k largest |x|, ties broken by torch.topk (the encoder is deterministic on one machine;
receivers only need what the payload decodes to). Sorting each chunk's indices makes the payload
canonical and lets the decoder reject a repeated index with one comparison.

Decode is exact (the blockwise codec's levels times a bf16 scale, scattered into zeros), so every
receiver of a payload holds bit-identical values. It validates before it trusts: the exact length first,
then exactly k_i set bits in every upper vector, every index below its chunk's length and strictly
increasing within the chunk, zero padding bits,
and the blockwise codec's own checks of scales and codes; anything else raises `CodecError`.

The payload is fixed-size for a given n, so parts cut at multiples of C (`alignment`) encode exactly as
the whole does: the all-reduce's 131072-value parts are a multiple of every allowed chunk size.
"""

from __future__ import annotations

import torch

from dilocod.codecs.base import (
    Codec,
    CodecError,
    Payload,
    check_input,
    check_numel,
    check_payload,
    payload_u8,
    require_finite,
)
from dilocod.codecs.quant import BlockQuantCodec

TOPK_VALUE_BITS = (2, 4, 8)
DEFAULT_TOPK_CHUNK = 4096
DEFAULT_TOPK_DENSITY = 64 / 4096  # SparseLoCo's 64 of every 4,096
MAX_TOPK_CHUNK = 1 << 16  # an index of a chunk fits 16 bits


def topk_per_chunk(density: float, chunk: int) -> int:
    """k for a chunk of `chunk` values at `density`: rounded, at least 1, at most the chunk."""
    return min(chunk, max(1, round(density * chunk)))


class TopKCodec(Codec):
    """The k largest |x| of each chunk of C values, with their indices; see the module docstring."""

    lossless = False
    # The group's reducers relay these payloads rather than reduce them (`peers/partrelay.py`): a reduced part
    # holds the union of the senders' supports, which this format cannot carry.
    relays_parts = True

    def __init__(self, chunk: int = DEFAULT_TOPK_CHUNK, k: int = 64, value_bits: int = 2) -> None:
        for name, value in (("chunk", chunk), ("k", k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"topk {name} must be a positive integer, got {value!r}")
        if chunk > MAX_TOPK_CHUNK or k > chunk:
            raise ValueError(f"topk needs 1 <= k <= chunk <= {MAX_TOPK_CHUNK}, got k={k}, chunk={chunk}")
        if value_bits not in TOPK_VALUE_BITS:
            raise ValueError(f"topk value bits must be one of {TOPK_VALUE_BITS}, got {value_bits!r}")
        self.name = "topk"
        self.chunk, self.k, self.value_bits = chunk, k, value_bits
        # Elias–Fano: each index's low bits verbatim, its high part in unary; ⌊log2(C/k)⌋ low bits make the
        # index cost about 2 + log2(C/k) bits, within ~0.6 bit of the entropy of a k-subset's positions.
        self.low_bits = max(0, (chunk // k).bit_length() - 1)
        self.values = BlockQuantCodec(f"topk int{value_bits}", value_bits, k, midrise=value_bits < 8)

    def __repr__(self) -> str:
        return f"TopKCodec(chunk={self.chunk}, k={self.k}, value_bits={self.value_bits})"

    @property
    def wire_name(self) -> str:
        return "topk.ef"  # Elias–Fano indices; the fixed 12-bit layout before it was plain "topk"

    @property
    def alignment(self) -> int:
        return self.chunk

    def kept(self, numel: int) -> int:
        """K: how many values a payload for `numel` elements carries."""
        full, tail = divmod(check_numel(numel), self.chunk)
        return full * self.k + min(self.k, tail)

    def _layout(self, numel: int) -> tuple[int, int, int, int]:
        """(full chunks, the tail's length, the tail's k, the index section's bits) for `numel` elements."""
        full, tail = divmod(numel, self.chunk)
        k_tail = min(self.k, tail)
        bits = full * (self.k * self.low_bits + self._upper_width(self.chunk, self.k))
        if tail:
            bits += k_tail * self.low_bits + self._upper_width(tail, k_tail)
        return full, tail, k_tail, bits

    def _upper_width(self, length: int, kept: int) -> int:
        """The bits of a chunk's upper vector: one set bit per kept index, one clear bit per high value."""
        return kept + ((length - 1) >> self.low_bits) + 1

    def _index_bytes(self, numel: int) -> int:
        return -(-self._layout(numel)[3] // 8)

    def encoded_size(self, numel: int) -> int:
        return self._index_bytes(numel) + self.values.encoded_size(self.kept(numel))

    # ---- encode --------------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> bytes:
        x = check_input(x)
        if x.numel() == 0:
            return b""
        require_finite(x)
        indices, values = self.select(x)
        return self._pack_indices(indices, x.numel()) + self.values.encode(values)

    def select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(each kept value's index within its chunk, int64; the values), chunk by chunk, indices sorted."""
        full = x.numel() // self.chunk
        parts = []
        if full:
            parts.append(self._select_rows(x[: full * self.chunk].view(full, self.chunk)))
        if x.numel() > full * self.chunk:
            parts.append(self._select_rows(x[full * self.chunk :].view(1, -1)))
        indices = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        values = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        return indices, values

    def _select_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = min(self.k, rows.shape[1])
        top = torch.topk(rows.abs(), k, dim=1, sorted=False).indices
        top, _ = torch.sort(top, dim=1)
        return top.reshape(-1), torch.gather(rows, 1, top).reshape(-1)

    def _pack_indices(self, indices: torch.Tensor, numel: int) -> bytes:
        """The index section: every kept index's `low_bits` low bits (index order), then each chunk's upper
        vector (the i-th index of a chunk sets bit (index >> low_bits) + i of it), zero-padded to a byte."""
        full, tail, k_tail, total = self._layout(numel)
        kept = indices.numel()
        bits = torch.zeros(-(-total // 8) * 8, dtype=torch.uint8)
        low = bits[: kept * self.low_bits].view(kept, self.low_bits)
        for j in range(self.low_bits):
            low[:, j] = (indices >> j) & 1
        offsets, ranks = self._upper_slots(full, tail, k_tail)
        bits[kept * self.low_bits + offsets + (indices >> self.low_bits) + ranks] = 1
        return _pack_bits(bits)

    def _upper_slots(self, full: int, tail: int, k_tail: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For every kept index: where its chunk's upper vector starts (from the first upper bit), its rank
        within its chunk."""
        width = self._upper_width(self.chunk, self.k)
        offsets = (torch.arange(full, dtype=torch.int64) * width).repeat_interleave(self.k)
        ranks = torch.arange(self.k, dtype=torch.int64).repeat(full)
        if tail:
            offsets = torch.cat([offsets, torch.full((k_tail,), full * width, dtype=torch.int64)])
            ranks = torch.cat([ranks, torch.arange(k_tail, dtype=torch.int64)])
        return offsets, ranks

    # ---- decode --------------------------------------------------------------------------------------------
    def decode(self, data: Payload, numel: int) -> torch.Tensor:
        check_payload(data, numel, self.encoded_size(numel), self.name)
        out = torch.zeros(numel, dtype=torch.float32)
        if numel == 0:
            return out
        kept = self.kept(numel)
        u8 = payload_u8(data)
        split = self._index_bytes(numel)
        local = self._unpack_indices(u8[:split], numel)
        values = self.values.decode(u8[split:].numpy().tobytes(), kept)
        out[self._positions(local, numel)] = values
        return out

    def _unpack_indices(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        full, tail, k_tail, total = self._layout(numel)
        kept = full * self.k + k_tail
        bits = _unpack_bits(raw)
        if bool(bits[total:].any()):
            raise CodecError("topk payload has nonzero padding bits after its indices")
        planes = bits[: kept * self.low_bits].view(kept, self.low_bits)
        local = torch.zeros(kept, dtype=torch.int64)
        for j in range(self.low_bits):
            local.bitwise_or_(planes[:, j].to(torch.int64) << j)
        upper = bits[kept * self.low_bits : total]
        width = self._upper_width(self.chunk, self.k)
        highs = [self._highs(upper[: full * width].view(full, width), self.k)] if full else []
        if tail:
            highs.append(self._highs(upper[full * width :].view(1, -1), k_tail))
        return local.bitwise_or_(torch.cat(highs) << self.low_bits)

    @staticmethod
    def _highs(upper: torch.Tensor, kept: int) -> torch.Tensor:
        """Each chunk's (a row's) high parts from its upper vector, which must hold exactly `kept` set bits."""
        if bool((upper.sum(dim=1, dtype=torch.int64) != kept).any()):
            raise CodecError(
                f"topk payload has a chunk whose upper index bits do not mark exactly {kept} values"
            )
        columns = upper.nonzero()[:, 1]  # row-major: each row's set bits in increasing order
        return columns - torch.arange(kept, dtype=torch.int64).repeat(upper.shape[0])

    def _positions(self, local: torch.Tensor, numel: int) -> torch.Tensor:
        """Each kept value's position in the tensor, after checking the indices against their chunks."""
        full, tail = divmod(numel, self.chunk)
        chunk_of = torch.arange(full, dtype=torch.int64).repeat_interleave(self.k)
        length = torch.full((full * self.k,), self.chunk, dtype=torch.int64)
        if tail:
            kt = min(self.k, tail)
            chunk_of = torch.cat([chunk_of, torch.full((kt,), full, dtype=torch.int64)])
            length = torch.cat([length, torch.full((kt,), tail, dtype=torch.int64)])
        if bool((local >= length).any()):
            raise CodecError("topk payload has an index beyond its chunk")
        same_chunk = chunk_of[1:] == chunk_of[:-1]
        if bool((same_chunk & (local[1:] <= local[:-1])).any()):
            raise CodecError("topk payload has a chunk whose indices do not strictly increase")
        return chunk_of * self.chunk + local


def _pack_bits(bits: torch.Tensor) -> bytes:
    """A uint8 tensor of 0/1 (a multiple of 8 long) as bytes, each byte's low bit first."""
    octets = bits.view(-1, 8)
    packed = octets[:, 0].clone()
    for j in range(1, 8):
        packed.bitwise_or_(octets[:, j] << j)
    return bytes(packed.numpy().tobytes())


def _unpack_bits(raw: torch.Tensor) -> torch.Tensor:
    bits = torch.empty(raw.numel(), 8, dtype=torch.uint8)
    for j in range(8):
        bits[:, j] = (raw >> j) & 1
    return bits.view(-1)
