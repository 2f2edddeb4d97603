"""The run's bootstrap as the simulation sees it: the coordinator's chunk book (the daemon's own
`ChunkBook`, fed what each trainer's `ChunkSync` would send every SYNC_SECONDS) and a tally of what the
bootstrap carries: chunk syncs, manifest and dial-back requests from joiners, and its share of every
round's all-reduce as the auxiliary reducer private peers need."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from bench.netsim import costs
from dilocod.data.schedule import MAX_LEASES, ChunkBook, Grant, _Lease


class IndexedBook(ChunkBook):
    """The daemon's `ChunkBook`, its rules untouched, with two scans of every lease made cheap for a
    thousand trainers (`tests/test_netsim.py` checks its answers equal the book's):

    - `expire` skips the scan while no lease can have expired: every renewal or claim sets an expiry of
      now + lease_seconds, never earlier than one set before, so the earliest expiry only moves later;
    - `_leases_of` reads a peer's claims from an index (in claim order, as the book's lease dicts keep
      them) instead of every lease of the run, dropping the ones that are no longer its own."""

    def __init__(self, train_tokens: int, chunk_tokens: int, dataset: str, lease_seconds: float) -> None:
        super().__init__(train_tokens, chunk_tokens, dataset, lease_seconds)
        self._floor = -math.inf  # no lease expires before this
        self._claims: dict[str, list[tuple[int, int]]] = {}

    def expire(self, now: float) -> list[tuple[str, int, int]]:
        if now < self._floor:
            return []
        gone = super().expire(now)
        left = (lease.expires for book in self.epochs.values() for lease in book.leases.values())
        self._floor = min(min(left, default=math.inf), now + self.lease_seconds)
        return gone

    def _claim(self, peer: str, now: float) -> tuple[int, int, _Lease]:
        epoch, chunk, lease = super()._claim(peer, now)
        self._claims.setdefault(peer, []).append((epoch, chunk))
        return epoch, chunk, lease

    def _leases_of(self, peer: str) -> list[tuple[int, int, _Lease]]:
        live: dict[tuple[int, int], _Lease] = {}
        for epoch, chunk in self._claims.get(peer, ()):
            book = self.epochs.get(epoch)
            lease = book.leases.get(chunk) if book is not None else None
            if lease is not None and lease.peer == peer:
                live.pop((epoch, chunk), None)  # claimed again: its place is the latest claim's
                live[(epoch, chunk)] = lease
        self._claims[peer] = list(live)
        ordered = sorted(live.items(), key=lambda item: item[0][0])  # by epoch, claim order within one
        return [(epoch, chunk, lease) for (epoch, chunk), lease in ordered]


@dataclass
class Load:
    requests: int = 0
    bytes: float = 0.0  # both directions
    reduce_bytes: float = 0.0  # of `bytes`: its all-reduce traffic as a reducer

    def add(self, requests: int, nbytes: float) -> None:
        self.requests += requests
        self.bytes += nbytes


@dataclass
class Coordinator:
    book: ChunkBook
    load: Load = field(default_factory=Load)
    returned: list[tuple[str, int, int]] = field(default_factory=list)  # (peer, epoch, chunk) expired

    def expire(self, now: float) -> None:
        """`ChunkService.keep_saved`: dead leases go back to the run every SAVE_SECONDS."""
        self.returned += self.book.expire(now)

    def sync(self, peer: str, held: list[tuple[int, int, int]], want: int, now: float) -> list[Grant]:
        """One trainer's report and request, as `ChunkService.sync` answers it."""
        grants = self.book.sync(peer, held, min(want, MAX_LEASES), now)
        request, reply = costs.chunk_message_bytes(len(held), len(grants))
        self.load.add(1, request + reply)
        return grants

    def joined(self) -> None:
        """A joiner's dial-back and manifest requests (its dataset index and shards come from any public
        peer, its state from public trainers: neither is the bootstrap's)."""
        self.load.add(2, costs.MANIFEST_BYTES + 2 * costs.DHT_MESSAGE_BYTES)

    def reduced(self, sent: float, received: float) -> None:
        self.load.add(1, sent + received)
        self.load.reduce_bytes += sent + received
