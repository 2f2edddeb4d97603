"""The simulated peers: what each is (speed, link, latency, NAT) and what it holds while the run goes on.

A peer's fixed traits are drawn from the scenario's seeded generator; everything else is the simulation's
bookkeeping of what the real daemon would hold (its round machine's state, its round's tokens, its leases).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from bench.netsim.settings import (
    BASE_TOKENS_PER_SECOND,
    CPU_SHARE_IN_MIX,
    CPU_SPEED_IN_MIX,
    RunParams,
    Scenario,
)
from dilocod.rounds.machine import RoundState
from peers.deadlines import AdaptiveDeadlines, DeadlineBounds
from peers.linkbudget import MBIT, LinkEstimate, prior_rate


@dataclass(frozen=True)
class Traits:
    """What a peer is: fixed for its life."""

    peer_id: str
    private: bool
    tokens_per_second: float
    up: float  # bytes/s
    down: float  # bytes/s
    rtt: float  # seconds, to the median peer


@dataclass
class Peer:
    """A live (or dead) simulated peer: its traits and the state the daemon would keep."""

    traits: Traits
    machine: RoundState
    deadlines: AdaptiveDeadlines  # peers/deadlines.py, fed as peers/group.py feeds it
    link: LinkEstimate  # peers/linkbudget.py: this node's goodput as its averager measures it
    started: float  # when it started (a joiner: when it began to join)
    alive: bool = True
    sha: str = "g0"  # the θ_global it holds (a lineage label: same label, same bits)
    previous: tuple[int, str] | None = None
    training_since: float | None = None  # it takes inner steps from this time (None: not training)
    round_tokens: int = 0  # tokens of the round it trains, counted at its last stop or publish
    pending_tokens: int = 0  # progress not yet averaged, carried from rounds that did not count
    train_seconds: float = 0.0
    alive_seconds: float = 0.0
    joining: int | None = None  # the round it downloads the state to join
    joining_since: float | None = None
    first_ok: float | None = None  # when its tokens first reached θ_global
    leases: list[tuple[int, int, int]] = field(default_factory=list)  # (epoch, chunk, offset) it holds
    chunk_sizes: dict[tuple[int, int], int] = field(default_factory=dict)
    last_group: int = 0
    stopping: bool = False  # its stop at the close is scheduled
    round_opened: float | None = None  # when the round it trains opened, as it knows it
    opened_round: int | None = None
    trained_total: int = 0  # tokens of its closed rounds
    reported: int = 0  # tokens it has reported to the chunk coordinator
    seen_chunks: set[tuple[int, int]] = field(default_factory=set)  # chunks whose shards it has fetched

    @property
    def peer_id(self) -> str:
        return self.traits.peer_id


def speed_factor(rng: random.Random, speeds: str) -> float:
    """A peer's speed relative to the preset's base: equal; spread evenly over 1 … 1/10; or a GPU/CPU mix."""
    if speeds == "spread":
        return rng.uniform(0.1, 1.0)
    if speeds == "mixed":
        return CPU_SPEED_IN_MIX if rng.random() < CPU_SHARE_IN_MIX else 1.0
    return 1.0


def draw_traits(rng: random.Random, scenario: Scenario, index: int) -> Traits:
    low, high = scenario.rtt_ms
    rate = scenario.link_mbit * MBIT
    return Traits(
        peer_id=f"p{index:05d}",
        private=rng.random() < scenario.nat,
        tokens_per_second=BASE_TOKENS_PER_SECOND[scenario.preset] * speed_factor(rng, scenario.speeds),
        up=rate,
        down=rate,
        rtt=rng.uniform(low, high) / 1000.0,
    )


def new_peer(traits: Traits, params: RunParams, now: float, step: int = 0) -> Peer:
    """A peer as the daemon starts it: its deadlines from the config (peers/group.py's bounds), its link
    estimate at the prior rate (no `net.bandwidth`: the daemon's default)."""
    avg = params.cfg.averaging
    bounds = DeadlineBounds(
        matchmaking_ceiling=avg.matchmaking_timeout,
        matchmaking_floor=min(avg.matchmaking_timeout, avg.min_matchmaking_time + 2 * avg.request_timeout),
        allreduce_ceiling=avg.allreduce_timeout,
        allreduce_floor=min(avg.min_allreduce_timeout, avg.allreduce_timeout),
        factor=avg.deadline_factor,
        adaptive=avg.adaptive_deadlines,
    )
    return Peer(
        traits=traits,
        machine=RoundState(step=step),
        deadlines=AdaptiveDeadlines(bounds),
        link=LinkEstimate(prior_rate(params.cfg.net.bandwidth)),
        started=now,
    )
