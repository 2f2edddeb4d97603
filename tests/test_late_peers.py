"""A peer a little slower than the rest stays in the run's groups (outer.late_peer_wait).

Real processes on loopback: a bootstrap and three peers at H = 40. Once all train, one peer's trainer is
throttled to 70 % of its time (its process is stopped for the rest of every 0.2 s, as on a slower
machine), so it finishes each round well after the others' matchmaking window has closed. The others
see from its record that it is about to finish and train on until then, and it averages with them.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.harness import Swarm

pytestmark = pytest.mark.integration

H = ("trainer.inner_steps=40", "trainer.warmup_steps=40")
SHARE = 0.7  # of the time the slow peer's trainer runs
ROUNDS = 6  # of the run's, measured once the slow peer is slow


def test_a_slower_peer_averages_with_the_others(swarm: Callable[..., Swarm]) -> None:
    s = swarm(3, *H)
    s.wait_all_at(1, timeout=150)
    slow = s.peers[-1]
    slow.throttle(SHARE)
    start = max(p.status()["outer_step"] for p in s.peers)
    s.wait_all_at(start + ROUNDS, timeout=ROUNDS * 40, peers=s.peers[:-1])
    rounds = [e for e in slow.status()["rounds"] if e["outer_step"] > start + 1]  # once its lag shows
    full = [e for e in rounds if e["result"] == "ok" and e["group_size"] == 3]
    resyncs = [e for e in rounds if e["result"] == "resynced"]
    assert len(full) >= ROUNDS - 2 and len(resyncs) <= 1, rounds
    waited = sum(p.output().count("more inner steps to meet them") for p in s.peers[:-1])
    assert waited >= 1, "the faster peers never trained on to meet the slow one"
