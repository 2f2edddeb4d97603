"""What the run's scorers say about each peer, for `/api/run` `scoring` and the dashboard: every verdict the
scorers published (`dilocod.scores` records, proto/scores.py), each peer's rating and whether it is gated.

A trainer in the run computes ratings only from the verdicts it can check (dilocod/node/scorer.py:
the scorer was assigned that contributor in a round it was in); a node that was not in the rounds (the
bootstrap) folds every verdict as published, and says so (`verified: false`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dilocod.trust.scoring import Rating, RatingRule, Verdict, gated, ratings
from peers.node import Node
from proto import ProtoError
from proto.scores import decode_scores

SCORES_KEY = "scores"
LAST_SCORES = 8  # verdicts shown per peer, newest first


async def published_verdicts(node: Node, run_id: str) -> list[Verdict]:
    """Every verdict the run's scorers publish now: (outer step, scorer, target, passed). A record that does
    not decode, is signed by another peer than the one it names, or is of another run is skipped."""
    verdicts: list[Verdict] = []
    for subkey, value in (await node.read_all(SCORES_KEY)).items():
        try:
            record = decode_scores(value)
        except (ProtoError, TypeError):
            continue
        if record["peer_id"] != subkey or record["run_id"] != run_id:
            continue
        verdicts.extend(
            (step, subkey, target, bool(passed))
            for step, target, passed in zip(record["steps"], record["targets"], record["passed"])
        )
    return verdicts


def score_view(
    verdicts: Iterable[Verdict], rule: RatingRule, rated: dict[str, Rating] | None = None
) -> dict[str, Any]:
    """`/api/run` `scoring`: per scored peer its rating (from `rated`, the ratings a trainer checked, or else
    folded from `verdicts` as published), whether it is gated, and its latest verdicts."""
    ordered = sorted(set(verdicts))
    verified = rated is not None
    rated = rated if rated is not None else ratings(ordered, rule)
    latest: dict[str, list[Verdict]] = {}
    for verdict in reversed(ordered):
        latest.setdefault(verdict[2], []).append(verdict)
    peers = {}
    for peer in sorted(set(rated) | set(latest)):
        rating = rated.get(peer)
        peers[peer] = {
            "rating": None if rating is None else round(rating.value, 4),
            "gated": rating is not None and gated(rating, rule),
            "failures": 0 if rating is None else rating.failures,
            "last_scores": [
                {"outer_step": step, "scorer": scorer, "passed": passed}
                for step, scorer, _target, passed in latest.get(peer, [])[:LAST_SCORES]
            ],
        }
    return {"verified": verified, "gate": rule.gate, "peers": peers}
