"""`topk`: the k largest-magnitude values of every chunk, their positions, and 2, 4 or 8 bits for each value.
Pure tensor code.

n = numel, C = chunk size, nc = ⌈n/C⌉ chunks (the last may be short), k values kept per chunk (k_i =
min(k, the chunk's length)), K = Σ k_i, ib = the bits of an index within a chunk (⌈log2 C⌉, at least 1;
12 for C = 4096), b = the value bits.

Layout, little-endian throughout:
    the K indices, ib bits each, packed low bits first into one bit stream (chunk by chunk, each
        chunk's indices strictly increasing), zero-padded to a whole byte;
    then the K values as the blockwise codec with one block per chunk (`quant.BlockQuantCodec`, block
        size k): nc bf16 scales, then the K codes (b = 2 and 4 mid-rise, b = 8 mid-tread, as `int2`,
        `int4` and `int8`).
Size: ⌈K·ib/8⌉ + 2·nc + ⌈K·b/8⌉. With C = 4096, k = 64 (1.56 %), b = 2: 12 + 2 bits per kept value and a
16-bit scale per 64 of them, 0.0278 bytes an element against fp32's 4 (144×; int2 is 0.28, 14×).

Which k: a chunk's k largest |x|, ties broken by torch.topk (the encoder is deterministic on one machine;
receivers only need what the payload decodes to). Sorting each chunk's indices makes the payload
canonical and lets the decoder reject a repeated index with one comparison.

Decode is exact (the blockwise codec's levels times a bf16 scale, scattered into zeros), so every
receiver of a payload holds bit-identical values. It validates before it trusts: the exact length first,
then every index below its chunk's length and strictly increasing within the chunk, zero padding bits,
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
        self.index_bits = max(1, (chunk - 1).bit_length())
        self.values = BlockQuantCodec(f"topk int{value_bits}", value_bits, k, midrise=value_bits < 8)

    def __repr__(self) -> str:
        return f"TopKCodec(chunk={self.chunk}, k={self.k}, value_bits={self.value_bits})"

    @property
    def alignment(self) -> int:
        return self.chunk

    def kept(self, numel: int) -> int:
        """K: how many values a payload for `numel` elements carries."""
        full, tail = divmod(check_numel(numel), self.chunk)
        return full * self.k + min(self.k, tail)

    def _index_bytes(self, kept: int) -> int:
        return -(-kept * self.index_bits // 8)

    def encoded_size(self, numel: int) -> int:
        kept = self.kept(numel)
        return self._index_bytes(kept) + self.values.encoded_size(kept)

    # ---- encode --------------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> bytes:
        x = check_input(x)
        if x.numel() == 0:
            return b""
        require_finite(x)
        indices, values = self.select(x)
        return self._pack_indices(indices) + self.values.encode(values)

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

    def _pack_indices(self, indices: torch.Tensor) -> bytes:
        # One bit plane at a time into a uint8 buffer: K·ib bytes, never K·ib int64s (a 124M model keeps
        # ~2M indices: 23 MB here against 186 MB).
        kept = indices.numel()
        bits = torch.zeros(self._index_bytes(kept) * 8, dtype=torch.uint8)
        planes = bits[: kept * self.index_bits].view(kept, self.index_bits)
        for j in range(self.index_bits):
            planes[:, j] = (indices >> j) & 1
        octets = bits.view(-1, 8)
        packed = octets[:, 0].clone()
        for j in range(1, 8):
            packed.bitwise_or_(octets[:, j] << j)
        return packed.numpy().tobytes()

    # ---- decode --------------------------------------------------------------------------------------------
    def decode(self, data: Payload, numel: int) -> torch.Tensor:
        check_payload(data, numel, self.encoded_size(numel), self.name)
        out = torch.zeros(numel, dtype=torch.float32)
        if numel == 0:
            return out
        kept = self.kept(numel)
        u8 = payload_u8(data)
        split = self._index_bytes(kept)
        local = self._unpack_indices(u8[:split], kept)
        values = self.values.decode(u8[split:].numpy().tobytes(), kept)
        out[self._positions(local, numel)] = values
        return out

    def _unpack_indices(self, raw: torch.Tensor, kept: int) -> torch.Tensor:
        bits = torch.empty(raw.numel(), 8, dtype=torch.uint8)
        for j in range(8):
            bits[:, j] = (raw >> j) & 1
        flat = bits.view(-1)
        if bool(flat[kept * self.index_bits :].any()):
            raise CodecError("topk payload has nonzero padding bits after its indices")
        planes = flat[: kept * self.index_bits].view(kept, self.index_bits)
        local = torch.zeros(kept, dtype=torch.int64)
        for j in range(self.index_bits):
            local.bitwise_or_(planes[:, j].to(torch.int64) << j)
        return local

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
