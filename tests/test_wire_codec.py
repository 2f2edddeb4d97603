"""The networking layer's codec plumbing as pure code: payload framing, decoding strangers' bytes, the
reducer's single encode of each result, and the codec-keyed matchmaking bits (no processes started)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES
from hivemind.compression import CompressionInfo, deserialize_torch_tensor
from hivemind.proto import runtime_pb2

from dilocod.codecs import CODEC_NAMES, TopKCodec, make_codec, roundtrip
from peers.grouping import round_group_bits
from peers.partreduce import BufferingReducer, weighted_mean
from peers.wirecodec import (
    CodecCompression,
    PartCodec,
    decode_message,
    decode_payload_tensor,
    encode_or_empty,
    payload_message,
    requantize,
)

LOSSY = [name for name in CODEC_NAMES if name != "none"]


def values(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_dilocod_codecs_fit_the_networking_interface() -> None:
    for name in CODEC_NAMES:
        codec: PartCodec = make_codec(name)  # structural: peers/ never imports dilocod
        assert codec.name == name
        assert (DEFAULT_PART_SIZE_BYTES // 4) % codec.alignment == 0  # blocks never straddle two parts


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_parts_travel_as_uint8_payloads(name: str) -> None:
    codec = make_codec(name)
    x = values(0, 1000)
    compression = CodecCompression(codec)
    message = compression.compress(x, CompressionInfo.from_tensor(x))
    assert message.dtype == "uint8" and list(message.size) == [codec.encoded_size(1000)]
    assert message.buffer == codec.encode(x)
    assert compression.estimate_compression_ratio(CompressionInfo.from_tensor(x)) == 1.0
    # what hivemind's own deserializer makes of it on the other side: the payload as a uint8 tensor
    carried = deserialize_torch_tensor(message)
    assert carried.dtype == torch.uint8 and carried.numel() == len(message.buffer)
    decoded = decode_payload_tensor(codec, carried, 1000)
    assert decoded is not None and torch.equal(decoded, roundtrip(codec, [x])[0])
    assert torch.equal(decode_message(codec, message, 1000), decoded)  # type: ignore[arg-type]


def test_non_finite_part_goes_out_empty_and_is_refused() -> None:
    codec = make_codec("int2")
    x = values(1, 100)
    x[3] = float("nan")
    assert encode_or_empty(codec, x) == b""
    assert decode_message(codec, payload_message(b""), 100) is None


@pytest.mark.parametrize("name", LOSSY)
def test_malformed_payloads_decode_to_none(name: str) -> None:
    codec = make_codec(name)
    good = codec.encode(values(2, 300))
    bad_messages = [
        payload_message(good[:-1]),  # short
        payload_message(good + b"\x00"),  # long
        runtime_pb2.Tensor(buffer=good, size=[len(good)], dtype="float32"),  # not our framing
        runtime_pb2.Tensor(buffer=good, size=[len(good) + 4], dtype="uint8"),  # size lies
        payload_message(codec.encode(values(3, 200))),  # a shorter part's payload
    ]
    if name in ("int8", "int4", "int2"):
        bad_messages.append(payload_message(b"\xff\xff" + good[2:]))  # a negative NaN scale
    for message in bad_messages:
        assert decode_message(codec, message, 300) is None
    assert decode_payload_tensor(codec, torch.zeros(len(good), dtype=torch.float32), 300) is None
    assert decode_payload_tensor(codec, torch.zeros(len(good) - 1, dtype=torch.uint8), 300) is None


def test_requantize() -> None:
    codec = make_codec("int4")
    x = values(4, 500).view(20, 25)
    out, payload = requantize(codec, x)
    assert out.shape == (20, 25) and payload == codec.encode(x.reshape(-1))
    assert torch.equal(out.reshape(-1), codec.decode(payload, 500))
    bad = x.clone()
    bad[0, 0] = float("inf")
    zeros, payload = requantize(codec, bad)  # cannot be encoded: the safe value, zeros
    assert torch.equal(zeros, torch.zeros(20, 25)) and len(payload) == codec.encoded_size(500)


def test_reducer_encodes_each_result_once_and_keeps_what_it_decodes_to() -> None:
    codec = make_codec("int2")
    shapes = (torch.Size([128]), torch.Size([70]))
    inputs = [[values(10 * s + p, shape.numel()) for p, shape in enumerate(shapes)] for s in range(3)]

    async def run() -> tuple[list[list[torch.Tensor]], BufferingReducer]:
        reducer = BufferingReducer(shapes, 3, weighted_mean, codec)

        async def sender(index: int) -> list[torch.Tensor]:
            return [
                await reducer.accumulate_part(index, p, inputs[index][p], weight=1.0)
                for p in range(len(shapes))
            ]

        return list(await asyncio.gather(*(sender(i) for i in range(3)))), reducer

    results, reducer = asyncio.run(run())
    for p in range(len(shapes)):
        mean = weighted_mean(torch.stack([inputs[s][p] for s in range(3)]), torch.ones(3))[0]
        expected = roundtrip(codec, [mean])[0]
        assert all(torch.equal(results[s][p], expected) for s in range(3))
        assert reducer.payloads[p] == codec.encode(mean)


def test_group_bits_separate_codecs() -> None:
    keyed = {name: round_group_bits(5, name) for name in (None, *LOSSY)}
    assert all(bits.startswith(format(5, "032b")) and len(bits) == 48 for bits in keyed.values())
    assert len(set(keyed.values())) == len(LOSSY) + 1
    assert round_group_bits(5, "int2") == keyed["int2"] != round_group_bits(6, "int2")


def test_a_changed_payload_layout_gets_its_own_group_key() -> None:
    # topk's indices went from fixed 12-bit to Elias–Fano under the same config name: peers of the two
    # layouts must never meet, so the key hashes the format's name, not the config's
    topk = TopKCodec()
    assert topk.name == "topk" and topk.wire_name != "topk"
    assert round_group_bits(5, topk.wire_name) != round_group_bits(5, "topk")
    assert all(make_codec(name).wire_name == name for name in LOSSY)


def test_a_sender_found_faulty_is_logged_with_every_senders_weight_and_norm(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A ban follows a faulty verdict: the reducer's log holds what it was based on, so a false one can be traced."""
    shape = torch.Size([64])

    def flag_the_largest(stacked: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        norms = torch.linalg.vector_norm(stacked, dim=1)
        return weighted_mean(stacked, weights)[0], [int(norms.argmax())]

    async def run() -> BufferingReducer:
        reducer = BufferingReducer((shape,), 3, flag_the_largest, None)
        parts = [torch.full((64,), 0.5), torch.full((64,), 1.0), torch.full((64,), 100.0)]
        await asyncio.gather(*(reducer.accumulate_part(i, 0, parts[i], weight=2.0) for i in range(3)))
        return reducer

    with caplog.at_level("WARNING", logger="peers.partreduce"):
        reducer = asyncio.run(run())
    assert reducer.faulty_senders == {2}
    (record,) = [r for r in caplog.records if r.name == "peers.partreduce"]
    assert record.getMessage() == (
        "part 0: sender(s) [2] dropped as faulty; every sender's (index, weight, norm): "
        "(0, 2, 4), (1, 2, 8), (2, 2, 800)"
    )
