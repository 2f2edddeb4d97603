"""A contributor serves the Δ it sent in its last rounds, and a scorer gets back what it sent (to int4's
rounding); bad requests and replies get one-line errors, never a crash."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dilocod.trust.deltas import DeltaStore, fetch_delta
from proto import ProtoError
from proto.deltas import PART_BYTES, decode_delta_reply, encode_delta_reply, encode_delta_request

SHAPES = [torch.Size([40, 30]), torch.Size([30])]


def sent(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def asker(store: DeltaStore):  # type: ignore[no-untyped-def]
    async def ask(request: bytes) -> bytes:
        return await store.handle("scorer", request)

    return ask


def test_a_scorer_gets_the_delta_sent_with_its_claims() -> None:
    store = DeltaStore()
    delta = sent(0)
    store.keep(7, delta, None, 4096, [0, 3, 0, 512])
    got = asyncio.run(fetch_delta(asker(store), 7, SHAPES))
    assert got.step == 7 and got.tokens == 4096 and got.parts == [(0, 3, 0, 512)]
    for a, b in zip(got.delta, delta):
        assert a.shape == b.shape
        assert float((a - b).abs().max()) <= float(b.abs().max()) / 7 + 1e-6  # int4's rounding


def test_only_the_last_rounds_are_kept() -> None:
    store = DeltaStore(keep_rounds=2)
    for step in range(5):
        store.keep(step, sent(step), None, 1, [])
    assert store.steps() == [3, 4]
    with pytest.raises(ValueError, match="no Δ kept for outer step 1"):
        asyncio.run(fetch_delta(asker(store), 1, SHAPES))


def test_a_fragment_delta_decodes_to_its_tensors() -> None:
    store = DeltaStore()
    store.keep(2, [sent(1)[1]], [1], 10, [])
    got = asyncio.run(fetch_delta(asker(store), 2, SHAPES))
    assert got.indices == [1] and [d.shape for d in got.delta] == [SHAPES[1]]


def test_a_delta_of_another_shape_is_refused() -> None:
    store = DeltaStore()
    store.keep(1, [torch.zeros(5)], None, 1, [])
    with pytest.raises(ValueError, match="elements"):
        asyncio.run(fetch_delta(asker(store), 1, SHAPES))


def test_our_own_delta_decodes_as_a_scorer_would_decode_it() -> None:
    store = DeltaStore()
    delta = sent(3)
    store.keep(5, delta, None, 64, [])
    fetched = asyncio.run(fetch_delta(asker(store), 5, SHAPES))
    own = store.own(5, SHAPES)
    assert own is not None and own[1] is None
    assert all(torch.equal(a, b) for a, b in zip(own[0], fetched.delta))  # the same reference on both sides
    store.keep(6, [sent(4)[1]], [1], 64, [])
    part = store.own(6, SHAPES)
    assert part is not None and part[1] == [1] and [t.shape for t in part[0]] == [SHAPES[1]]
    assert store.own(4, SHAPES) is None  # nothing kept for that round
    assert store.own(5, [torch.Size([7])]) is None  # kept for other shapes: no reference, no error


def test_a_non_finite_delta_is_not_kept() -> None:
    store = DeltaStore()
    store.keep(1, [torch.full((4,), float("nan"))], None, 1, [])
    assert store.steps() == []


def test_garbage_requests_get_an_error_reply() -> None:
    store = DeltaStore()
    reply = decode_delta_reply(asyncio.run(store.handle("x", b"\x00garbage")))
    assert "error" in reply and "\n" not in reply["error"]


def test_replies_are_strictly_checked() -> None:
    with pytest.raises(ProtoError, match="missing"):
        encode_delta_reply({"outer_step": 1})
    with pytest.raises(ProtoError, match="carries no Δ"):
        encode_delta_reply({"error": "x", "outer_step": 1})
    good = {"outer_step": 1, "codec": "int4", "numel": 4, "parts": 1, "part": 0, "payload": b"", "tokens": 0}
    with pytest.raises(ProtoError, match="part 1 of 1"):
        encode_delta_reply({**good, "part": 1})
    with pytest.raises(ProtoError, match="lo >= hi"):
        encode_delta_reply({**good, "chunks": [0, 1, 5, 5]})
    with pytest.raises(ProtoError):
        encode_delta_reply({**good, "payload": b"x" * (PART_BYTES + 1)})
    with pytest.raises(ProtoError):
        encode_delta_request({"outer_step": -1, "part": 0})
