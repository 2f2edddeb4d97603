"""peers/statedonors.py: our declaration as a state donor ends quietly when the DHT is too slow for it."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from hivemind.utils import get_dht_time
from hivemind.utils.mpfuture import MPFuture

from peers.statedonors import declared


def test_a_declaration_the_dht_never_answers_ends_when_it_would_expire(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> float:
        store: MPFuture[bool] = MPFuture()  # the DHT process never answers (overloaded)
        started = time.monotonic()
        await declared(store, get_dht_time() + 0.3)
        return time.monotonic() - started

    with caplog.at_level(logging.DEBUG, logger="peers.statedonors"):
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
