"""Tests for dilocod.codecs: wire layout, error bounds, hostile payloads, determinism, error feedback."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dilocod.codecs import (
    CODEC_NAMES,
    BlockQuantCodec,
    Codec,
    CodecError,
    ErrorFeedback,
    bytes_per_element,
    make_codec,
    roundtrip,
)
from dilocod.codecs import base as codec_base

QUANT = ("int8", "int4", "int2")
# Worst-case |x − x̂| in units of the block's absmax (the docstring's bound, before the 2^-7 bf16 slack).
REL_BOUND = {"int8": 1 / 254, "int4": 1 / 15, "int2": 1 / 3}
BF16_SLACK = (1 + 2**-7) * (1 + 2**-23)  # the scale is absmax/top rounded up to bf16
PICK_SLACK = 1 + 2**-15  # fp32 rounding in choosing the nearest level
MIN_NORMAL = 2.0**-126
HYP = settings(max_examples=200, deadline=None)


def vec(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def sample(seed: int, n: int, kind: str, exponent: int) -> torch.Tensor:
    """Pseudo-gradient-like vectors: Gaussian, heavy-tailed, sparse, constant; scaled by 2^exponent."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen)
    if kind == "heavy":
        x = x**3
    elif kind == "sparse":
        x = torch.where(torch.rand(n, generator=gen) < 0.8, torch.zeros_like(x), x)
    elif kind == "constant":
        x = torch.full((n,), -1.5)
    return x * 2.0**exponent


def scales_of(codec: BlockQuantCodec, data: bytes, numel: int) -> torch.Tensor:
    """The per-block scales d, read from the payload as the layout says (little-endian bf16 first)."""
    nb = codec.num_blocks(numel)
    bits = struct.unpack(f"<{nb}H", data[: 2 * nb])
    return torch.tensor([struct.unpack("<f", struct.pack("<I", b << 16))[0] for b in bits])


def per_element(values: torch.Tensor, block_size: int, numel: int) -> torch.Tensor:
    return values.repeat_interleave(block_size)[:numel]


def block_absmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    pad = -x.numel() % block_size
    return torch.cat([x.abs(), torch.zeros(pad)]).view(-1, block_size).amax(dim=1)


# ----------------------------------------------------------------------------------------------- factory


def test_make_codec_names_and_defaults() -> None:
    assert [make_codec(n).name for n in CODEC_NAMES] == list(CODEC_NAMES)
    assert make_codec("none").lossless and not any(make_codec(n).lossless for n in CODEC_NAMES[1:])
    sizes = {n: make_codec(n).block_size for n in QUANT}  # type: ignore[attr-defined]
    assert sizes == {"int8": 256, "int4": 64, "int2": 64}
    assert make_codec("int4", block_size=32).block_size == 32  # type: ignore[attr-defined]
    assert make_codec("fp16", block_size=32).name == "fp16"  # no blocks: the size is ignored
    assert all(isinstance(make_codec(n), Codec) for n in CODEC_NAMES)


def test_make_codec_rejects_unknown_name() -> None:
    with pytest.raises(ValueError) as err:
        make_codec("int3")
    assert str(err.value) == "averaging.compression must be one of none, fp16, int8, int4, int2, got 'int3'"


@pytest.mark.parametrize("size", [0, -4, 2.5, True])
def test_make_codec_rejects_bad_block_size(size: object) -> None:
    with pytest.raises(ValueError, match="block_size"):
        make_codec("int2", block_size=size)  # type: ignore[arg-type]


def test_encode_rejects_wrong_tensor_kind() -> None:
    codec = make_codec("int8")
    for bad in (torch.zeros(2, 3), torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.int32)):
        with pytest.raises(ValueError, match="1-D float32 CPU"):
            codec.encode(bad)


# ------------------------------------------------------------------------------------------ sizes, layout

