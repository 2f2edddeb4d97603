"""The `netbed` fixture: a fresh namespace test bed per test (see tests/netbed.py, docs/testbed.md).

Wired into the suite by `from tests.conftest_netbed import netbed  # noqa: F401` in tests/conftest.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.netbed import NetBed, cleanup_stale, require_netns


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
