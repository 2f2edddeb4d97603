"""What a simulated run adds up to: the counters the simulation keeps and the figures of the command's JSON
(issue 44's keys, then the parts behind them)."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dilocod.rounds.events import Outcome

if TYPE_CHECKING:
    from bench.netsim.costs import Exchange
    from bench.netsim.matchmaking import Group
    from bench.netsim.population import Peer
    from bench.netsim.run import Simulation


@dataclass
class RoundFigures:
    groups: int = 0
    seekers: int = 0
    in_full_group: int = 0
    completed: int = 0  # groups whose all-reduce completed
    pending: int = 0  # groups not yet done
    allreduce_seconds: list[float] = field(default_factory=list)
    transfer_seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)
    matchmaking_seconds: list[float] = field(default_factory=list)
    largest: int = 0
    tries: int = 0  # matchmakings at this index (more than one: its groups failed and it was tried again)
    settled: bool = False  # a group's average at this index was applied and no group is still exchanging


@dataclass
class Tally:
    rounds: int
    transitions: int = 0
    status_reads: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    per_round: dict[int, RoundFigures] = field(default_factory=lambda: defaultdict(RoundFigures))
    trained_tokens: Counter[int] = field(default_factory=Counter)  # round → tokens trained
    lost_tokens: int = 0  # trained by peers that left before their round closed
    applied_tokens: dict[int, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    applied_peers: dict[int, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    applied_at: dict[tuple[int, str], float] = field(default_factory=dict)
    bytes_by_kind: Counter[str] = field(default_factory=Counter)
    dht_messages: int = 0
    scoring_assignments: list[int] = field(default_factory=list)
    scoring_bytes_max: float = 0.0
    state_downloads: list[float] = field(default_factory=list)
    crashes: int = 0
    exits: int = 0
    joiners: set[str] = field(default_factory=set)
    bytes_per_token: int = 2

    # ---- counting --------------------------------------------------------------------------------------
    def dht(self, peer: str, messages: int, nbytes: float) -> None:
        self.dht_messages += messages
        self.bytes_by_kind["dht"] += nbytes

    def allreduce_bytes(self, peer: str, nbytes: float) -> None:
        self.bytes_by_kind["allreduce"] += nbytes

    def data_bytes(self, peer: str, tokens: int) -> None:
        self.bytes_by_kind["data"] += tokens * self.bytes_per_token

    def trained(self, index: int, tokens: int) -> None:
        self.trained_tokens[index] += tokens

    def outcome(self, peer: Peer, outcome: Outcome, now: float) -> None:
        self.outcomes[outcome.value] += 1

    def round_groups(self, index: int, groups: list[Group], live: int) -> None:
        """One matchmaking of a round (a round whose groups all failed is tried again: its tries add up)."""
        figures = self.per_round[index]
        figures.tries += 1
        figures.groups += len(groups)
        figures.seekers += live
        figures.pending += len(groups)
        figures.largest = max(figures.largest, *(sum(s.trainer for s in g.members) for g in groups), 0)
        for group in groups:
            trainers = [s for s in group.members if s.trainer]
            if len(trainers) >= live:
                figures.in_full_group += len(trainers)
            arrived = statistics.median(s.at for s in trainers)
            figures.matchmaking_seconds.append(group.begins - arrived)

    def exchange(self, exchange: Exchange, group: Group, ok: bool) -> None:
        pass

    def group_done(self, index: int, exchange: Exchange, complete: bool) -> None:
        figures = self.per_round[index]
        figures.pending -= 1
        figures.completed += complete
        figures.allreduce_seconds.append(exchange.seconds)
        figures.transfer_seconds.append(exchange.transfer_seconds)
        figures.cpu_seconds.append(exchange.cpu_seconds)
        figures.settled = figures.pending == 0 and figures.completed > 0

    def applied(self, peer: Peer, label: str | None, tokens: int, step: int, now: float) -> None:
        key = label or "alone"
        self.applied_tokens[step][key] += tokens
        self.applied_peers[step][key] += 1
        self.applied_at[(step, key)] = max(now, self.applied_at.get((step, key), 0.0))
        if peer.first_ok is None:
            peer.first_ok = now

    def scored(self, table: dict[str, list[str]], delta_bytes: float) -> None:
        most = max((len(v) for v in table.values()), default=0)
        self.scoring_assignments.append(most)
        self.scoring_bytes_max = max(self.scoring_bytes_max, most * delta_bytes)

    def state_download(self, nbytes: int, seconds: float) -> None:
        self.state_downloads.append(seconds)
        self.bytes_by_kind["state"] += nbytes

    def left(self, peer: str, crashed: bool, lost: int) -> None:
        self.crashes += crashed
        self.exits += not crashed
        self.lost_tokens += lost

    @property
    def finished_rounds(self) -> int:
        return sum(1 for i in range(self.rounds) if i in self.per_round and self.per_round[i].settled)

    # ---- the figures -----------------------------------------------------------------------------------
    def majority(self, step: int) -> str | None:
        peers = self.applied_peers.get(step)
        return max(sorted(peers), key=lambda k: peers[k]) if peers else None

    def report(self, sim: Simulation) -> dict[str, Any]:
        k = self.rounds
        trained = sum(self.trained_tokens[i] for i in range(k)) + self.lost_tokens
        in_global = sum(self.applied_tokens[i][m] for i in range(k) if (m := self.majority(i)) is not None)
        rounds = [self.per_round[i] for i in range(k) if i in self.per_round]
        closed = sum(r.settled for r in rounds)
        seekers = sum(r.seekers for r in rounds)
        ends = [self.applied_at[(i, m)] for i in range(k) if (m := self.majority(i)) is not None]
        spans = [b - a for a, b in zip([0.0, *ends], ends, strict=False)]
        peers = list(sim.peers.values())
        alive = sum(p.alive_seconds for p in peers)
        peer_rounds = max(1, sum(self.outcomes.values()))
        joiners = [
            p.first_ok - p.started for p in peers if p.peer_id in self.joiners and p.first_ok is not None
        ]
        duration = max(sim.queue.now, 1e-9)
        load = sim.coordinator.load
        return {
            "peers": sim.scenario.peers,
            "rounds": closed,
            "stalled": sim.stalled,  # fewer than the asked rounds closed: the run stopped making progress
            "tokens_in_global_share": _r(in_global / trained if trained else 0.0),
            "full_group_share": _r(sum(r.in_full_group for r in rounds) / seekers if seekers else 0.0),
            "one_global_share": _r(sum(r.completed == 1 for r in rounds) / k),
            "round_seconds": _r(statistics.mean(spans) if spans else None),
            "utilization": _r(sum(p.train_seconds for p in peers) / alive if alive else 0.0),
            "bytes_per_peer_round": _r(sum(self.bytes_by_kind.values()) / peer_rounds),
            "dht_messages_per_peer_round": _r(self.dht_messages / peer_rounds),
            "joiner_seconds": _r(statistics.mean(joiners) if joiners else None),
            "bootstrap_requests_per_second": _r(load.requests / duration),
            "bootstrap_bytes_per_second": _r(load.bytes / duration),
            # the parts behind them
            "scenario": {
                "nat": sim.scenario.nat,
                "churn": sim.scenario.churn,
                "speeds": sim.scenario.speeds,
                "link_mbit": sim.scenario.link_mbit,
                "preset": sim.scenario.preset,
                "seed": sim.scenario.seed,
            },  # fmt: skip
            "round_parts": {
                "matchmaking_seconds": _mean(x for r in rounds for x in r.matchmaking_seconds),
                "allreduce_seconds": _mean(x for r in rounds for x in r.allreduce_seconds),
                "allreduce_transfer_seconds": _mean(x for r in rounds for x in r.transfer_seconds),
                "allreduce_cpu_seconds": _mean(x for r in rounds for x in r.cpu_seconds),
            },
            "groups_per_round": _mean(r.groups for r in rounds),
            "tries_per_round": _mean(r.tries for r in rounds),
            "largest_group_share": _r(sum(r.largest for r in rounds) / seekers if seekers else 0.0),
            "bytes_per_peer_round_by_kind": {
                kind: _r(v / peer_rounds) for kind, v in sorted(self.bytes_by_kind.items())
            },
            "outcomes": dict(sorted(self.outcomes.items())),
            "status_record_bytes": sim.record_bytes,
            "status_key_bytes_per_second": _r(
                self.status_reads * len(sim.records) * sim.record_bytes / duration
            ),
            "bootstrap_reduce_bytes_per_second": _r(load.reduce_bytes / duration),
            "chunks_returned": len(sim.coordinator.returned),
            "scoring_max_assignments": max(self.scoring_assignments, default=0),
            "scoring_max_bytes_per_scorer_round": _r(self.scoring_bytes_max),
            "state_download_seconds": _mean(self.state_downloads),
            "crashes": self.crashes,
            "exits": self.exits,
            "joiners": len(self.joiners),
            "machine_transitions": self.transitions,
            "simulated_seconds": _r(duration),
        }


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _mean(values: Any) -> float | None:
    found = list(values)
    return _r(statistics.mean(found)) if found else None