LENGTHS = [0, 1, 2, 3, 4, 5, 7, 63, 64, 65, 127, 255, 256, 257, 1000, 4099]


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("block_size", [None, 1, 3, 7])
def test_encoded_size_is_exact(name: str, block_size: int | None) -> None:
    codec = make_codec(name, block_size)
    for n in LENGTHS:
        data = codec.encode(sample(n, n, "normal", 0))
        assert len(data) == codec.encoded_size(n)
        assert codec.decode(data, n).shape == (n,)


def test_encoded_size_formula() -> None:
    n = 1000
    assert make_codec("none").encoded_size(n) == 4000
    assert make_codec("fp16").encoded_size(n) == 2000
    assert make_codec("int8").encoded_size(n) == 2 * 4 + 1000  # 4 blocks of 256
    assert make_codec("int4").encoded_size(n) == 2 * 16 + 500  # 16 blocks of 64
    assert make_codec("int2").encoded_size(n) == 2 * 16 + 250
    assert make_codec("int4").encoded_size(3) == 2 + 2  # 3 nibbles round up to 2 bytes
    assert make_codec("int2").encoded_size(5) == 2 + 2  # 5 crumbs round up to 2 bytes
    assert all(make_codec(name).encoded_size(0) == 0 for name in CODEC_NAMES)
    assert all(make_codec(name).encode(torch.zeros(0)) == b"" for name in CODEC_NAMES)


def test_bytes_per_element() -> None:
    ratios = {name: bytes_per_element(make_codec(name)) for name in CODEC_NAMES}
    assert ratios == {
        "none": 4.0,
        "fp16": 2.0,
        "int8": 1 + 2 / 256,
        "int4": 0.5 + 2 / 64,
        "int2": 0.25 + 2 / 64,
    }


def test_golden_payloads() -> None:
    """The wire layout, pinned byte for byte (little-endian bf16 scales, then low-bits-first codes)."""
    assert make_codec("none").encode(vec([1.0, -2.0])) == struct.pack("<2f", 1.0, -2.0)
    assert make_codec("fp16").encode(vec([1.0, 1e6])) == bytes.fromhex("003c ff7b")  # 1e6 saturates
    # int2: absmax 3 → d = 1 (bf16 0x3F80); codes 0..3 are −3d, −d, d, 3d, packed 0b11_10_01_00.
    assert make_codec("int2").encode(vec([-3, -1, 1, 3])) == bytes.fromhex("803f e4")
    assert make_codec("int2").encode(vec([3, -3, 1])) == bytes.fromhex("803f 23")  # padding bits zero
    # int4: absmax 30 → d = 2 (0x4000); 30 → code 15, −30 → code 0, 2 → code 8.
    assert make_codec("int4").encode(vec([30, -30, 2])) == bytes.fromhex("0040 0f 08")
    # int8: absmax 63.5 → d = 0.5 (0x3F00); codes are two's-complement bytes.
    assert make_codec("int8").encode(vec([-63.5, 0.0, 1.0])) == bytes.fromhex("003f 81 00 02")


def test_golden_decodes() -> None:
    assert torch.equal(make_codec("int2").decode(bytes.fromhex("803f e4"), 4), vec([-3, -1, 1, 3]))
    assert torch.equal(make_codec("int4").decode(bytes.fromhex("0040 0f 08"), 3), vec([30, -30, 2]))
    assert torch.equal(make_codec("int8").decode(bytes.fromhex("003f 81 00 02"), 3), vec([-63.5, 0, 1]))
    two_blocks = make_codec("int2", block_size=2).decode(bytes.fromhex("803f 0040 e4"), 4)
    assert torch.equal(two_blocks, vec([-3, -1, 2, 6]))  # second block scaled by d = 2


# ------------------------------------------------------------------------------------------ error bounds


def test_none_is_exact() -> None:
    x = torch.cat([sample(1, 1000, "heavy", 10), vec([0.0, -0.0, 3.4e38, -1e-45])])
    codec = make_codec("none")
    y = codec.decode(codec.encode(x), x.numel())
    assert torch.equal(x.view(torch.int32), y.view(torch.int32))  # bit-exact, signed zeros included


