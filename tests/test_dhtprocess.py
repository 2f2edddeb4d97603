"""peers/dhtprocess.py: a DHT request the host gave up on ends quietly in the DHT process."""

from __future__ import annotations

import asyncio
from concurrent.futures import InvalidStateError
from typing import Any

import pytest

from peers.dhtprocess import RunDHT


class CancelledMeanwhile:
    """An MPFuture the host cancelled between hivemind's `done()` check and its `set_result`."""

    def done(self) -> bool:
        return False

    def set_result(self, _: object) -> None:
        raise InvalidStateError("Can't set_result to a future that is CANCELLED")

    def set_exception(self, _: BaseException) -> None:
        raise InvalidStateError("Can't set_exception to a future that is CANCELLED")


class Node:
    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error

    async def get(self, key: Any, latest: bool, **_: Any) -> str:
        if self.error is not None:
            raise self.error
        return f"value of {key}"


def dht_with(node: Node) -> RunDHT:
    dht = RunDHT.__new__(RunDHT)  # the request handler alone: no process, no p2pd
    dht._node = node  # type: ignore[attr-defined]
    dht._parent_pid = -1  # not the process that would own a DHT: its __del__ shuts nothing down
    return dht


def test_a_reply_nobody_waits_for_is_dropped_not_raised() -> None:
    asyncio.run(dht_with(Node())._get("k", True, CancelledMeanwhile()))  # type: ignore[arg-type]


def test_a_failed_request_still_fails() -> None:
    class Unset:
        def done(self) -> bool:
            return False

        def set_exception(self, e: BaseException) -> None:
            self.error = e

    future = Unset()
    with pytest.raises(KeyError):
        asyncio.run(dht_with(Node(KeyError("k")))._get("k", True, future))  # type: ignore[arg-type]
    assert isinstance(future.error, KeyError)
