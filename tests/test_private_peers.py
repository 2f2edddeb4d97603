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

from dilocod.node.demo import free_port
from tests.harness import FAST, REPO, Proc, Swarm, wait_for

pytestmark = pytest.mark.integration

PRIVATE = ("net.reachability=private",)


@pytest.mark.parametrize(
    ("overlap", "compression"), [("none", "int4"), ("delayed", "int4"), ("streaming", "topk")]
)
def test_private_peers_average_through_the_bootstrap(
    swarm: Callable[..., Swarm], overlap: str, compression: str
) -> None:
    """In every overlap mode the reducing bootstrap meets the private peers' groups (with overlap it once
    followed the round they trained instead of the step they averaged, and met none of them again after a
    round that was not applied). With topk the bootstrap relays the private peers' payloads to each other."""
    s = swarm(2, *PRIVATE, f"outer.overlap={overlap}", f"averaging.compression={compression}")
    try:
        statuses = s.wait_all_at(3, timeout=180)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{s.log_tails()}") from None
    for status in statuses:
        assert status["reachability"] == "private"
        assert status["group_size"] == 2, status["rounds"][-3:]
    by_step: dict[int, set[str]] = {}
    for st in statuses:
        for entry in st["rounds"]:
            if entry["result"] == "ok":
                by_step.setdefault(entry["outer_step"], set()).add(entry["global_sha256"])
    # θ_global agrees: every step both peers applied has one hash, and at least one step after the first
    assert any(len(found) == 1 for step, found in by_step.items() if step >= 1), by_step
    assert all(len(found) == 1 for found in by_step.values()), (by_step, s.log_tails())
    assert s.bootstrap is not None and s.bootstrap.status()["reducer"]["rounds_reduced"] >= 2


def test_three_private_peers_with_overlap_average_as_one_group_early(swarm: Callable[..., Swarm]) -> None:
    """With overlap the bootstrap joins a round's group at the launch that opened the trainers' next round.
    It once also joined the run's first round as it opened, holding a matchmaking from the start: the first
    peer to close met it alone, θ_global split, and no private peer can give another the run's state, so
    the odd one out stayed behind for good (4 runs of 4 here, once rounds took a few seconds)."""
    s = swarm(3, *PRIVATE, "outer.overlap=delayed", "trainer.inner_steps=20")
    try:
        statuses = s.wait_all_at(4, timeout=240)
        # A peer that starts late on a busy machine may spend its first round catching up; but by step 4
        # the three average together and hold one θ_global (the odd one out never did).
        fourth: dict[str, str] = {}
        for status in statuses:
            rounds = {e["outer_step"]: e for e in status["rounds"]}
            assert 4 in rounds, (status["peer_id"], sorted(rounds))
            entry = rounds[4]
            assert (entry["result"], entry["group_size"]) == ("ok", 3), (status["peer_id"], entry)
            fourth[status["peer_id"]] = entry["global_sha256"]
        assert len(set(fourth.values())) == 1, fourth
    except AssertionError as e:
        raise AssertionError(f"{e}\n{s.log_tails()}") from None


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
                lambda log=log: log.exists() and "no public reducer in this run" in log.read_text(),
                180,
            )
    finally:
        s.close()


def test_a_second_reducing_bootstrap_takes_parts_by_bandwidth(tmp_path: Path) -> None:
    """Two public reducers for one run: parts are split between them by their stated bandwidths."""
    s = Swarm(tmp_path, overrides=(*FAST, *PRIVATE))
    second: Proc | None = None
    try:
        s.start_bootstrap("dilocod", "--set", "net.bandwidth=100")
        assert s.bootstrap is not None
        port = free_port()
        sets = [item for o in (*FAST, *PRIVATE, "net.bandwidth=300") for item in ("--set", o)]
        second = Proc(
            "bootstrap-2",
            ["bootstrap", s.maddr, "--host", "127.0.0.1", "--port", "0", "--http-host", "127.0.0.1",
             "--http-port", str(port), "--config", str(REPO / "configs" / "tiny.toml"), *sets],
            tmp_path / "bootstrap-2.log",
            port,
        )  # fmt: skip
        second.start()
        wait_for("the second bootstrap", second.status, 60)
        s.add_peer()
        s.add_peer()
        reducers = (s.bootstrap, second)

        def reduced() -> list[dict[str, int]]:
            return [r.status()["reducer"] for r in reducers]  # type: ignore[union-attr]

        # Counted from a round both reducers are in: rounds take ~2 s, and one that the second bootstrap,
        # still starting, missed gave the first every part (CI saw a ratio of 2.19 over whole runs).
        start = wait_for(
            "both reducers in a round",
            lambda: (r := reduced()) and min(x["rounds_reduced"] for x in r) >= 1 and r,
            240,
        )
        end = wait_for(
            "3 more rounds reduced by each",
            lambda: (
                (r := reduced())
                and all(b["rounds_reduced"] >= a["rounds_reduced"] + 3 for a, b in zip(start, r))
                and r
            ),
            240,
        )
        # Each reducer receives every client's copy of its parts: bytes received ∝ its share (1 : 3).
        first, later = [e["bytes_received"] - b["bytes_received"] for b, e in zip(start, end)]
        assert 2.5 < later / first < 3.5, (start, end)
    finally:
        if second is not None:
            second.stop()
        s.close()
