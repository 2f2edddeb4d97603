"""Relayed parts (peers/partrelay.py) as tables: the statuses a reducer sends, what a receiver rebuilds from a
reply, and every malformed reply refused."""

from __future__ import annotations

import pytest
import torch

from dilocod.codecs import TopKCodec, make_codec
from peers.partrelay import ABSENT, PAYLOAD, ZERO, pack_reply, relays, statuses, unpack_rows

CODEC = TopKCodec(64, 4, 2)
NUMEL = 256


def payload(seed: int) -> bytes:
    return CODEC.encode(torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)))


PAYLOADS = {s: payload(s) for s in range(4)}


def test_only_sparse_codecs_relay() -> None:
    assert relays(CODEC) and not relays(make_codec("int4")) and not relays(None)


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        ([(0, 1.0), (1, 1.0), (2, 0.5)], [PAYLOAD, PAYLOAD, PAYLOAD, ABSENT]),
        ([(0, 1.0), (2, 0.0), (3, 1.0)], [PAYLOAD, ABSENT, ZERO, PAYLOAD]),
        ([], [ABSENT] * 4),
    ],
)
def test_statuses(rows: list[tuple[int, float]], expected: list[int]) -> None:
    assert statuses(4, rows) == expected


def test_a_receiver_rebuilds_the_reducers_rows_in_its_order() -> None:
    status = [PAYLOAD, ZERO, PAYLOAD, ABSENT]
    weights = [1.0, 1.0, 0.5, 1.0]
    reply = pack_reply(status, {0: PAYLOADS[0], 2: PAYLOADS[2]}, receiver=2)
    assert reply == bytes(status) + PAYLOADS[0]  # the receiver's own payload is not sent back
    rows = unpack_rows(reply, receiver=2, own_payload=PAYLOADS[2], codec=CODEC, numel=NUMEL, weights=weights)
    assert rows is not None
    stacked, row_weights = rows
    assert torch.equal(stacked[0], CODEC.decode(PAYLOADS[0], NUMEL))
    assert torch.equal(stacked[1], torch.zeros(NUMEL))  # screened: zeros, weight 0
    assert torch.equal(stacked[2], CODEC.decode(PAYLOADS[2], NUMEL))
    assert row_weights.tolist() == [1.0, 0.0, 0.5]  # sender 3 absent: not a row at all


def malformed_replies() -> list[bytes]:
    good = bytes([PAYLOAD, PAYLOAD, ABSENT, ABSENT]) + PAYLOADS[0]
    return [
        good[:-1],  # short
        good + b"\x00",  # long
        bytes([PAYLOAD, PAYLOAD, 7, ABSENT]) + PAYLOADS[0],  # an unknown status
        bytes([PAYLOAD, PAYLOAD, PAYLOAD, ABSENT]) + PAYLOADS[0],  # a payload announced, not sent
        b"\x02\x02",  # statuses cut short
        bytes([PAYLOAD, PAYLOAD, ABSENT, PAYLOAD]) + PAYLOADS[0] + PAYLOADS[3],  # sender 3 has weight 0
        bytes([PAYLOAD, PAYLOAD, ABSENT, ABSENT]) + b"\xff" * len(PAYLOADS[0]),  # does not decode
    ]


@pytest.mark.parametrize("reply", malformed_replies())
def test_malformed_replies_are_refused(reply: bytes) -> None:
    weights = [1.0, 1.0, 1.0, 0.0]
    assert (
        unpack_rows(reply, receiver=1, own_payload=PAYLOADS[1], codec=CODEC, numel=NUMEL, weights=weights)
        is None
    )
