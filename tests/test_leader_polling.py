"""The pace of a matchmaking peer's reads of its group key (peers/averager.py `_paced`): hivemind re-reads
the key's averagers back to back while it knows no leader, so a lone peer would look the key up ~50 times
a second for its whole matchmaking window; paced, it reads at most once per interval."""

from __future__ import annotations

import asyncio
import time

import pytest

from peers.averager import _paced


def test_back_to_back_reads_start_one_interval_apart() -> None:
    started: list[float] = []

    async def read(key: str) -> str:
        started.append(time.monotonic())
        return key

    async def main() -> list[str]:
        paced = _paced(read, 0.1)
        return [await paced(f"k{i}") for i in range(4)]

    assert asyncio.run(main()) == ["k0", "k1", "k2", "k3"]
    gaps = [b - a for a, b in zip(started, started[1:])]
    assert all(gap >= 0.095 for gap in gaps), gaps
    assert sum(gaps) < 0.3 + 0.25, gaps  # waits only for its turn, not more


def test_a_read_after_a_pause_goes_at_once_and_errors_pass_through() -> None:
    calls = 0

    async def read() -> None:
        nonlocal calls
        calls += 1
        raise ConnectionError("the DHT is down")

    async def main() -> float:
        paced = _paced(read, 0.05)
        with pytest.raises(ConnectionError):
            await paced()
        await asyncio.sleep(0.08)
        began = time.monotonic()
        with pytest.raises(ConnectionError):
            await paced()
        return time.monotonic() - began

    assert asyncio.run(main()) < 0.04 and calls == 2
