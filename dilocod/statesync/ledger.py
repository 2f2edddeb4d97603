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
    if len(tied) == 1:
        return str(vote.winner)
    own = reports.get(donor)
    return own if own in tied else None
