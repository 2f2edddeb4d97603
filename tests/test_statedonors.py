"""peers/state/donors.py: our declaration as a state donor ends quietly when the DHT is too slow for it, and a
donor's stream that lost parts of a tensor is refused with the count."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import split_for_streaming

from peers.state.donors import _tensor_from_parts, declared


def test_a_declaration_the_dht_never_answers_ends_when_it_would_expire(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> float:
        store: MPFuture[bool] = MPFuture()  # the DHT process never answers (overloaded)
        started = time.monotonic()
        await declared(store, get_dht_time() + 0.3)
        return time.monotonic() - started

    with caplog.at_level(logging.DEBUG, logger="peers.state.donors"):
        waited = asyncio.run(main())
    assert 0.25 < waited < 2.0
    assert "did not land before it expired" in caplog.text  # a debug line, not an ERROR from asyncio
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_failed_declaration_raises_nothing() -> None:
    async def main() -> None:
        store: MPFuture[bool] = MPFuture()
        store.set_exception(ConnectionError("the DHT process is gone"))
        await declared(store, get_dht_time() + 5)

    asyncio.run(main())


def test_a_declaration_that_lands_returns_at_once() -> None:
    async def main() -> float:
        store: MPFuture[bool] = MPFuture()
        store.set_result(True)
        started = time.monotonic()
        await declared(store, get_dht_time() + 5)
        return time.monotonic() - started

    assert asyncio.run(main()) < 1.0


def test_a_tensor_whose_stream_lost_parts_is_refused_with_the_count() -> None:
    tensor = torch.arange(128 * 384, dtype=torch.float32).reshape(128, 384)
    parts = list(split_for_streaming(serialize_torch_tensor(tensor, runtime_pb2.CompressionType.NONE)))
    assert len(parts) == 3  # 192 KiB in 64 KiB parts
    assert torch.equal(_tensor_from_parts(parts, 0), tensor)
    with pytest.raises(ValueError, match="broke off tensor 5: 1 of its 3 parts"):
        _tensor_from_parts(parts[:1], 5)
    # (without the count, the same stream failed as a bare shape error)
    with pytest.raises(RuntimeError, match="shape"):
        deserialize_torch_tensor(parts[0])
