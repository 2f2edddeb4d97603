"""The training shards a joiner fetches as its chunks need them, not the whole dataset up front.

A peer that joins without a copy fetches the index, the tokenizer and the eval split before it builds its
trainer (dilocod/node/dataset.py), then, once the run's chunk schedule has leased it chunks, the shards
those chunks lie in: the first lease's before the first step, the next ones in the background while it
trains (it holds the chunk after next already, so a shard is usually there before it is needed). The
trainer takes windows only from chunks whose shards are here (`ready`); when none is, it draws random
windows from the shards it has. Each shard is fetched from any live public peer of the run that has it,
the peers it was given last (spreading the load off the bootstrap), checked against the index and its
server banned when the bytes do not match, as for the whole dataset. Progress: `/api/status` `data_fetch`
(`train_shards_local` of `train_shards_total`).

Without an answer from the coordinator at start there is no lease to go by: the peer then fetches every
training shard first, as a peer of a run without a schedule would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import numpy as np
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from dilocod.data.localcopy import missing_train_shards
from dilocod.data.schedule import Grant
from dilocod.data.shards import DatasetIndex
from dilocod.node.dataset import DIAL_SECONDS, Fetcher
from dilocod.observability.metrics import Metrics
from dilocod.observability.peerstate import DataProgress, ShardProgress
from peers.runinfo import dial

log = logging.getLogger("dilocod.data")

POLL_SECONDS = 1.0  # how often the background fetch looks at the leases (and is woken sooner by a sync)


class LazyShards:
    """Which training shards this copy holds, and fetching the ones its leases need."""

    def __init__(self, directory: Path, index: DatasetIndex, shown: ShardProgress) -> None:
        self.directory, self.index, self.shown = directory, index, shown  # `shown`: ours alone to write
        self.shards = index.train.shards
        missing = set(missing_train_shards(directory, index))
        self.present = {n for n in range(len(self.shards)) if n not in missing}
        self._starts = np.cumsum([0, *(s.tokens for s in self.shards)], dtype=np.int64)
        self.wake = asyncio.Event()
        self._show()

    @property
    def complete(self) -> bool:
        return len(self.present) == len(self.shards)

    def shards_of(self, lo: int, hi: int) -> range:
        """The shards holding tokens [lo, hi) of the training split."""
        first = int(np.searchsorted(self._starts, lo, side="right")) - 1
        last = int(np.searchsorted(self._starts, max(lo, hi - 1), side="right")) - 1
        return range(max(0, first), min(len(self.shards), last + 1))

    def ready(self, grant: Grant) -> bool:
        """Whether every shard of the lease's chunk is here (called on the trainer thread)."""
        return all(n in self.present for n in self.shards_of(grant.lo, grant.lo + grant.size))

    def present_ranges(self) -> list[tuple[int, int]]:
        """Token ranges [lo, hi) of the training split this copy holds (called on the trainer thread)."""
        return [(int(self._starts[n]), int(self._starts[n + 1])) for n in sorted(self.present)]

    def needed(self, leases: Sequence[Grant]) -> list[int]:
        """The missing shards of `leases`, in the order the leases are trained."""
        order: list[int] = []
        for grant in leases:
            for n in self.shards_of(grant.lo, grant.lo + grant.size):
                if n not in self.present and n not in order:
                    order.append(n)
        return order

    async def fetch(self, numbers: Sequence[int], fetcher: Fetcher) -> None:
        for n in numbers:
            if n in self.present:
                continue
            await fetcher.fetch_shard(self.shards[n])
            self.present.add(n)
            self._show()

    async def keep_fetched(
        self,
        leases: Callable[[], list[Grant]],
        fetcher: Callable[[], Awaitable[Fetcher | None]],
        stopping: asyncio.Event,
    ) -> None:
        """Fetch the shards of the leases held, in the background, until `stopping` (or every shard is here)."""
        while not stopping.is_set() and not self.complete:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), POLL_SECONDS)
            self.wake.clear()
            needed = self.needed(leases())
            if not needed:
                continue
            source = await fetcher()
            if source is None:
                continue
            try:
                await self.fetch(needed, source)
            except Exception as e:  # every server failed this time: the next poll tries again
                log.warning("could not fetch the training shards of our chunks yet: %s", str(e)[:300])
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), 5 * POLL_SECONDS)

    def _show(self) -> None:
        self.shown.local, self.shown.total = len(self.present), len(self.shards)


async def shard_fetcher(
    p2p: P2P,
    directory: Path,
    servers: Callable[[], Awaitable[list[str]]],
    progress: DataProgress,
    metrics: Metrics,
    ban: Callable[[str, str], object],
) -> Fetcher | None:
    """A fetcher over the servers `servers()` names now (multiaddrs; those that answer a dial)."""
    peers: list[PeerID] = []
    for text in await servers():
        with contextlib.suppress(Exception):
            peer = await dial(p2p, Multiaddr(text), DIAL_SECONDS)
            if peer not in peers:
                peers.append(peer)
    if not peers:
        log.warning("no peer of the run answers for the training shards of our chunks")
        return None
    return Fetcher(p2p, peers, directory, progress, metrics, ban)


def server_maddrs(records: Sequence[dict[str, object]], own: str, given: Sequence[str]) -> list[str]:
    """Where to ask for shards: every live public peer of the run (one address each, with its /p2p/ id),
    then the peers we were given."""
    found = []
    for record in records:
        peer = str(record.get("peer_id") or "")
        maddrs = record.get("maddrs")
        if not peer or peer == own or record.get("reachability") != "public" or not isinstance(maddrs, list):
            continue
        for maddr in maddrs:
            text = str(maddr)
            if "/p2p-circuit" in text:
                continue
            found.append(text if "/p2p/" in text else f"{text}/p2p/{peer}")
            break
    return [*found, *(m for m in given if m not in found)]
