"""The ledger of θ hashes the run reported, step by step: what a donor's state is checked against.

The run goes on while a state downloads (a large model's takes minutes on a slow link), so a status
record says where a peer is *now*, not what it held at the step a donor sends. A re-syncing peer keeps
every (outer step, peer, θ hash) it read, and checks a donor's hash against what the *other* peers
reported for that step. Pure functions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from peers.vote import plurality, votes_for


def remember_hashes(
    seen: dict[int, dict[str, str]], records: Sequence[Mapping[str, Any]], keep: int = 32
) -> None:
    """Add each record's (outer step, θ hash) to `seen` (step → peer id → hash), for the `keep` latest steps."""
    for record in records:
        seen.setdefault(record["outer_step"], {})[record["peer_id"]] = record["global_sha256"]
    for step in sorted(seen)[:-keep]:
        del seen[step]


def expected_hash(seen: dict[int, dict[str, str]], step: int, donor: str) -> str | None:
    """The θ hash most peers other than `donor` reported for `step`; the donor's own report only when
    nobody else reported that step, or when it is one of the hashes tied for most reports (a split run:
    the donor's word decides, nobody is called a liar for it); None when nobody did, or on a tie the
    donor is not part of (no hash to hold anyone to)."""
    reports = seen.get(step, {})
    others = [h for peer, h in reports.items() if peer != donor]
    vote = plurality(others)
    if vote is None:
        return reports.get(donor)
    tied = {h for h in others if votes_for(others, h) == vote.votes}
    own = reports.get(donor)
    if len(tied) == 1:
        # With its own report the donor's θ ties the others' winner: two halves of a split run (one against
        # one), and holding each to the other's hash refused both, so that peers behind them never re-synced.
        if own is not None and votes_for(others, own) + 1 >= vote.votes:
            return own
        return str(vote.winner)
    return own if own in tied else None


SPLIT = "its θ_global is one fewer peers report for that step (its group split from the run's): skipped"
LIE = "its θ_global is not the one most peers report for that step"


def served_verdict(
    seen: dict[int, dict[str, str]], step: int, donor: str, served: str, agreed: str
) -> tuple[str, bool] | None:
    """None when the θ hash a donor served at `step` is `agreed` (what most peers report); else why it is
    refused and whether that proves a lie. A donor whose own record reports the θ it served holds a
    minority θ_global: its group averaged apart from the run's (two groups at one step, on a loaded
    machine or a lagging DHT view) and it re-syncs itself soon. That is no lie: banning it for an hour
    kept honest peers out of later groups, which split them again (6 false bans in 3 minutes at 16
    peers). A donor that reports one θ and serves another, or serves a θ it never reported, lies."""
    if served == agreed:
        return None
    if seen.get(step, {}).get(donor) == served:
        return SPLIT, False
    return LIE, True


def declared_lie(seen: dict[int, dict[str, str]], step: int, donor: str, declared: str) -> str | None:
    """Why a θ hash a donor declared at `step` (in a state head, before any download) proves a lie, or None:
    held to the records as if served (`served_verdict`); no records for the step, or a split, prove nothing."""
    agreed = expected_hash(seen, step, donor)
    if agreed is None:
        return None
    verdict = served_verdict(seen, step, donor, declared, agreed)
    return verdict[0] if verdict is not None and verdict[1] else None


def minority_holders(seen: dict[int, dict[str, str]]) -> list[str]:
    """Peers whose latest reported θ hash is outvoted at that step, their own report counted (a tie holds
    nobody): their state would be refused (`served_verdict`), so a re-syncing peer does not spend a
    download on them."""
    latest: dict[str, int] = {}
    for step, reports in seen.items():
        for peer in reports:
            latest[peer] = max(step, latest.get(peer, step))
    found = []
    for peer, step in sorted(latest.items()):
        hashes = list(seen[step].values())
        vote = plurality(hashes)
        tied = vote is not None and sum(votes_for(hashes, h) == vote.votes for h in set(hashes)) > 1
        if vote is not None and not tied and seen[step][peer] != vote.winner:
            found.append(peer)
    return found
