"""hivemind's DHT with the tasks of its process kept alive.

The DHT process runs each request from the host (`get`, `store`, `run_coroutine`) as an asyncio task
and keeps no reference to it (hivemind 1.1.12, dht/dht.py:133: `task = asyncio.create_task(...)`,
overwritten by the next request). asyncio holds tasks only weakly, so a pending task whose awaited
future is referenced by nothing else can be collected mid-flight ("Task was destroyed but it is
pending!", a `GeneratorExit` in `_run_coroutine`); the host then waits on its MPFuture forever. Seen
once in a full test run: a peer behind NAT hung at start, its averager waiting for the DHT. Each
request's task now holds itself in a set until it ends.

A request the host gave up on (its MPFuture cancelled by a timeout) can still finish in the DHT process,
whose `set_result` then raises `InvalidStateError` between hivemind's `done()` check and the call: an
ERROR "Task exception was never retrieved" in the log for a reply nobody waits for. It is dropped here.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import InvalidStateError
from typing import Any

import hivemind


class RunDHT(hivemind.DHT):
    _running: set[asyncio.Task[Any]] = set()  # lives in the DHT process (a fork): its requests' tasks

    async def _get(self, *args: Any, **kwargs: Any) -> Any:
        with _held(), contextlib.suppress(InvalidStateError):  # the host gave up on this request
            return await super()._get(*args, **kwargs)

    async def _store(self, *args: Any, **kwargs: Any) -> Any:
        with _held(), contextlib.suppress(InvalidStateError):  # the host gave up on this request
            return await super()._store(*args, **kwargs)

    async def _run_coroutine(self, *args: Any, **kwargs: Any) -> Any:
        with _held(), contextlib.suppress(InvalidStateError):  # the host gave up on this request
            return await super()._run_coroutine(*args, **kwargs)


class _held:
    """Keep the current task referenced while the block runs."""

    def __enter__(self) -> None:
        self.task = asyncio.current_task()
        if self.task is not None:
            RunDHT._running.add(self.task)

    def __exit__(self, *_: object) -> None:
        if self.task is not None:
            RunDHT._running.discard(self.task)
