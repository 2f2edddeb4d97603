"""The sparse `topk` codec (dilocod/codecs/topk.py) and error feedback with decay: the payload's exact size,
which values it keeps and how close they come back, parts encoding as the whole, every malformed payload
refused in one line, and nothing lost to error feedback over many rounds."""

from __future__ import annotations

import math
import random

import pytest
import torch

from dilocod.codecs import CodecError, ErrorFeedback, TopKCodec, make_codec, roundtrip, topk_per_chunk

CASES = [  # (numel, chunk, k, value bits)
    (0, 4096, 64, 2),
    (1, 4096, 64, 2),
    (63, 4096, 64, 4),
    (4096, 4096, 64, 2),
    (4097, 4096, 64, 2),
    (10_000, 4096, 64, 8),
    (131_072, 4096, 64, 2),
    (1000, 100, 7, 4),
    (999, 1, 1, 8),
]


def _index_bits(numel: int, chunk: int, k: int) -> int:
    """Elias–Fano, chunk by chunk: L = ⌊log2(C/k)⌋ low bits an index, and an upper vector of k_i set bits and
    ⌊(length − 1)/2^L⌋ + 1 clear ones."""
    low = max(0, (chunk // k).bit_length() - 1)
    bits = 0
    for start in range(0, numel, chunk):
        length = min(chunk, numel - start)
        kept = min(k, length)
        bits += kept * low + kept + ((length - 1) >> low) + 1
    return bits


@pytest.mark.parametrize(("numel", "chunk", "k", "bits"), CASES)
def test_the_payload_has_its_exact_size(numel: int, chunk: int, k: int, bits: int) -> None:
    codec = TopKCodec(chunk, k, bits)
    full, tail = divmod(numel, chunk)
    kept = full * k + min(k, tail)
    chunks = -(-numel // chunk)
    expected = -(-_index_bits(numel, chunk, k) // 8) + 2 * chunks + -(-kept * bits // 8)
    assert codec.kept(numel) == kept
    assert codec.encoded_size(numel) == expected
    assert len(codec.encode(torch.randn(numel))) == expected


def test_the_default_is_200_times_fewer_bytes_than_fp32_and_26_than_int4() -> None:
    codec = TopKCodec()  # 64 of every 4,096 values, 2 bits each, 6 + 2 bits an index (Elias–Fano)
    per_element = codec.encoded_size(1 << 22) / (1 << 22)
    assert per_element == pytest.approx((64 * (8 + 2) + 16) / 8 / 4096)
    assert 4 / per_element == pytest.approx(199.8, abs=0.1)
    int4 = make_codec("int4").encoded_size(1 << 22) / (1 << 22)
    assert int4 / per_element == pytest.approx(26.5, abs=0.1)


def test_an_index_costs_within_a_bit_of_the_entropy_of_its_chunks_support() -> None:
    for k in (32, 64, 128):
        codec = TopKCodec(4096, k, 2)
        index_bits = 8 * codec.encoded_size(4096) - 16 - 2 * k  # less the scale and the values
        entropy = (math.lgamma(4097) - math.lgamma(k + 1) - math.lgamma(4097 - k)) / math.log(2)
        assert entropy <= index_bits < entropy + k, (k, index_bits, entropy)


@pytest.mark.parametrize(("numel", "chunk", "k", "bits"), [c for c in CASES if c[0]])
def test_it_keeps_the_k_largest_of_each_chunk_within_the_value_bound(
    numel: int, chunk: int, k: int, bits: int
) -> None:
    codec = TopKCodec(chunk, k, bits)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    y = codec.decode(codec.encode(x), numel)
    top = {8: 127, 4: 15, 2: 3}[bits]
    for start in range(0, numel, chunk):
        part, back = x[start : start + chunk], y[start : start + chunk]
        kept = min(k, part.numel())
        want = set(torch.topk(part.abs(), kept).indices.tolist())
        assert set(back.nonzero().flatten().tolist()) <= want  # int8 (mid-tread) may round a small one to 0
        if bits < 8:
            assert set(back.nonzero().flatten().tolist()) == want
        d = float(part.abs().max()) / top * (1 + 2**-7) * (1 + 2**-15)
        error = (back[list(want)] - part[list(want)]).abs().max()
        assert float(error) <= d * (1 + 2**-15) + 1e-12, (start, float(error), d)


def test_decode_is_exact_and_the_same_on_every_receiver() -> None:
    codec = TopKCodec()
    payload = codec.encode(torch.randn(50_000))
    assert torch.equal(codec.decode(payload, 50_000), codec.decode(bytearray(payload), 50_000))
    assert torch.equal(codec.decode(payload, 50_000), codec.decode(memoryview(payload), 50_000))


def test_parts_cut_at_the_chunk_decode_as_the_whole() -> None:
    codec = TopKCodec(256, 4, 2)
    x = torch.randn(256 * 10 + 37)
    whole = codec.decode(codec.encode(x), x.numel())
    cut = 256 * 3
    parts = [x[:cut], x[cut:]]
    again = torch.cat([codec.decode(codec.encode(p.contiguous()), p.numel()) for p in parts])
    assert codec.alignment == 256 and torch.equal(whole, again)


def test_encode_refuses_non_finite_values() -> None:
    for bad in (float("nan"), float("inf")):
        x = torch.zeros(5000)
        x[4321] = bad
        with pytest.raises(CodecError, match="NaN or Inf"):
            TopKCodec().encode(x)


def _payload(codec: TopKCodec, numel: int) -> bytearray:
    return bytearray(codec.encode(torch.randn(numel, generator=torch.Generator().manual_seed(1))))


def _forged(codec: TopKCodec, good: bytearray, numel: int, indices: list[int]) -> bytearray:
    """`good` with its index section replaced by these indices (chunk by chunk, in any order), encoded."""
    section = codec._pack_indices(torch.tensor(indices, dtype=torch.int64), numel)
    return bytearray(section) + good[len(section) :]


def test_every_malformed_payload_is_refused_in_one_line() -> None:
    codec = TopKCodec(16, 4, 2)  # L = 2 low bits; upper vectors of 8 bits (full chunks) and 6 (the tail)
    numel = 16 * 2 + 5  # two full chunks and a tail of 5: 24 low bits + 8 + 8 + 6 upper bits, 2 of padding
    good = _payload(codec, numel)
    codec.decode(good, numel)
    assert codec.decode(
        _forged(codec, good, numel, [1, 2, 3, 15, 0, 4, 8, 12, 0, 1, 2, 4]), numel
    ).count_nonzero()
    with pytest.raises(CodecError, match="must be"):
        codec.decode(good[:-1], numel)
    with pytest.raises(CodecError, match="must be"):
        codec.decode(good + b"\0", numel)
    with pytest.raises(CodecError, match="strictly increase"):
        codec.decode(_forged(codec, good, numel, [3, 3, 5, 7, 0, 1, 2, 3, 0, 1, 2, 3]), numel)
    with pytest.raises(CodecError, match="strictly increase"):
        codec.decode(_forged(codec, good, numel, [6, 5, 9, 10, 0, 1, 2, 3, 0, 1, 2, 3]), numel)
    with pytest.raises(CodecError, match="beyond its chunk"):
        codec.decode(_forged(codec, good, numel, [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 7]), numel)
    extra = bytearray(good)
    extra[3] ^= 0x01  # the first upper vector's first bit flipped: a chunk marks 3 or 5 values, not 4
    with pytest.raises(CodecError, match="exactly 4"):
        codec.decode(extra, numel)
    padding = bytearray(good)
    padding[5] |= 0x80  # bit 47: after the 46 bits of the index section
    with pytest.raises(CodecError, match="padding"):
        codec.decode(padding, numel)
    scale = bytearray(good)
    scale[6 + 1] |= 0x80  # the first chunk's bf16 scale made negative
    with pytest.raises(CodecError, match="scale"):
        codec.decode(scale, numel)


def test_random_bytes_raise_nothing_but_a_codec_error() -> None:
    codec = TopKCodec(64, 5, 4)
    rng = random.Random(7)
    for numel in (1, 70, 640):
        size = codec.encoded_size(numel)
        for _ in range(200):
            data = bytes(rng.getrandbits(8) for _ in range(size))
            try:
                out = codec.decode(data, numel)
            except CodecError:
                continue
            assert out.shape == (numel,) and bool(torch.isfinite(out).all())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 1, 2), "chunk"),
        ((16, 0, 2), "k"),
        ((16, 17, 2), "k <= chunk"),
        ((16, 4, 3), "value bits"),
        ((1 << 17, 4, 2), "chunk <="),
        ((16.0, 4, 2), "chunk"),
    ],  # fmt: skip
)
def test_bad_settings_are_refused(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TopKCodec(*args)


def test_k_from_a_density() -> None:
    assert topk_per_chunk(64 / 4096, 4096) == 64
    assert topk_per_chunk(0.0078, 4096) == 32
    assert topk_per_chunk(1e-9, 4096) == 1 and topk_per_chunk(2.0, 4096) == 4096


def test_error_feedback_loses_nothing_over_many_rounds() -> None:
    """Σ transmitted + the residual = Σ Δ: what top-k leaves out is sent in later rounds."""
    codec = TopKCodec(512, 8, 2)
    shapes = [(64, 48), (300,)]
    feedback = ErrorFeedback(shapes)
    gen = torch.Generator().manual_seed(3)
    total = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    moved = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for _ in range(40):
        delta = [torch.randn(s, generator=gen) * 0.01 for s in shapes]
        sent = feedback.compensate(delta)
        transmitted = roundtrip(codec, sent)
        feedback.update(sent, transmitted)
        for t, m, d, x in zip(total, moved, delta, transmitted, strict=True):
            t += d.double()
            m += x.double()
    for t, m, e in zip(total, moved, feedback.residual, strict=True):
        torch.testing.assert_close(m + e.double(), t, atol=1e-5, rtol=0)
    # and every round sent something: 8 of each 512 values of the first tensor's 3,072
    assert float(moved[0].count_nonzero()) >= 48


def test_a_decay_fades_the_carried_residual() -> None:
    feedback = ErrorFeedback([(3,)], decay=0.95)
    feedback.residual[0].copy_(torch.tensor([1.0, -2.0, 0.5]))
    sent = feedback.compensate([torch.tensor([0.1, 0.1, 0.1])])
    torch.testing.assert_close(sent[0], torch.tensor([0.1 + 0.95, 0.1 - 1.9, 0.1 + 0.475]))
    plain = ErrorFeedback([(3,)])
    plain.residual[0].copy_(torch.tensor([1.0, -2.0, 0.5]))
    assert torch.equal(plain.compensate([torch.ones(3)])[0], torch.ones(3) + plain.residual[0])
    for bad in (0.0, 1.5, True, float("nan")):
        with pytest.raises(ValueError, match="decay"):
            ErrorFeedback([(3,)], decay=bad)  # type: ignore[arg-type]
