"""The `netbed` fixture: a fresh namespace test bed per test (see tests/netbed.py, docs/testbed.md).

Wired into the suite by `from tests.conftest_netbed import netbed, wan` in tests/conftest.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.netbed import NetBed, cleanup_stale, require_netns
from tests.wanrun import NetSwarm, make_net_swarm


@pytest.fixture
def netbed() -> Iterator[NetBed]:
    """A bed with its `inet` and the public host `pub`; add hosts with `add_nat` / `add_public`.

    Skips when the machine cannot build one (fails instead under CI=true). Leftovers of crashed
    runs are removed first; everything this bed made is removed afterwards, pass or fail.
    """
    require_netns()
    cleanup_stale()
    with NetBed() as bed:
        yield bed
        bed.check()  # a dead delay line means the test ran on a broken link


@pytest.fixture
def wan(netbed: NetBed, tmp_path: Path) -> Iterator[Callable[..., NetSwarm]]:
    """`wan(*overrides)`: a NetSwarm on this test's bed; closed (every process reaped) before the bed goes."""
    made: list[NetSwarm] = []

    def make(*extra: str) -> NetSwarm:
        s = make_net_swarm(netbed, tmp_path / f"wan-{len(made)}", *extra)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()
