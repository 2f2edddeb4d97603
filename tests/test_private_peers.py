"""Peers that accept no connections (client mode, as behind NAT) average through the reducing bootstrap.

On loopback, `net.reachability = "private"` makes a peer a client: it sends and receives but reduces
nothing, so two of them alone can never form a group. The bootstrap joins every round as an auxiliary
reducer (its default), which makes their rounds possible; with `--no-reduce` they are told exactly why
they cannot average. (Real NATs are exercised with the network-namespace test bed.)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.harness import FAST, Swarm, wait_for

pytestmark = pytest.mark.integration

PRIVATE = ("net.reachability=private",)


def test_private_peers_average_through_the_bootstrap(swarm: Callable[..., Swarm]) -> None:
    s = swarm(2, *PRIVATE)
    statuses = s.wait_all_at(3, timeout=240)
    for status in statuses:
        assert status["reachability"] == "private"
        assert status["group_size"] == 2, status["rounds"][-3:]
    hashes = {st["global_sha256"] for st in statuses if st["outer_step"] == statuses[0]["outer_step"]}
    by_step: dict[int, set[str]] = {}
    for st in statuses:
        for entry in st["rounds"]:
            if entry["result"] == "ok":
                by_step.setdefault(entry["outer_step"], set()).add(entry["global_sha256"])
    assert any(len(found) == 1 for step, found in by_step.items() if step >= 1), by_step
    assert all(len(found) == 1 for found in by_step.values()), by_step
    assert hashes


def test_without_a_public_reducer_private_peers_are_told_why(tmp_path: Path) -> None:
    s = Swarm(
        tmp_path,
        overrides=(*FAST, *PRIVATE, "averaging.matchmaking_timeout=3", "averaging.min_matchmaking_time=1"),
    )
    try:
        s.start_bootstrap("dilocod", "--no-reduce")
        peers = [s.add_peer(), s.add_peer()]
        for peer in peers:
            log = peer.run_dir / "dilocod.log"  # type: ignore[operator]
            wait_for(
                "the 'no public reducer' explanation",
                lambda log=log: log.exists() and "no public reducer in run" in log.read_text(),
                180,
            )
    finally:
        s.close()
