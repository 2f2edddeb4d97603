"""A bounded, in-memory history of the run, built from the status records a node reads from the DHT.

DHT records carry only each peer's latest numbers; the dashboard's charts need them over time. Every
node that reads the run (the bootstrap every few seconds, a peer at each heartbeat) feeds what it read
to `RunHistory.observe`; `GET /api/history` serves the result.

Memory stays bounded whatever the run's length: each series holds at most `max_samples` rows, and a
full series drops every other row (so it keeps covering the whole run, at half the resolution). At most
`max_peers` peers are remembered; the one seen longest ago is forgotten first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

PEER_FIELDS = (
    "time",
    "outer_step",
    "inner_step",
    "loss",
    "eval_loss",
    "tokens_per_second",
    "group_size",
    "last_round_seconds",
    "rounds_ok",
    "rounds_failed",
    "rejected_contributions",
    "bans",
    "bytes_sent",
    "bytes_received",
    "tokens_trained",
    "tokens_contributed",
)
"""One row per peer sample; a field the peers' records do not carry (older peers, `bytes_*` today) is null."""

RUN_FIELDS = (
    "time",
    "peers",
    "tokens_per_second",
    "outer_step",
    "loss",
    "eval_loss",
    "rounds_ok",
    "rounds_failed",
)
"""One row per run sample: live training peers, their summed tokens/s, max outer step, mean losses, and
the rounds ok/failed they report (summed)."""

PEER_SAMPLE_SECONDS = 30.0  # a peer whose step did not change is still sampled this often (tokens/s)
RUN_SAMPLE_SECONDS = 5.0


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _mean(values: Iterable[float | None]) -> float | None:
    found = [v for v in values if v is not None]
    return sum(found) / len(found) if found else None


@dataclass
class _Series:
    """Rows of numbers, thinned by half whenever `limit` is reached."""

    limit: int
    rows: list[list[Any]] = field(default_factory=list)

    def append(self, row: list[Any]) -> None:
        self.rows.append(row)
        if len(self.rows) > self.limit:
            # Keep the first and the latest rows, drop every other one in between.
            self.rows = [*self.rows[:-1:2], self.rows[-1]]


@dataclass
class _PeerHistory:
    series: _Series
    role: str = "peer"
    reachability: str = "unknown"
    first_seen: float = 0.0
    last_seen: float = 0.0
    key: tuple[Any, ...] = ()
    last_sample: float = 0.0


class RunHistory:
    def __init__(self, max_samples: int = 500, max_peers: int = 256) -> None:
        self.max_samples = max_samples
        self.max_peers = max_peers
        self._peers: dict[str, _PeerHistory] = {}
        self._run = _Series(max_samples)
        self._run_last = 0.0

    def observe(self, records: Iterable[Mapping[str, Any]], now: float | None = None) -> None:
        """Add what changed in these (validated) status records; cheap enough to call at every read."""
        now = time.time() if now is None else now
        records = list(records)
        for record in records:
            self._observe_peer(record, now)
        peers = [r for r in records if r.get("role") == "peer"]
        if peers and now - self._run_last >= RUN_SAMPLE_SECONDS:
            self._run_last = now
            self._run.append(
                [
                    round(now, 3),
                    len(peers),
                    sum(_num(r.get("tokens_per_second")) or 0.0 for r in peers),
                    max(int(r.get("outer_step") or 0) for r in peers),
                    _mean(_num(r.get("loss")) for r in peers),
                    _mean(_num(r.get("eval_loss")) for r in peers),
                    sum(int(r.get("rounds_ok") or 0) for r in peers),
                    sum(int(r.get("rounds_failed") or 0) for r in peers),
                ]
            )

    def _observe_peer(self, record: Mapping[str, Any], now: float) -> None:
        peer_id = str(record.get("peer_id") or "")
        if not peer_id:
            return
        entry = self._peers.get(peer_id)
        if entry is None:
            if len(self._peers) >= self.max_peers:
                oldest = min(self._peers, key=lambda p: self._peers[p].last_seen)
                del self._peers[oldest]
            entry = self._peers[peer_id] = _PeerHistory(_Series(self.max_samples), first_seen=now)
        entry.role = str(record.get("role") or "peer")
        entry.reachability = str(record.get("reachability") or "unknown")
        entry.last_seen = now
        row = [
            round(_num(record.get("time")) or now, 3),
            *(_sample_value(record, f) for f in PEER_FIELDS[1:]),
        ]
        # A new sample when the peer's progress changed, or now and then to follow its throughput.
        key = (row[1], row[3], row[4], *row[8:])  # outer step, losses, round/trust/traffic counters
        if key != entry.key or now - entry.last_sample >= PEER_SAMPLE_SECONDS:
            entry.key, entry.last_sample = key, now
            entry.series.append(row)

    def snapshot(self) -> dict[str, Any]:
        """The `/api/history` object."""
        return {
            "peer_fields": list(PEER_FIELDS),
            "run_fields": list(RUN_FIELDS),
            "peers": {
                peer_id: {
                    "role": entry.role,
                    "reachability": entry.reachability,
                    "first_seen": entry.first_seen,
                    "last_seen": entry.last_seen,
                    "samples": [list(row) for row in entry.series.rows],
                }
                for peer_id, entry in sorted(self._peers.items())
            },
            "run": [list(row) for row in self._run.rows],
        }


def _sample_value(record: Mapping[str, Any], name: str) -> Any:
    value = record.get(name)
    if name in (
        "outer_step",
        "inner_step",
        "group_size",
        "rounds_ok",
        "rounds_failed",
        "rejected_contributions",
        "bans",
    ):
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else None
    return _num(value)
