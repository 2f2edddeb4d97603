"""Unequal machines on the run's clock, through the CLI: a slower peer counts, a frozen peer is back
within two rounds of its thaw, equal peers stay in one full group, and more peers than
`averaging.group_size` still make one θ_global per round (with the sparse `topk` exchange).

Every peer closes each round when the run's clock (dilocod/rounds/clock.py) says the run's tokens are
in, so the group meets at once; contributions are weighted by their tokens.
"""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest

from tests.harness import Swarm, round_hashes, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]  # waits of up to 420 s below

# Rounds of ~10 inner steps of a reference peer: long enough that a round's fixed cost (matchmaking and
# the all-reduce, ~1 s on a loaded 2-core machine) leaves the fast peers well over 70 % of their time in
# steps, far from the ~50 % of a peer that would wait for one at half its speed.
LONG_ROUNDS = ("trainer.inner_steps=40",)


def ok_steps(status: dict[str, Any], size: int | None = None) -> set[int]:
    """Outer steps this peer reached in a successful round (of `size` trainers, if given)."""
    return {
        e["outer_step"]
        for e in status["rounds"]
        if e["result"] == "ok" and (size is None or e["group_size"] == size)
    }


def assert_one_theta_per_step(statuses: list[dict[str, Any]], after: int = -1) -> None:
    for step, found in round_hashes(statuses).items():
        if step > after:
            assert len(found) == 1, f"peers disagree on θ_global after outer step {step}: {found}"


def test_a_slower_peer_counts_and_a_frozen_one_is_back_within_two_rounds(swarm: Callable[..., Swarm]) -> None:
    s = swarm(3, *LONG_ROUNDS)
    for peer in s.peers:
        s.wait_serving(peer)
    slow, fast = s.peers[2], s.peers[:2]
    slow.throttle(0.5)  # runs half of the time: each of its inner steps takes ~2× as long
    start = max(p.status()["outer_step"] for p in s.peers)
    statuses = s.wait_all_at(start + 11, timeout=420)
    assert_one_theta_per_step(statuses)

    # The run's successful rounds since the throttle (those the fast peers applied together) …
    run_rounds = set.intersection(*(ok_steps(st) for st in statuses[:2])) - set(range(start + 2))
    assert len(run_rounds) >= 8, run_rounds
    # … have the slow peer in ≥ 80 % of them, and ≥ 80 % of its tokens reached θ_global.
    slow_status = statuses[2]
    assert len(run_rounds & ok_steps(slow_status)) >= 0.8 * len(run_rounds), (
        run_rounds,
        slow_status["rounds"],
    )
    assert slow_status["contribution_share"] >= 0.8, slow_status["contribution_share"]
    # Its contributions count by their tokens: about half a fast peer's.
    tokens = {
        name: [e["tokens"] for e in st["rounds"] if e["result"] == "ok" and e["outer_step"] in run_rounds]
        for name, st in (("fast", statuses[0]), ("slow", slow_status))
    }
    assert sum(tokens["slow"]) < 0.8 * sum(tokens["fast"]), tokens
    # The fast peers never wait for the slow one: waiting for a peer at half their speed would leave them
    # about half their time in steps; not waiting, only a round's fixed cost is lost (0.77-0.9 measured on
    # a loaded 2-core machine, where that cost is ~1 s of a ~4 s round).
    for st in statuses[:2]:
        assert st["compute_utilization"] >= 0.7, (st["peer_id"], st["compute_utilization"])
        assert st["contributing"] and st["not_contributing_reason"] is None

    # A peer frozen for 6 s (SIGSTOP: its process, not its network children) is in a successful round
    # again within two rounds of its thaw.
    slow.unthrottle()
    frozen = fast[1]
    assert frozen.popen is not None
    frozen.popen.send_signal(signal.SIGSTOP)
    time.sleep(6)
    frozen.popen.send_signal(signal.SIGCONT)
    thawed_at = max(p.status()["outer_step"] for p in (fast[0], slow))
    back = wait_for(
        "the thawed peer in a successful round",
        lambda: [step for step in ok_steps(frozen.status()) if step > thawed_at],
        180,
    )
    assert min(back) <= thawed_at + 2, (thawed_at, sorted(back))
    assert_one_theta_per_step([p.status() for p in s.peers])


def test_equal_peers_stay_in_one_full_group(swarm: Callable[..., Swarm]) -> None:
    # The harness's 1.5 s matchmaking window. Before the run waited for joining peers, a peer that missed
    # the first round here re-synced and then missed every round after it ("the run closed round k
    # without us", 67 times in a row in a full suite on 2 cores): its download outlasted what was left
    # of each round. Now the round it is joining stays open for it (docs/architecture.md).
    s = swarm(4)
    # From once all four train together (peers start seconds apart, and the first rounds sort that out).
    full = wait_for(
        "a round with all four",
        lambda: [
            e["outer_step"]
            for e in s.peers[0].status()["rounds"]
            if e["result"] == "ok" and e["group_size"] == 4
        ],
        240,
    )
    first_full = full[0] + 2
    statuses = s.wait_all_at(first_full + 12, timeout=360)
    assert_one_theta_per_step(statuses)
    peer_rounds = [
        (e["outer_step"], e) for st in statuses for e in st["rounds"] if e["outer_step"] > first_full
    ]
    # A round whose all-reduce raised or timed out (`failed`) found its group: that is the transport (the
    # cut reply stream of issue 15), not the clock. Such steps are bounded separately; the clock is judged
    # on the rest: every other peer-round is in the full group.
    failed_steps = {step for step, e in peer_rounds if e["result"] == "failed"}
    # A peer the run left behind once (its round closed without it: a stall of the loaded machine, seen in
    # CI) re-syncs and is back in the next round; that round and the next are the episode's, judged apart.
    late_steps = {step for step, e in peer_rounds if e["result"] == "late"}
    assert len(late_steps) <= 1, sorted(late_steps)  # the report carries the log tails (conftest)
    episode = late_steps | {step + 1 for step in late_steps}
    judged = [(step, e) for step, e in peer_rounds if e["result"] != "failed" and step not in episode]
    full_group = [e for _, e in judged if e["result"] == "ok" and e["group_size"] == 4]
    assert len(full_group) >= 0.95 * len(judged), sorted(
        (step, e["result"], e["group_size"]) for step, e in judged if e not in full_group
    )
    assert len(failed_steps) <= 3, sorted(failed_steps)


