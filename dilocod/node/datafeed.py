"""Where a peer's batches come from: the run's chunk schedule (dilocod/node/chunks.py), and the training
shards its chunks need when its copy of the dataset is partial (dilocod/node/shardfetch.py).

The peer that started the run coordinates the schedule itself; every other peer asks the coordinator it was
given. Leases come before the first step (or the reason none do), and a partial copy has the shards of its
first chunk before then too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dilocod.config import Config
from dilocod.data.errors import DataError
from dilocod.data.localcopy import missing_train_shards
from dilocod.data.shards import load_index
from dilocod.node.chunks import (
    ChunkService,
    ChunkSync,
    local_exchange,
    remote_exchange,
    serve_no_schedule,
    start_service,
)
from dilocod.node.dataset import Fetcher
from dilocod.node.netstart import Network
from dilocod.node.resume import Resumed
from dilocod.node.shardfetch import LazyShards, server_maddrs, shard_fetcher
from dilocod.observability.metrics import Metrics
from dilocod.observability.peerstate import PeerState
from dilocod.observability.runview import read_run
from dilocod.trainer.batches import PresentSampler


class DataFeed:
    def __init__(
        self,
        run_dir: Path,
        initial_peers: Sequence[str],
        state: PeerState,
        metrics: Metrics,
        ban: Callable[[str, str], object],
        stopping: asyncio.Event,
        fetching: Callable[[], None] = lambda: None,
    ) -> None:
        self.run_dir, self.initial_peers, self.state, self.metrics = run_dir, initial_peers, state, metrics
        self.ban, self.stopping = ban, stopping
        self.fetching = fetching  # we fetch the shards of our first chunk before training (the phase shown)
        self.service: ChunkService | None = None  # when we started the run: we coordinate its chunks
        self.sync: ChunkSync | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @staticmethod
    def partial_copy(cfg: Config) -> bool:
        """Whether our copy of the run's dataset lacks training shards (a joiner's: fetched as needed)."""
        if not cfg.data.dataset or not cfg.data.path:
            return False
        directory = Path(cfg.data.path)
        return bool(missing_train_shards(directory, load_index(directory)))

    async def start(self, cfg: Config, resumed: Resumed, network: Network) -> list[asyncio.Task[None]]:
        """Join the schedule and fetch what the first chunk needs; the background tasks this started."""
        await self._schedule(cfg, resumed, network)
        await self._lazy_shards(cfg, resumed, network)
        return self._tasks

    async def _schedule(self, cfg: Config, resumed: Resumed, network: Network) -> None:
        if not cfg.data.dataset:
            return
        if not self.initial_peers and cfg.data.chunk_tokens == 0:
            if not network.client:
                await serve_no_schedule(network.node)
            return
        if self.initial_peers:
            exchange = remote_exchange(network.node, self.initial_peers)
        else:
            data = cfg.data
            self.service = await start_service(
                network.node, resumed.trainer.train_tokens, data.dataset, data.chunk_tokens, data.lease_seconds,
                self.run_dir, serve=not network.client,
            )  # fmt: skip
            self._tasks.append(asyncio.create_task(self.service.keep_saved(self.stopping)))
            exchange = local_exchange(self.service, network.node.peer_id)
        self.sync = ChunkSync(resumed.cursor, exchange)
        loop = asyncio.get_running_loop()
        wake = self.sync.wake

        def wake_sync() -> None:  # on the trainer thread
            loop.call_soon_threadsafe(wake.set)

        resumed.cursor.on_finished = wake_sync
        await self.sync.once()
        if self.sync.off:
            return
        resumed.trainer.cursor = resumed.cursor
        self._tasks.append(asyncio.create_task(self.sync.keep_in_step(self.stopping)))

    async def _lazy_shards(self, cfg: Config, resumed: Resumed, network: Network) -> None:
        """With a partial copy: the shards of our first chunk now, the rest in the background as the chunk
        schedule leases them; every shard first when it leased us none."""
        if not self.partial_copy(cfg):
            return
        directory = Path(cfg.data.path)
        lazy = LazyShards(directory, await asyncio.to_thread(load_index, directory), self.state.shards)
        p2p = await network.node.client_p2p()

        async def servers() -> list[str]:
            records = await read_run(network.node)
            return server_maddrs(records, self.state.peer_id, self.initial_peers)

        async def fetcher() -> Fetcher | None:
            return await shard_fetcher(p2p, directory, servers, self.state.dataset, self.metrics, self.ban)

        leases = resumed.cursor.leases()
        missing = [n for n in range(len(lazy.shards)) if n not in lazy.present]
        first = lazy.needed(leases[:1]) if leases else missing
        if first:
            self.fetching()
            source = await fetcher()
            if source is None:
                raise DataError(
                    "cannot fetch the training shards of our first chunk: no peer of the run answers"
                )
            await lazy.fetch(first, source)
        resumed.cursor.ready = lazy.ready
        trainer = resumed.trainer
        trainer.sampler = PresentSampler(
            trainer.train_source, lazy.present_ranges, seed=cfg.run.seed, peer_key=trainer.peer_key,
            batch_size=cfg.trainer.batch_size, seq_len=cfg.trainer.seq_len,
        )  # fmt: skip
        if self.sync is not None:
            self.sync.on_synced = lazy.wake.set
        self._tasks.append(
            asyncio.create_task(lazy.keep_fetched(resumed.cursor.leases, fetcher, self.stopping))
        )

    # ---- observability ---------------------------------------------------------------------------------
    def status(self, resumed: Resumed | None) -> dict[str, Any] | None:
        """`/api/status` `data_schedule`."""
        if self.sync is None or resumed is None:
            return None
        return {
            **self.sync.status(),
            "coordinator": self.service is not None,
            "unscheduled_batches": resumed.trainer.unscheduled_batches,
        }

    def progress(self) -> dict[str, Any] | None:
        """The run's progress through its dataset: our own book, or what the coordinator last told us."""
        if self.service is not None:
            return self.service.progress()
        return self.sync.progress if self.sync is not None else None