def assert_fp16_bound(x: torch.Tensor) -> None:
    codec = make_codec("fp16")
    y = codec.decode(codec.encode(x), x.numel())
    inside = x.abs() <= 65504
    bound = torch.maximum(x.abs() * 2.0**-11, torch.full_like(x, 2.0**-25))
    assert bool(((x - y).abs()[inside] <= bound[inside]).all())
    assert bool((y[~inside] == torch.sign(x[~inside]) * 65504).all())  # saturate, never Inf


@HYP
@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), max_size=300))
def test_fp16_bound(values: list[float]) -> None:
    assert_fp16_bound(vec(values))


def test_fp16_bound_on_edges() -> None:
    assert_fp16_bound(vec([65504, 65519, 65520, 1e30, -1e30, 2.0**-14, 2.0**-24, 1e-30, 0.0, -1.0 / 3]))


def check_quant_bound(name: str, block_size: int | None, x: torch.Tensor) -> None:
    """Each element within its block's bound; each scale within (absmax/top)·(1 + 2^-7)."""
    codec = make_codec(name, block_size)
    assert isinstance(codec, BlockQuantCodec)
    n, size = x.numel(), codec.block_size
    data = codec.encode(x)
    y = codec.decode(data, n)
    d = scales_of(codec, data, n)
    absmax32 = block_absmax(x, size)
    absmax = absmax32.double()
    scale32 = absmax32 / codec.top  # the encoder's own fp32 division, so `tiny` agrees with it exactly
    tiny = scale32 < MIN_NORMAL  # such blocks are sent as zeros
    assert bool((d[tiny] == 0).all()) and bool((d[~tiny] >= scale32[~tiny]).all())
    assert bool((d.double() <= absmax / codec.top * BF16_SLACK).all())
    half_steps = 1.0 if codec.midrise else 0.5
    bound = per_element(d.double() * half_steps * PICK_SLACK, size, n)
    err = (x.double() - y.double()).abs()
    in_tiny = per_element(tiny, size, n)
    assert bool((err[~in_tiny] <= bound[~in_tiny]).all())
    assert bool((y[in_tiny] == 0).all())
    # The same bound in units of the block's absmax: ~1/254, 1/15, 1/3.
    rel = per_element(absmax * REL_BOUND[name] * BF16_SLACK * PICK_SLACK, size, n)
    assert bool((err[~in_tiny] <= rel[~in_tiny]).all())


@HYP
@given(
    name=st.sampled_from(QUANT),
    block_size=st.sampled_from([None, 1, 2, 5, 16, 64, 256]),
    n=st.integers(0, 700),
    seed=st.integers(0, 2**31),
    kind=st.sampled_from(["normal", "heavy", "sparse", "constant"]),
    exponent=st.integers(-140, 120),
)
def test_quant_bound(name: str, block_size: int | None, n: int, seed: int, kind: str, exponent: int) -> None:
    check_quant_bound(name, block_size, sample(seed, n, kind, exponent))


@HYP
@given(
    name=st.sampled_from(QUANT),
    block_size=st.sampled_from([None, 1, 3, 8]),
    values=st.lists(st.floats(-(2.0**126), 2.0**126, width=32), max_size=200),
)
def test_quant_bound_arbitrary_floats(name: str, block_size: int | None, values: list[float]) -> None:
    check_quant_bound(name, block_size, vec(values))


@pytest.mark.parametrize("name", QUANT)
def test_quant_extremes_stay_finite(name: str) -> None:
    """Near fp32's maximum the scale is capped: decode stays finite and keeps the sign."""
    codec = make_codec(name)
    x = vec([3.4028234e38, -3.4028234e38, 1.0, 0.0])
    y = codec.decode(codec.encode(x), 4)
    assert bool(torch.isfinite(y).all())
    assert y[0] > 3.3e38 and y[1] < -3.3e38


def test_int8_keeps_zeros_exact() -> None:
    codec = make_codec("int8")
    x = sample(3, 1000, "sparse", 0)
    y = codec.decode(codec.encode(x), 1000)
    assert bool((y[x == 0] == 0).all())


