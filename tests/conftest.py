"""Shared fixtures. Multi-process tests use `swarm`, which always reaps every process it started."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dilocod.data.prepare import prepare
from dilocod.data.shards import load_index
from tests import harness
from tests.conftest_netbed import netbed, wan  # noqa: F401  (the network-namespace test bed)
from tests.harness import FAST, Swarm


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`@pytest.mark.cuda` tests need a GPU: skipped where torch sees none (CI has none either)."""
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(  # CUDA only: CI has no GPU; root, netns and chromium tests never skip under CI=true
        reason="needs a CUDA device (torch.cuda.is_available() is false); CI has no GPU, so these run only on a GPU machine, unlike root/netns/chromium tests, which fail under CI=true"
    )
    for item in cuda_items:
        item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed swarm test shows every process's log tail: a timing failure in CI says why it happened."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    shown: set[int] = set()
    for name in ("swarm", "module_swarm"):
        make = getattr(item, "funcargs", {}).get(name)
        for i, s in enumerate(getattr(make, "made", [])):
            report.sections.append((f"log tails of {name} {i}", s.log_tails(2500)))
            shown.add(id(s))
    for i, s in enumerate(harness.SWARMS_OF_THIS_TEST):  # made by the test itself (Swarm(...))
        if id(s) not in shown:
            report.sections.append((f"log tails of the test's swarm {i}", s.log_tails(2500)))


@pytest.fixture(autouse=True)
def _forget_the_last_tests_swarms() -> None:
    harness.SWARMS_OF_THIS_TEST.clear()


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

    make.made = made  # type: ignore[attr-defined]  # for the failure report's log tails
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


@pytest.fixture
def partial_dataset(tmp_path: Path) -> Path:
    """A prepared byte dataset of several 4,096-token training shards, the second and third of which are
    missing: a joiner's partial copy."""
    text = tmp_path / "text"
    text.mkdir()
    for i in range(12):
        (text / f"doc{i}.txt").write_text(f"document {i} " * 400)
    out = tmp_path / "ds"
    prepare([text], "byte", out, eval_fraction=0.2, shard_tokens=4096, progress=False)
    index = load_index(out)
    assert len(index.train.shards) >= 4
    for info in index.train.shards[1:3]:
        (out / info.file).unlink()
    return out