def test_more_peers_than_a_group_holds_make_one_theta_per_round(swarm: Callable[..., Swarm]) -> None:
    # With `topk` (the other scenarios run int4): 3 of the 6 trainers and the bootstrap reduce, so the reducers
    # relay every sender's sparse payload of their parts to members that reduce nothing (peers/partrelay.py).
    s = swarm(6, "averaging.group_size=3", "averaging.compression=topk")
    # Six peers start seconds apart and appear in each other's DHT view over the first rounds, while two
    # groups can still form (docs/architecture.md); a late one then re-syncs. Judge the run once all are in.
    statuses = s.wait_all_at(2, timeout=300)
    start = max(st["outer_step"] for st in statuses) + 2
    statuses = s.wait_all_at(start + 5, timeout=300)
    # Two groups can still form at one step now and then (a DHT view lagging on a loaded machine, seen in
    # CI; docs/architecture.md): the minority re-syncs to the majority and every later step has one θ.
    hashes = round_hashes(statuses)
    split = sorted(step for step, found in hashes.items() if step > start and len(found) > 1)
    assert len(split) <= 1, split  # the report carries the log tails (conftest)
    assert_one_theta_per_step(statuses, after=max(split, default=start))
    # Every other round from then on was one group of everyone there: nobody's group won over another's. A
    # member whose round failed in transport (a reducer's reply stream cut short, issue 15) was in that group
    # too: it counts as a member, at most twice in the 5 rounds (the 4-equal-peer test counts them apart
    # likewise). The split step and the next (its minority re-syncing) are not judged here.
    window = [step for step in range(start + 1, start + 6) if step not in split and step - 1 not in split]
    members: dict[int, int] = defaultdict(int)
    sizes: dict[int, set[int]] = defaultdict(set)
    cut = 0
    for st in statuses:
        for e in st["rounds"]:
            if e["result"] == "ok" and e["outer_step"] in window:
                members[e["outer_step"]] += 1
                sizes[e["outer_step"]].add(e["group_size"])
            elif e["result"] == "failed" and e["outer_step"] + 1 in window:  # recorded at the step it left
                members[e["outer_step"] + 1] += 1
                cut += 1
    assert cut <= 2, f"{cut} transport failures in 5 rounds"
    missed = sorted(
        (e["outer_step"], st["peer_id"][-6:], e["result"], e.get("reason"))
        for st in statuses for e in st["rounds"]
        if e["outer_step"] in window and e["result"] not in ("ok", "failed")
    )  # fmt: skip
    assert sorted(members) == window and all(sizes[step] == {members[step]} for step in window), (
        sorted(members.items()),
        sorted(sizes.items()),
        missed,
    )
    # A peer the run left behind (its round closed without it on these 2 loaded cores: `late`, then it
    # re-syncs, keeping its progress) misses two rounds at most, once in these peer-rounds; no peer is
    # absent without a record of why.
    assert sum(members.values()) >= 6 * len(window) - 2 and len(missed) <= 2, missed


PAUSE_SECONDS = 25


def test_a_paused_peer_never_sets_the_runs_pace(swarm: Callable[..., Swarm]) -> None:
    """A member whose whole machine stalls (its process group stopped, network included, as a laptop
    closed mid-round) costs the run at most the round it stalled in: the others close rounds on the run's
    clock without it, and it is back once it runs again."""
    s = swarm(3)
    s.wait_all_at(2, timeout=240)
    paused, others = s.peers[2], s.peers[:2]
    assert paused.popen is not None
    os.killpg(paused.popen.pid, signal.SIGSTOP)
    try:
        began = max(p.status()["outer_step"] for p in others)
        time.sleep(PAUSE_SECONDS)
        during = [p.status() for p in others]
    finally:
        os.killpg(paused.popen.pid, signal.SIGCONT)
    # H = 5 steps of 8 × 64 tokens: a round takes ~2 s here; waiting for the paused peer would stall.
    assert min(st["outer_step"] for st in during) >= began + 4, (began, [st["rounds"][-6:] for st in during])
    for st in during:  # no round of theirs waited long for it: the longest costs at most its deadlines
        rounds = [e for e in st["rounds"] if e["outer_step"] > began]
        assert max(e["seconds"] for e in rounds) < 15, rounds
        assert sum(e["result"] == "ok" for e in rounds) >= len(rounds) - 2, rounds
    thawed_at = max(p.status()["outer_step"] for p in others)
    back = wait_for(
        "the paused peer in a successful round",
        lambda: [step for step in ok_steps(paused.status()) if step > thawed_at],
        120,
    )
    assert min(back) <= thawed_at + 4, (thawed_at, sorted(back))
    assert_one_theta_per_step([p.status() for p in s.peers], after=began)
