"""Who counts in a group: what each member gathered for matchmaking, and the weights all agree on.

Every member's gathered data is hivemind's (bandwidth, mode, user data), and our user data is
[ticket bytes, run-key proof] (see `RunAverager.step`). Every member decodes the same gathered data
and so decides the same weights (`agree_weights`); a member without a valid run key is refused, with
one warning per peer and reason (`warn_once`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
from hivemind.averaging.allreduce import AveragingMode

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


def agree_weights(
    tickets: Sequence[dict[str, Any] | None],
    modes: Sequence[AveragingMode],
    peer_ids: Sequence[str] | None = None,
) -> list[float]:
    """Weight 1 for contributors whose (outer step, θ hash, size) is the group's most common; else 0.

    Every member runs this on the same gathered data, so all reach the same answer. Ties go to the
    smallest (step, hash) so that the choice does not depend on who computes it. Then a member that
    more than half of those contributors ban (tickets list their bans) loses its weight too: one
    peer's ban list alone never excludes anybody, but a liar most of the group caught does not count.
    """
    weights = _majority_weights(tickets, modes)
    if peer_ids is None:
        return weights
    voters = [t for t, w in zip(tickets, weights) if w > 0 and t is not None]
    votes = Counter(banned for t in voters for banned in set(t.get("bans") or ()))
    return [0.0 if votes[peer] * 2 > len(voters) else w for peer, w in zip(peer_ids, weights)]


def _majority_weights(
    tickets: Sequence[dict[str, Any] | None], modes: Sequence[AveragingMode]
) -> list[float]:
    keys = [
        (t["outer_step"], t["global_sha256"], t["num_params"])
        if t is not None and t["role"] == "peer" and mode != AveragingMode.AUX
        else None
        for t, mode in zip(tickets, modes)
    ]
    counts = Counter(key for key in keys if key is not None)
    if not counts:
        return [0.0] * len(keys)
    top = max(counts.values())
    majority = min(key for key, count in counts.items() if count == top)
    return [1.0 if key == majority else 0.0 for key in keys]
