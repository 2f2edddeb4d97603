"""What the run's status records say, relative to us: the facts every round decision is made from.

Records are advisory (anyone may lie in them): they decide only when to look (re-sync, step back, warn),
never what to adopt, which is checked against hashes and tickets elsewhere. Pure functions; votes go
through `peers.vote`, so peers seeing the same records decide alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dilocod.rounds.events import RunFacts
from peers.vote import plurality, votes_for


@dataclass(frozen=True)
class Us:
    """What we hold, to compare the records with."""

    peer_id: str
    step: int
    sha256: str
    manifest_hash: str | None = None
    previous: tuple[int, str] | None = None  # (step, θ hash) before our last outer step, if we kept it


def trainers(records: Sequence[Mapping[str, Any]], own_id: str) -> list[Mapping[str, Any]]:
    """The other training peers' records."""
    return [r for r in records if r.get("role") == "peer" and r.get("peer_id") != own_id]


def same_manifest(records: Sequence[Mapping[str, Any]], manifest_hash: str | None) -> list[Mapping[str, Any]]:
    """The records of nodes that run our manifest (all when we have none; a record without a hash is from
    a node too old to say, and its rounds could not meet ours anyway)."""
    if not manifest_hash:
        return list(records)
    return [r for r in records if r.get("manifest_hash") in (None, manifest_hash)]


def run_facts(
    records: Sequence[Mapping[str, Any]],
    us: Us,
    *,
    now: float,
    seen_recently: bool,
    reducers: int = 1,
) -> RunFacts:
    others = trainers(records, us.peer_id)
    # Peers of another manifest never average with us: where the run is and whether we drifted is told by
    # ours only. They still count as live (we are not alone in the run, we are the odd one out).
    ours = same_manifest(others, us.manifest_hash)
    return RunFacts(
        others=len(others),
        best_step=run_step(ours),
        diverged=diverged(ours, us),
        behind_on_previous=behind_on_previous(ours, us),
        seen_recently=seen_recently or bool(others),
        late_by=late_by(ours, us.step, now),
        other_settings=other_settings(others, us.manifest_hash),
        reducers=reducers,
    )


def run_step(others: Sequence[Mapping[str, Any]]) -> int:
    """The outer step the run is at: the highest step that more than half of the other trainers have
    reached (−1: none). One peer claiming to be far ahead is not the run: a lone liar cannot make every
    honest peer stop and re-sync each round. (In a run of two, the other peer is the run.)"""
    steps = sorted((int(r["outer_step"]) for r in others), reverse=True)
    return steps[len(steps) // 2] if steps else -1


def past_round(others: Sequence[Mapping[str, Any]], round_index: int, step: int) -> bool:
    """More than half of the other trainers are past the round we train (their round, or their outer
    step, is later): the run closed it without us."""
    past = 0
    for record in others:
        later_round = record.get("round") is not None and int(record["round"]) > round_index
        past += later_round or int(record["outer_step"]) > step
    return 2 * past > len(others)


def diverged(others: Sequence[Mapping[str, Any]], us: Us) -> bool:
    """Most trainers at our step (us included) hold another θ_global, with strictly more votes than ours.

    Groups that form apart at the same step fork the run; the next round's tickets would send the
    minority to re-sync anyway, but at the close the records already say so (and a peer alone in its
    fork would otherwise find no group at all)."""
    hashes = [r["global_sha256"] for r in others if r["outer_step"] == us.step] + [us.sha256]
    vote = plurality(hashes)
    return vote is not None and vote.winner != us.sha256 and vote.votes > votes_for(hashes, us.sha256)


def behind_on_previous(others: Sequence[Mapping[str, Any]], us: Us) -> bool:
    """Every other trainer is behind us, and most of them hold exactly our previous step and θ_global:
    they can only meet us if we go back (see `statesync/stepback.py`)."""
    if us.previous is None or not others or us.previous[0] != us.step - 1:
        return False
    if any(r["outer_step"] >= us.step for r in others):
        return False
    at_previous = [r["global_sha256"] for r in others if r["outer_step"] == us.previous[0]]
    vote = plurality(at_previous)
    return vote is not None and vote.winner == us.previous[1] and 2 * vote.votes > len(others)


def late_by(others: Sequence[Mapping[str, Any]], step: int, now: float) -> float | None:
    """When the run is ahead of us: how long ago it opened the round after ours (how far behind its
    clock we are); None when nobody is ahead or says."""
    opened = [
        float(r["round_opened"])
        for r in others
        if r["outer_step"] > step and r.get("round_opened") is not None
    ]
    return max(0.0, now - statistics.median(opened)) if opened else None


def other_settings(others: Sequence[Mapping[str, Any]], ours: str | None) -> str | None:
    """The manifest hash every other trainer that reports one holds, when none holds ours."""
    hashes = [r.get("manifest_hash") for r in others if r.get("manifest_hash")]
    if ours is None or not hashes or ours in hashes:
        return None
    vote = plurality(hashes)
    return None if vote is None else str(vote.winner)
