"""A node's copy of the run's dataset: found on this machine, or fetched from the run's peers; then served.

A node that lacks the dataset the manifest names (`data.dataset`, the index hash) downloads it over the data
protocol (`peers/datashare.py`, `peers/datafetch.py`) from the peers it was given (the bootstrap), before it builds its trainer:
the index first (its sha256 is the run's hash), then the tokenizer (its sha256 is in the index), then every
shard (size and sha256 in the index), each verified before use and resumed where a cut download stopped. A
server whose bytes do not match is banned. Progress goes to the log and `/api/status` (`data_fetch`).
Every full node serves the copy it holds, at most `data.serve_bandwidth` Mbit/s.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from dilocod.config import Config
from dilocod.data.errors import DataError
from dilocod.data.localcopy import find_local_copy, open_dataset, run_data_dir
from dilocod.data.shards import INDEX_FILE, TOKENIZER_FILE, DatasetIndex, ShardInfo, parse_index
from dilocod.manifest.obtain import Joined
from dilocod.observability.metrics import Metrics
from dilocod.observability.peerstate import DataProgress
from peers.databulk import BulkRoutes
from peers.datafetch import FetchResult, fetch_file, remote_size
from peers.datashare import DataFetchError, DataServer
from peers.node import Node
from peers.runinfo import dial, start_client

log = logging.getLogger("dilocod.data")

DIAL_SECONDS = 10.0
LOG_EVERY_SECONDS = 5.0
MAX_META_BYTES = 64 << 20  # an index or tokenizer a server says is larger is not taken from it


def with_path(cfg: Config, directory: Path) -> Config:
    return replace(cfg, data=replace(cfg.data, path=str(directory.resolve())))


async def local_dataset(cfg: Config, run_dir: Path | None, *, may_prepare: bool) -> Config | None:
    """`cfg` pointing at a verified copy of the run's dataset on this machine; None when there is none.
    A run without a pinned dataset (no `data.dataset`) reads what `data.source` gives, as it is."""
    if not cfg.data.dataset:
        return cfg
    found = await asyncio.to_thread(find_local_copy, cfg.data, run_dir, may_prepare=may_prepare)
    return None if found is None else with_path(cfg, found)


async def fetch_dataset(
    cfg: Config,
    run_dir: Path | None,
    servers: Sequence[str],
    host: str,
    progress: DataProgress,
    metrics: Metrics,
    ban: Callable[[str, str], object],
    *,
    train: bool = True,
) -> Config:
    """Download the run's dataset into `data.path` (or `<run dir>/data`) from `servers` (multiaddrs).
    Without `train`, only the index, the tokenizer and the eval split: a joiner fetches the training shards
    its chunks need as it goes (dilocod/node/shardfetch.py)."""
    dest = run_data_dir(cfg.data, run_dir)
    if dest is None:
        raise DataError(
            f"the run's dataset {cfg.data.dataset} is not on this machine: set data.path to a copy"
        )
    dest.mkdir(parents=True, exist_ok=True)
    p2p = await start_client(host)
    try:
        peers = await dial_all(p2p, servers)
        if not peers:
            raise DataError(f"cannot fetch the run's dataset: none of {', '.join(servers)} answers")
        fetcher = Fetcher(p2p, peers, dest, progress, metrics, ban)
        await fetcher.run(cfg.data.dataset, train=train)
    finally:
        with contextlib.suppress(Exception):
            await p2p.shutdown()
    # Every file against the index, once more.
    await asyncio.to_thread(functools.partial(open_dataset, dest, cfg.data.dataset, partial=not train))
    return with_path(cfg, dest)


async def dial_all(p2p: P2P, servers: Sequence[str]) -> list[PeerID]:
    peers = []
    for text in servers:
        try:
            peers.append(await dial(p2p, Multiaddr(text), DIAL_SECONDS))
        except Exception as e:
            log.warning("cannot reach %s for the run's dataset: %s", text, e)
    return peers


class Fetcher:
    """One download of a dataset: the index, the tokenizer, then the shards, with progress."""

    def __init__(
        self,
        p2p: P2P,
        servers: list[PeerID],
        dest: Path,
        progress: DataProgress,
        metrics: Metrics,
        ban: Callable[[str, str], object],
    ) -> None:
        self.p2p, self.servers, self.dest = p2p, servers, dest
        self.progress, self.metrics, self.ban = progress, metrics, ban  # `progress`: ours alone to write
        self.routes = BulkRoutes(p2p)  # each server's HTTP path, when it has one we can reach
        self.done_bytes = self.total_bytes = 0
        self._last_log = 0.0

    async def run(self, index_hash: str, *, train: bool = True) -> None:
        index = await self._index(index_hash)
        await self._small(TOKENIZER_FILE, index.tokenizer_sha256)
        # Eval first: a peer evaluates from its first round.
        files = [*index.eval.shards, *(index.train.shards if train else ())]
        self.total_bytes = sum(f.bytes for f in files)
        self._progress(0, len(files))
        log.info(
            "fetching the run's dataset %s: %d shards, %.1f MB from %d peer(s)",
            index_hash[:12], len(files), self.total_bytes / 1e6, len(self.servers),
        )  # fmt: skip
        started = time.monotonic()
        for count, info in enumerate(files):
            await self._fetch(
                info.file, info.bytes, info.sha256, functools.partial(self._held, self.done_bytes)
            )
            self.done_bytes += info.bytes
            self._progress(count + 1, len(files))
        seconds = time.monotonic() - started
        log.info(
            "fetched the run's dataset: %.1f MB in %.1fs (%.1f MB/s)",
            self.total_bytes / 1e6, seconds, self.total_bytes / 1e6 / max(seconds, 1e-9),
        )  # fmt: skip

    async def _index(self, index_hash: str) -> DatasetIndex:
        await self._small(INDEX_FILE, index_hash)
        path = self.dest / INDEX_FILE
        return parse_index(await asyncio.to_thread(path.read_bytes), str(path))

    async def _small(self, name: str, sha256: str) -> None:
        """A file known by its hash alone: its size comes from a server (a lie only fails the hash)."""
        problems = []
        for server in self.servers:
            try:
                size = await remote_size(self.p2p, server, name)
                if size > MAX_META_BYTES:
                    raise DataFetchError(f"{server} says its {name} has {size} bytes")
                await self._fetch(name, size, sha256, None, [server])
                return
            except DataFetchError as e:
                problems.append(str(e))
        raise DataError(f"cannot fetch the run's {name}: {'; '.join(problems)}")

    async def fetch_shard(self, info: ShardInfo) -> None:
        """One shard (size and sha256 from the index), counted in the progress."""
        await self._fetch(info.file, info.bytes, info.sha256, functools.partial(self._held, self.done_bytes))
        self.done_bytes += info.bytes

    async def _fetch(
        self,
        name: str,
        size: int,
        sha256: str,
        progress: Callable[[int], None] | None,
        servers: list[PeerID] | None = None,
    ) -> None:
        try:
            result = await fetch_file(
                self.p2p,
                servers or self.servers,
                name,
                size,
                sha256,
                self.dest / name,
                progress=progress,
                routes=self.routes,
            )
        except DataFetchError as e:
            raise DataError(str(e)) from None
        self._account(name, result)

    def _account(self, name: str, result: FetchResult) -> None:
        self.metrics.data_fetch_bytes.inc(result.received)
        for peer in result.bad:
            reason = f"served dataset file {name} with bytes that do not match its sha256"
            log.warning("banning %s: %s", peer, reason)
            self.ban(peer.to_base58(), reason)
            if peer in self.servers:
                self.servers.remove(peer)

    def _held(self, base: int, held: int) -> None:
        done = base + held
        if self.progress.fetch is not None:
            self.progress.fetch = {**self.progress.fetch, "bytes_done": done}
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_SECONDS:
            self._last_log = now
            log.info("fetching the run's dataset: %.1f of %.1f MB", done / 1e6, self.total_bytes / 1e6)

    def _progress(self, shards_done: int, shards_total: int) -> None:
        self.progress.fetch = {
            "bytes_done": self.done_bytes,
            "bytes_total": self.total_bytes,
            "shards_done": shards_done,
            "shards_total": shards_total,
            "done": shards_done == shards_total,
        }


async def bootstrap_dataset(joined: Joined, run_dir: Path | None, peers: Sequence[str], host: str) -> Joined:
    """A bootstrap's copy of the run's dataset: the one its `data.source` gives (prepared if need be), or,
    for a bootstrap linked to another one, fetched from it."""
    cfg = await local_dataset(joined.config, run_dir, may_prepare=True)
    if cfg is None:
        if not peers:
            raise DataError(
                f"the run's dataset {joined.config.data.dataset} is not on this machine: point data.source or "
                "data.path at it, or give the address of a node that has it"
            )
        client_host = "::1" if ":" in host else "127.0.0.1"
        progress, metrics = DataProgress(), Metrics()
        cfg = await fetch_dataset(
            joined.config, run_dir, peers, client_host, progress, metrics, lambda *_: None
        )
    return replace(joined, config=cfg)


async def serve_dataset(
    node: Node, cfg: Config, metrics: Metrics, extra: Mapping[str, Path] | None = None
) -> DataServer | None:
    """Serve our copy of the run's dataset to peers that ask (its index, tokenizer and shards, nothing else),
    and the `extra` files by name (the run's starting weights, `initweights.py`)."""
    if not cfg.data.path:
        return None
    directory = Path(cfg.data.path)
    try:
        # A joiner's partial copy serves the shards it holds.
        index = await asyncio.to_thread(
            functools.partial(open_dataset, directory, cfg.data.dataset, partial=True)
        )
    except DataError as e:
        log.warning("not serving the dataset: %s", e)
        return None
    names = {INDEX_FILE, TOKENIZER_FILE, *(info.file for info in index.files())}

    extras = dict(extra or {})

    def resolve(name: str) -> Path | None:
        path = extras.get(name) or directory / name
        return path if (name in names or name in extras) and path.is_file() else None

    rate = cfg.data.serve_bandwidth * 1e6 / 8 if cfg.data.serve_bandwidth > 0 else None
    bulk_port = cfg.data.bulk_port if cfg.data.bulk_port >= 0 else None
    server = await node.serve_data(resolve, rate_limit=rate, bulk_port=bulk_port)
    http = f", over HTTP on port {server.bulk.port} too" if server.bulk is not None else ""
    log.info("serving the run's dataset %s from %s%s%s", index.hash[:12], directory,
             f" at most {cfg.data.serve_bandwidth:g} Mbit/s" if rate else "", http)  # fmt: skip
    return server


def served_status(server: DataServer | None) -> dict[str, Any] | None:
    if server is None:
        return None
    bulk = server.bulk
    return {
        "bytes_served": server.bytes_served,
        "requests": server.requests,
        "http_port": bulk.port if bulk is not None else None,  # None: p2p only
        "bytes_served_http": bulk.bytes_served if bulk is not None else 0,  # of bytes_served
    }
