"""Relayed parts (peers/partrelay.py) as tables: the statuses and coefficients a reducer sends, what a receiver
combines from a reply, the same bits as the reducer, and every malformed or implausible reply refused."""

from __future__ import annotations

import struct

import pytest
import torch

from dilocod.codecs import TopKCodec, make_codec
from peers.partrelay import (
    ABSENT,
    PAYLOAD,
    ZERO,
    combine,
    mean_weigh,
    pack_reply,
    relays,
    statuses,
    unpack_reply,
)

CODEC = TopKCodec(64, 4, 2)
NUMEL = 256
WEIGHTS = [1.0, 1.0, 0.5, 1.0]


def payload(seed: int) -> bytes:
    return CODEC.encode(torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)))


PAYLOADS = {s: payload(s) for s in range(4)}


def unpack(reply: bytes, receiver: int = 2) -> torch.Tensor | None:
    return unpack_reply(
        reply, receiver=receiver, own_payload=PAYLOADS[receiver], codec=CODEC, numel=NUMEL, weights=WEIGHTS
    )


def test_only_sparse_codecs_relay() -> None:
    assert relays(CODEC) and not relays(make_codec("int4")) and not relays(None)


@pytest.mark.parametrize(
    ("rows", "coefficients", "expected"),
    [
        ([0, 1, 2], [0.4, 0.4, 0.2, 0.0], [PAYLOAD, PAYLOAD, PAYLOAD, ABSENT]),
        ([0, 2, 3], [0.5, 0.0, 0.0, 0.5], [PAYLOAD, ABSENT, ZERO, PAYLOAD]),  # 2 screened: not relayed
        ([], [0.0] * 4, [ABSENT] * 4),
    ],
)
def test_statuses(rows: list[int], coefficients: list[float], expected: list[int]) -> None:
    assert statuses(rows, coefficients) == expected


def test_combine_is_the_coefficients_sum_in_float64_skipping_zero_rows() -> None:
    rows = torch.tensor([[1.0, 2.0], [float("nan"), 5.0], [3.0, -1.0]])
    got = combine(rows, [0.25, 0.0, 0.5])
    assert torch.equal(got, torch.tensor([1.75, 0.0]))
    coefficients, faulty = mean_weigh(rows, torch.tensor([1.0, 0.0, 3.0]))
    assert coefficients.tolist() == [0.25, 0.0, 0.75] and faulty == []


def test_a_receiver_combines_what_the_reducer_combined() -> None:
    status = [PAYLOAD, ZERO, PAYLOAD, ABSENT]
    coefficients = [0.6, 0.0, 0.25, 0.0]
    reply = pack_reply(status, coefficients, {0: PAYLOADS[0], 2: PAYLOADS[2]}, receiver=2)
    head = bytes(status) + b"".join(struct.pack("<d", c) for c in coefficients)
    assert reply == head + PAYLOADS[0]  # the receiver's own payload is not sent back
    rows = torch.stack([CODEC.decode(PAYLOADS[s], NUMEL) for s in (0, 2)])
    at_reducer = combine(rows, [0.6, 0.25])
    got = unpack(reply)
    assert got is not None and torch.equal(got, at_reducer)


def malformed_replies() -> list[bytes]:
    def reply(status: list[int], coefficients: list[float], *senders: int) -> bytes:
        head = bytes(status) + b"".join(struct.pack("<d", c) for c in coefficients)
        return head + b"".join(PAYLOADS[s] for s in senders)

    good = [PAYLOAD, ABSENT, PAYLOAD, ABSENT], [0.5, 0.0, 0.25, 0.0]
    return [
        reply(*good, 0)[:-1],  # short
        reply(*good, 0) + b"\x00",  # long
        reply([PAYLOAD, ABSENT, PAYLOAD, 7], good[1], 0),  # an unknown status
        reply([PAYLOAD, PAYLOAD, PAYLOAD, ABSENT], good[1], 0),  # a payload announced, not sent
        b"\x02\x02",  # cut short in the statuses
        reply(*good)[:10],  # cut short in the coefficients
        reply(*good, 0)[: -len(PAYLOADS[0])] + b"\xff" * len(PAYLOADS[0]),  # does not decode
        reply(good[0], [-0.1, 0.0, 0.25, 0.0], 0),  # a negative coefficient
        reply(good[0], [float("nan"), 0.0, 0.25, 0.0], 0),  # not a number
        reply(good[0], [0.5, 0.0, 0.25, 0.1], 0),  # a coefficient for a sender without a payload
        reply(good[0], [0.7, 0.0, 0.25, 0.0], 0),  # above its share: 1 of the payloads' weight 1.5
        reply(good[0], [0.0, 0.0, 0.25, 0.0], 0),  # a payload relayed with coefficient 0
    ]


@pytest.mark.parametrize("reply", malformed_replies())
def test_malformed_or_implausible_replies_are_refused(reply: bytes) -> None:
    assert unpack(reply) is None


def test_a_payload_from_a_sender_of_weight_zero_is_refused() -> None:
    reply = pack_reply([PAYLOAD, ABSENT, ABSENT, ABSENT], [0.5, 0.0, 0.0, 0.0], {0: PAYLOADS[0]}, receiver=2)
    assert unpack(reply) is not None
    zero_weight = unpack_reply(
        reply, receiver=2, own_payload=PAYLOADS[2], codec=CODEC, numel=NUMEL, weights=[0.0, 1.0, 1.0, 1.0]
    )
    assert zero_weight is None
