"""The run's bootstrap as the simulation sees it: the coordinator's chunk book (the daemon's own
`ChunkBook`, fed what each trainer's `ChunkSync` would send every SYNC_SECONDS) and a tally of what the
bootstrap carries: chunk syncs, manifest and dial-back requests from joiners, and its share of every
round's all-reduce as the auxiliary reducer private peers need."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.netsim import costs
from dilocod.data.schedule import MAX_LEASES, ChunkBook, Grant


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
