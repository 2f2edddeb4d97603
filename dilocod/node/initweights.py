"""A node's copy of the run's starting weights (`model.init`): found on this machine, or fetched from the run.

A run started with `--init-from` has θ_global at outer step 0 = those weights, not the seed's random init,
so a peer that starts without a checkpoint needs them before it builds its trainer. It takes them from
`model.init_from` when that directory holds them, else from `<run dir>/init` (an earlier fetch), else it
downloads them over the data protocol (`peers/datafetch.py`, resumable, verified against the manifest's
sha256: bytes that do not match fail it, and the next server is tried) from the peers it was given. Every full node that
holds them serves them beside the dataset, under `INIT_NAME`. A peer that joins a run past step 0 fetches
them too (it cannot know the run's step before its network starts), then downloads θ_global as any joiner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from dilocod.config import Config, ConfigError
from dilocod.data.errors import DataError
from dilocod.export.hf import WEIGHTS_FILE
from dilocod.files import file_sha256
from dilocod.node.dataset import dial_all
from dilocod.observability.metrics import Metrics
from peers.databulk import BulkRoutes
from peers.datafetch import fetch_file, remote_size
from peers.datashare import DataFetchError
from peers.runinfo import start_client

log = logging.getLogger("dilocod.init")

INIT_NAME = "init.safetensors"  # the starting weights' name on the data protocol (no dataset file has it)
INIT_DIR = "init"  # where a peer keeps fetched starting weights, in its run dir


def init_weights_file(cfg: Config) -> Path | None:
    """The model.safetensors this node would start from (None: the run starts from the seed's init)."""
    if not cfg.model.init or not cfg.model.init_from:
        return None
    return Path(cfg.model.init_from) / WEIGHTS_FILE


def verified_copy(cfg: Config) -> Path | None:
    """`model.init_from`'s weights, when they are the run's (ConfigError when they are other weights)."""
    path = init_weights_file(cfg)
    if path is None or not path.is_file():
        return None
    sha = file_sha256(path)
    if sha != cfg.model.init:
        raise ConfigError(
            f"model.init_from: {path} holds weights {sha[:16]}…, not the run's starting weights "
            f"{cfg.model.init[:16]}… (model.init)"
        )
    return path


def served_init(cfg: Config) -> dict[str, Path]:
    """What a node serves of the starting weights: {INIT_NAME: its verified copy}, or nothing."""
    path = verified_copy(cfg)
    return {INIT_NAME: path} if path is not None else {}


def with_init_dir(cfg: Config, directory: Path) -> Config:
    return replace(cfg, model=replace(cfg.model, init_from=str(directory.resolve())))


async def ensure_init(
    cfg: Config, run_dir: Path, servers: Sequence[str], host: str, metrics: Metrics
) -> Config:
    """`cfg` whose `model.init_from` holds the run's verified starting weights (unchanged for a run without)."""
    if not cfg.model.init:
        return cfg
    if cfg.model.init_from and await asyncio.to_thread(verified_copy, cfg) is not None:
        return cfg
    fetched = with_init_dir(cfg, run_dir / INIT_DIR)
    with contextlib.suppress(ConfigError):  # a damaged earlier fetch is fetched again (resumed where it can)
        if await asyncio.to_thread(verified_copy, fetched) is not None:
            return fetched
    if not servers:
        raise DataError(
            f"the run's starting weights {cfg.model.init[:16]}… are not on this machine: set model.init_from "
            "to the checkpoint directory, or give the address of a node that has them"
        )
    (run_dir / INIT_DIR).mkdir(parents=True, exist_ok=True)
    await _fetch(cfg.model.init, run_dir / INIT_DIR / WEIGHTS_FILE, servers, host, metrics)
    return fetched


async def _fetch(sha256: str, dest: Path, servers: Sequence[str], host: str, metrics: Metrics) -> None:
    p2p = await start_client(host)
    try:
        peers = await dial_all(p2p, servers)
        routes = BulkRoutes(p2p)  # each server's HTTP path, when it has one we can reach
        problems = []
        for peer in peers:  # each server's size in turn: a lie about it only fails that server's hash
            try:
                size = await remote_size(p2p, peer, INIT_NAME)
                log.info(
                    "fetching the run's starting weights %s (%.1f MB) from %s", sha256[:12], size / 1e6, peer
                )
                result = await fetch_file(p2p, [peer], INIT_NAME, size, sha256, dest, routes=routes)
            except DataFetchError as e:
                problems.append(str(e))
                continue
            metrics.data_fetch_bytes.inc(result.received)
            log.info("fetched the run's starting weights into %s", dest)
            return
        raise DataError(
            f"cannot fetch the run's starting weights: {'; '.join(problems) or 'no server answers'}"
        )
    finally:
        with contextlib.suppress(Exception):
            await p2p.shutdown()
