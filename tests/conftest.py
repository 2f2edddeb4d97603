"""Shared fixtures. Multi-process tests use `swarm`, which always reaps every process it started."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest_netbed import netbed  # noqa: F401  (the network-namespace test bed)
from tests.harness import FAST, Swarm


def _swarm_factory(root: Path) -> tuple[Callable[..., Swarm], list[Swarm]]:
    made: list[Swarm] = []

    def make(n: int, *extra: str, bootstrap: bool = True) -> Swarm:
        s = Swarm(root / f"swarm-{len(made)}", overrides=(*FAST, *extra))
        made.append(s)
        if bootstrap:
            s.start_bootstrap()
        for _ in range(n):
            s.add_peer()
        return s

    return make, made


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[Callable[..., Swarm]]:
    """`swarm(n)`: a bootstrap plus n peers (tiny preset, fast settings), started through the CLI."""
    make, made = _swarm_factory(tmp_path)
    yield make
    for s in made:
        s.close()


@pytest.fixture(scope="module")
def module_swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Swarm]]:
    """`swarm` shared by the tests of one module: started on first use, reaped after the module's last test."""
    make, made = _swarm_factory(tmp_path_factory.mktemp("module-swarm"))
    yield make
    for s in made:
        s.close()