# ------------------------------------------------------------------------------------ non-finite input


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [0, 63, 64, 299])  # first element, block edges, the short tail block
def test_encode_refuses_non_finite(name: str, bad: float, where: int) -> None:
    x = sample(0, 300, "normal", 0)
    x[where] = bad
    with pytest.raises(CodecError, match="NaN or Inf"):
        make_codec(name).encode(x)


# --------------------------------------------------------------------------------------- hostile bytes


@HYP
@given(
    name=st.sampled_from(CODEC_NAMES),
    block_size=st.sampled_from([None, 1, 3, 64]),
    numel=st.integers(0, 300),
    data=st.data(),
)
def test_decode_random_bytes(name: str, block_size: int | None, numel: int, data: st.DataObject) -> None:
    """Any bytes either decode to numel finite floats or raise CodecError; nothing else escapes."""
    codec = make_codec(name, block_size)
    size = codec.encoded_size(numel)
    payload = data.draw(st.one_of(st.binary(max_size=2 * size + 8), st.binary(min_size=size, max_size=size)))
    try:
        out = codec.decode(payload, numel)
    except CodecError as err:
        assert "\n" not in str(err)
        return
    assert len(payload) == size
    assert out.dtype == torch.float32 and out.shape == (numel,)
    assert bool(torch.isfinite(out).all())


@HYP
@given(
    name=st.sampled_from(CODEC_NAMES),
    numel=st.integers(0, 300),
    cut=st.integers(1, 64),
    extra=st.binary(min_size=1, max_size=64),
)
def test_decode_truncated_or_extended(name: str, numel: int, cut: int, extra: bytes) -> None:
    codec = make_codec(name)
    good = codec.encode(sample(numel, numel, "normal", 0))
    with pytest.raises(CodecError, match="must be"):
        codec.decode(good + extra, numel)
    if good:
        with pytest.raises(CodecError, match="must be"):
            codec.decode(good[: max(0, len(good) - cut)], numel)


@pytest.mark.parametrize(
    ("name", "payload", "numel", "message"),
    [
        ("none", struct.pack("<2f", 1.0, math.nan), 2, "NaN or Inf"),
        ("none", struct.pack("<f", math.inf), 1, "NaN or Inf"),
        ("fp16", bytes.fromhex("007c"), 1, "NaN or Inf"),  # +Inf
        ("fp16", bytes.fromhex("01fe"), 1, "NaN or Inf"),  # a NaN
        ("int8", bytes.fromhex("003f 80"), 1, "code -128"),
        ("int8", bytes.fromhex("0080 01"), 1, "scale"),  # −0.0 scale: the sign bit
        ("int2", bytes.fromhex("80bf e4"), 4, "scale"),  # negative scale
        ("int2", bytes.fromhex("7f00 e4"), 4, "scale"),  # subnormal scale
        ("int2", bytes.fromhex("807f e4"), 4, "scale"),  # +Inf scale
        ("int2", bytes.fromhex("c07f e4"), 4, "scale"),  # NaN scale
        ("int2", bytes.fromhex("7f7f e4"), 4, "scale"),  # finite, but 3·d would overflow
        ("int2", bytes.fromhex("803f 64"), 3, "padding"),  # a 4th code where only 3 exist
        ("int4", bytes.fromhex("803f 10"), 1, "padding"),
    ],
)
def test_decode_rejects_malformed(name: str, payload: bytes, numel: int, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        make_codec(name).decode(payload, numel)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_decode_rejects_bad_framing_args(name: str) -> None:
    codec = make_codec(name)
    for numel in (-1, True, 2.0):
        with pytest.raises(CodecError, match="numel"):
            codec.decode(b"", numel)  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="must be"):
        codec.decode(b"\x00" * 16, 10**15)  # a huge numel is a length mismatch, not an allocation
    with pytest.raises(CodecError, match="bytes"):
        codec.decode("text", 1)  # type: ignore[arg-type]


def test_decode_accepts_bytearray_and_memoryview() -> None:
    codec = make_codec("int4")
    x = sample(5, 99, "normal", 0)
    data = codec.encode(x)
    expected = codec.decode(data, 99)
    assert torch.equal(codec.decode(bytearray(data), 99), expected)
    assert torch.equal(codec.decode(memoryview(data), 99), expected)


