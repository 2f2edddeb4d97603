"""Who counts in a group: what each member gathered for matchmaking, and the weights all agree on.

Every member's gathered data is hivemind's (bandwidth, mode, user data), and our user data is
[ticket bytes, run-key proof] (see `RunAverager.step`). Every member decodes the same gathered data
and so decides the same weights (`agree_weights`): the tokens behind each contribution, capped so
that a liar gains little (`capped_tokens`, docs/trust.md). A member without a valid run key is
refused, with one warning per peer and reason (`warn_once`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from hivemind.averaging.allreduce import AveragingMode

from peers.vote import plurality
from proto import ProtoError, decode_ticket


def _log() -> Any:
    from hivemind.utils import get_logger

    return get_logger(__name__)


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """A refusal is worth one line per peer and reason: a stranger may keep asking."""
    if message in _warned:
        return
    if len(_warned) > 4096:
        _warned.clear()
    _warned.add(message)
    _log().warning(message)


def _unwrap_user(serializer: Any, user_bytes: Any) -> tuple[Any, Any]:
    """A member's own gathered data, [ticket bytes, run-key proof] (see `RunAverager.step`)."""
    user = serializer.loads(user_bytes)
    if not isinstance(user, list | tuple) or len(user) != 2:
        return None, None
    return user[0], user[1]


def gathered_proof(serializer: Any, blob: Any) -> bytes | None:
    """The run-key proof in one member's gathered data, or None when it has none (never raises)."""
    try:
        _bandwidth, _mode, user_bytes = serializer.loads(blob)
        proof = _unwrap_user(serializer, user_bytes)[1]
    except Exception:
        return None
    return proof if isinstance(proof, bytes) else None


def decode_gathered(
    serializer: Any, gathered: Sequence[bytes]
) -> tuple[list[float | None], list[AveragingMode], list[dict[str, Any] | None]]:
    """Each member's (bandwidth, mode, ticket); anything malformed becomes (None, CLIENT, None)."""
    bandwidths: list[float | None] = []
    modes: list[AveragingMode] = []
    tickets: list[dict[str, Any] | None] = []
    for blob in gathered:
        bandwidth, mode, ticket = None, AveragingMode.CLIENT, None
        try:
            raw_bandwidth, raw_mode, user_bytes = serializer.loads(blob)
            mode = AveragingMode(raw_mode)
            if isinstance(raw_bandwidth, int | float) and np.isfinite(raw_bandwidth) and raw_bandwidth >= 0:
                bandwidth = float(raw_bandwidth)
            ticket = decode_ticket(_unwrap_user(serializer, user_bytes)[0])
        except (ProtoError, Exception):
            pass
        bandwidths.append(bandwidth)
        modes.append(mode)
        tickets.append(ticket)
    return bandwidths, modes, tickets


@dataclass(frozen=True)
class Agreement:
    """What every member of a group decides from the same gathered tickets."""

    in_majority: list[bool]  # the member's (outer step, θ hash, size) is the group's most common
    banned: list[bool]  # in the majority, but more than half of the majority bans it
    weights: list[float]  # tokens counted for its contribution (0 unless in the majority and not banned)


def agree(
    tickets: Sequence[dict[str, Any] | None],
    modes: Sequence[AveragingMode],
    peer_ids: Sequence[str] | None = None,
) -> Agreement:
    """Each member's weight: the tokens behind its contribution, capped (`capped_tokens`), for members whose
    (outer step, θ hash, size) is the group's most common; 0 for everyone else.

    Every member runs this on the same gathered data, so all reach the same answer. Ties go to the
    smallest (step, hash) so that the choice does not depend on who computes it. Then a member that
    more than half of those contributors ban (tickets list their bans) loses its weight too: one
    peer's ban list alone never excludes anybody, but a liar most of the group caught does not count.
    """
    majority = _majority(tickets, modes)
    eligible = majority if peer_ids is None else _drop_banned(tickets, majority, peer_ids)
    claims = [
        Claim(t["tokens"], t["tokens_per_second"], t["train_seconds"]) if ok and t is not None else None
        for t, ok in zip(tickets, eligible)
    ]
    banned = [m and not e for m, e in zip(majority, eligible)]
    return Agreement(majority, banned, capped_tokens(claims))


def agree_weights(
    tickets: Sequence[dict[str, Any] | None],
    modes: Sequence[AveragingMode],
    peer_ids: Sequence[str] | None = None,
) -> list[float]:
    """`agree(...).weights`."""
    return agree(tickets, modes, peer_ids).weights


def _majority(tickets: Sequence[dict[str, Any] | None], modes: Sequence[AveragingMode]) -> list[bool]:
    keys = [
        (t["outer_step"], t["global_sha256"], t["num_params"], t.get("manifest_hash"))
        if t is not None and t["role"] == "peer" and mode != AveragingMode.AUX
        else None
        for t, mode in zip(tickets, modes)
    ]
    vote = plurality(keys)
    return [vote is not None and key == vote.winner for key in keys]


def _drop_banned(
    tickets: Sequence[dict[str, Any] | None], eligible: list[bool], peer_ids: Sequence[str]
) -> list[bool]:
    voters = [t for t, ok in zip(tickets, eligible) if ok and t is not None]
    bans = Counter(banned for t in voters for banned in set(t.get("bans") or ()))
    return [ok and bans[peer] * 2 <= len(voters) for peer, ok in zip(peer_ids, eligible)]


@dataclass(frozen=True)
class Claim:
    """What a member's ticket says its contribution covers."""

    tokens: int
    tokens_per_second: float
    train_seconds: float


# A claim may be at most this many times the median of the other members' claims: a straggler that carries
# a missed round's progress sends about twice a round's tokens; a liar gains at most this factor.
MEDIAN_FACTOR = 2.0
# Slack on tokens_per_second × train_seconds: the throughput a peer reports is a moving average.
THROUGHPUT_SLACK = 1.5


def capped_tokens(claims: Sequence[Claim | None]) -> list[float]:
    """Weights from token claims (None: the member does not count, weight 0). A claim is clamped to

    - `MEDIAN_FACTOR` × the median of the other counted members' positive claims (none: no bound), and
    - `THROUGHPUT_SLACK` × its own tokens_per_second × its train_seconds, where train_seconds is taken
      at most `MEDIAN_FACTOR` × the median of the counted members' train_seconds (so a liar must also
      claim a throughput that its status records, seen by everyone, would have to show).

    Pure and deterministic: every member computes the same weights from the same tickets.
    """
    counted = [c for c in claims if c is not None]
    seconds_bound = MEDIAN_FACTOR * _median([c.train_seconds for c in counted]) if counted else 0.0
    weights: list[float] = []
    for index, claim in enumerate(claims):
        if claim is None:
            weights.append(0.0)
            continue
        others = [c.tokens for i, c in enumerate(claims) if c is not None and i != index and c.tokens > 0]
        bound = MEDIAN_FACTOR * _median(others) if others else math.inf
        seconds = min(claim.train_seconds, seconds_bound)
        produced = THROUGHPUT_SLACK * claim.tokens_per_second * seconds
        weights.append(float(max(0.0, min(float(claim.tokens), bound, produced))))
    return weights


def normalized(weights: Sequence[float]) -> list[float]:
    """Weights divided by the largest one, so that equal weights become exactly 1.0 (the reducers then run
    their unweighted arithmetic bit for bit); all zero stays all zero."""
    top = max(weights, default=0.0)
    return [w / top if top > 0 else 0.0 for w in weights]


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    k = len(ordered)
    return (ordered[(k - 1) // 2] + ordered[k // 2]) / 2