# --------------------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_decode_is_deterministic(name: str) -> None:
    codec = make_codec(name)
    x = sample(7, 300_001, "heavy", 0)
    data = codec.encode(x)
    assert codec.encode(x) == data
    first = codec.decode(data, x.numel())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = codec.decode(data, x.numel())
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(first.view(torch.int32), codec.decode(data, x.numel()).view(torch.int32))
    assert torch.equal(first.view(torch.int32), single.view(torch.int32))


def test_decode_does_not_alias_the_payload() -> None:
    codec = make_codec("none")
    data = bytearray(codec.encode(vec([1.0, 2.0])))
    out = codec.decode(data, 2)
    data[:4] = struct.pack("<f", 9.0)
    assert torch.equal(out, vec([1.0, 2.0]))


def test_big_endian_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The byte-swapping paths a big-endian host takes, checked by pretending to be one."""
    x = vec([1.0, -2.5])
    native = x.numpy().tobytes()
    monkeypatch.setattr(codec_base, "_BIG_ENDIAN", True)
    swapped = codec_base.to_le_bytes(x)
    assert swapped == b"".join(native[i : i + 4][::-1] for i in range(0, 8, 4))
    assert torch.equal(codec_base.le_view(codec_base.payload_u8(swapped), torch.float32), x)


# ------------------------------------------------------------------------------------- error feedback


def test_error_feedback_bookkeeping() -> None:
    shapes = [(2, 3), (4,)]
    ef = ErrorFeedback(shapes)
    delta = [torch.ones(2, 3), torch.full((4,), 2.0)]
    sent = ef.compensate(delta)
    assert all(torch.equal(s, d) for s, d in zip(sent, delta))  # zero residual at start
    transmitted = [torch.zeros(2, 3), torch.full((4,), 1.5)]
    ef.update(sent, transmitted)
    assert torch.equal(ef.residual[0], torch.ones(2, 3)) and torch.equal(
        ef.residual[1], torch.full((4,), 0.5)
    )
    assert ef.norm() == pytest.approx(math.sqrt(6 + 4 * 0.25))
    again = ef.compensate(delta)
    assert torch.equal(again[1], torch.full((4,), 2.5)) and torch.equal(delta[1], torch.full((4,), 2.0))
    # In place (the round's close: Δ is fresh): the same values, in Δ's own tensors.
    mine = [d.clone() for d in delta]
    in_place = ef.compensate(mine, in_place=True)
    assert all(a is b for a, b in zip(in_place, mine, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(in_place, again, strict=True))
    with pytest.raises(ValueError, match="CPU fp32"):
        ef.compensate([d.double() for d in delta], in_place=True)

    saved = ef.state_dict()
    other = ErrorFeedback(shapes)
    other.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(other.residual, ef.residual))
    saved["residual"][0].fill_(7.0)  # the state dict is a copy
    assert torch.equal(ef.residual[0], torch.ones(2, 3))
    ef.reset()
    assert ef.norm() == 0.0


def test_error_feedback_rejects_mismatches() -> None:
    ef = ErrorFeedback([(2, 3), (4,)])
    with pytest.raises(ValueError, match="expected 2"):
        ef.compensate([torch.zeros(2, 3)])
    with pytest.raises(ValueError, match="shape mismatch"):
        ef.update([torch.zeros(2, 3), torch.zeros(4)], [torch.zeros(2, 3), torch.zeros(5)])
    assert ef.norm() == 0.0  # nothing half-applied
    with pytest.raises(ValueError, match="shape mismatch"):
        ef.load_state_dict({"residual": [torch.zeros(3, 2), torch.zeros(4)]})
    with pytest.raises(ValueError, match="list of tensors"):
        ef.load_state_dict({})


@pytest.mark.parametrize("name", ["int4", "int2"])
def test_settle_is_update_with_the_roundtrip_and_bf16_loses_at_most_2_to_the_minus_8(name: str) -> None:
    codec = make_codec(name)
    sent = [sample(3, 4096, "normal", 0).view(64, 64), sample(4, 300, "heavy", 0)]
    exact, half = (
        ErrorFeedback([t.shape for t in sent]),
        ErrorFeedback([t.shape for t in sent], torch.bfloat16),
    )
    reference = ErrorFeedback([t.shape for t in sent])
    reference.update(sent, roundtrip(codec, sent))
    exact.settle(codec, sent)
    half.settle(codec, sent)
    assert all(torch.equal(a, b) for a, b in zip(exact.residual, reference.residual, strict=True))
    assert all(e.dtype == torch.bfloat16 for e in half.residual)
    for kept, full in zip(half.residual, exact.residual, strict=True):  # round to nearest, 8 bits
        assert bool((kept.float() - full).abs().le(full.abs() * 2**-8).all())
    # A checkpoint written either way resumes into either dtype.
    half.load_state_dict(exact.state_dict())
    exact.load_state_dict(half.state_dict())
    assert all(torch.equal(a.float(), b) for a, b in zip(half.residual, exact.residual, strict=True))


def test_roundtrip_keeps_shapes_and_encodes_per_tensor() -> None:
    codec = make_codec("int2")
    tensors = [sample(1, 6, "normal", 0).view(2, 3), sample(2, 70, "normal", 10)]
    out = roundtrip(codec, tensors)
    assert [t.shape for t in out] == [(2, 3), (70,)]
    for t, o in zip(tensors, out):  # per tensor: the small tensor's scale ignores the big one
        assert torch.equal(o.reshape(-1), codec.decode(codec.encode(t.reshape(-1)), t.numel()))


@pytest.mark.parametrize(("name", "steps_per_d"), [("int2", 3.0), ("int4", 15.0), ("int8", 254.0)])
def test_error_feedback_residual_stays_bounded(name: str, steps_per_d: float) -> None:
    """Over 200 rounds, per block: max|e| ≤ ρ/(1−ρ)·max over rounds of max|Δ|.

    Why: each element's codec error is ≤ ρ·absmax(Δ_t + e_t) over its block with ρ = (1 + 2^-7)·
    (1 + 2^-15)/3 for int2 (the bf16 round-up and level-picking slack; /15 int4, /254 int8), so
    M_{t+1} ≤ ρ·(D + M_t) with D = sup max|Δ|, and from M_0 = 0 induction gives M_t ≤ ρ·D/(1 − ρ):
    ≈ 0.506·D for int2, 0.072·D for int4, 0.004·D for int8.
    """
    codec = make_codec(name)
    size = codec.block_size  # type: ignore[attr-defined]
    rho = (1 + 2**-7) * (1 + 2**-14) / steps_per_d
    c = rho / (1 - rho)
    gen = torch.Generator().manual_seed(11)
    shapes = [(37, 29), (300,)]  # lengths that are not multiples of the block size
    ef = ErrorFeedback(shapes)
    sup_delta = [torch.zeros(-(-math.prod(s) // size)) for s in shapes]
    worst = 0.0
    for _ in range(200):
        # Gaussian Δ whose scale changes by up to 100× between rounds and between tensors.
        delta = [
            torch.randn(s, generator=gen) * 10 ** (2 * torch.rand(1, generator=gen).item() - 1)
            for s in shapes
        ]
        sent = ef.compensate(delta)
        ef.update(sent, roundtrip(codec, sent))
        for i, (d, e) in enumerate(zip(delta, ef.residual)):
            sup_delta[i] = torch.maximum(sup_delta[i], block_absmax(d.reshape(-1), size))
            ratio = block_absmax(e.reshape(-1), size) / (c * sup_delta[i])
            worst = max(worst, float(ratio.max()))
    assert worst <= 1.0, f"residual reached {worst:.3f} of its bound"


def quadratic_workers(workers: int, rows: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker i holds ½‖A_i x − b_i‖² (A stacked as workers × rows × dim); the goal is their average."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(workers, rows, dim, generator=gen, dtype=torch.float64) / rows**0.5
    b = torch.randn(workers, rows, generator=gen, dtype=torch.float64)
    return a, b


def descend(
    codec: Codec, feedback: bool, a: torch.Tensor, b: torch.Tensor, lipschitz: float, steps: int
) -> torch.Tensor:
    """Gradient descent where each worker's gradient crosses the codec, as a pseudo-gradient would.

    The workers' gradients travel as one workers × dim tensor: dim is a multiple of the block size, so
    no block straddles two workers and this is the same as encoding each worker's gradient alone.
    """
    workers, _, dim = a.shape
    a_t = a.transpose(1, 2).contiguous()
    ef = ErrorFeedback([(workers, dim)])
    x = torch.zeros(dim, dtype=torch.float64)
    for step in range(steps):
        # Full steps for 60 rounds, then halve every 50: with heterogeneous workers each worker's
        # gradient at x* is nonzero, so error feedback settles in a neighbourhood ∝ lr that the decay shrinks.
        lr = 0.5 ** max(0, (step - 60) // 50) / lipschitz
        residuals = torch.matmul(a, x) - b
        # One matrix-vector product per worker: a batched matmul is ~100× slower here for tiny sizes.
        grads = [torch.stack([torch.mv(at, r) for at, r in zip(a_t, residuals)]).float()]
        sent = ef.compensate(grads) if feedback else grads
        transmitted = roundtrip(codec, sent)
        if feedback:
            ef.update(sent, transmitted)
        x = x - lr * transmitted[0].double().mean(dim=0)
    return x


def test_int2_with_error_feedback_converges_and_without_stalls() -> None:
    """4 workers with different least-squares problems, 256 unknowns (4 int2 blocks each), 400 rounds.

    Without feedback each worker's compressed gradient at x* is biased by an amount that no step size
    removes, so the average stalls far away (≈ 0.5 of ‖x*‖); with feedback the bias is paid back in
    later rounds and x reaches ≈ 0.4 % of ‖x*‖ (exact gradients, same schedule: 2e-8).
    """
    a, b = quadratic_workers(workers=4, rows=256, dim=256, seed=1)
    stacked = a.reshape(-1, 256)
    optimum = torch.linalg.lstsq(stacked, b.reshape(-1)).solution
    lipschitz = float(torch.linalg.matrix_norm(stacked, ord=2)) ** 2 / 4  # of the average loss

    def distance(codec: Codec, feedback: bool) -> float:
        return float((descend(codec, feedback, a, b, lipschitz, 400) - optimum).norm() / optimum.norm())

    exact = distance(make_codec("none"), False)
    with_ef = distance(make_codec("int2"), True)
    without = distance(make_codec("int2"), False)
    assert exact < 1e-6, exact
    assert with_ef < 0.01, with_ef
    assert without > 0.3, without
    assert without > 50 * with_ef


# ------------------------------------------------------------------------------- the all-reduce's split


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_alignment_is_the_block_size(name: str) -> None:
    codec = make_codec(name)
    assert codec.alignment == getattr(codec, "block_size", 1)
    assert make_codec(name, block_size=32).alignment == (32 if name in QUANT else 1)


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("part_size", [512, 131072])  # 131072 = hivemind's 512 KiB parts of fp32
def test_encoding_by_parts_equals_encoding_the_tensor(name: str, part_size: int) -> None:
    """The all-reduce encodes each part on its own; parts start at multiples of the codec's alignment,
    so a sender's per-tensor `roundtrip` (what its error feedback uses) is exactly what the wire carried."""
    codec = make_codec(name)
    assert part_size % codec.alignment == 0
    x = torch.cat([sample(1, 2 * part_size + 1000, "heavy", 0), sample(2, 77, "normal", 8)])
    by_parts = torch.cat([codec.decode(codec.encode(p), p.numel()) for p in x.split(part_size)])
    assert torch.equal(by_parts, roundtrip(codec, [x])[0])
    payload_bytes = sum(len(codec.encode(p)) for p in x.split(part_size))
    assert payload_bytes == sum(codec.encoded_size(p.numel()) for p in x.split(part_size))
