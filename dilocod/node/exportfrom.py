"""`dilocod export --from MADDR`: the run's current θ_global taken from the swarm, without training.

A short-lived node does what a joining peer does (`dilocod/statesync/catchup.py`), and no more: it takes the
run's manifest from MADDR (the model's shape, the dataset's hash), the tokenizer over the data protocol
(checked against that hash), then starts a client-mode DHT node and averager, downloads θ_global from the
most advanced peer that serves it, and keeps it only when (1) it decodes to the run's shapes, finite fp32,
(2) it matches the donor's own hash, and (3) more than half of the live peers that reported a θ_global for
that outer step report this one (the donor's own record counted: a run of one peer is its own majority).
A donor that fails is skipped and the next one tried. The client never averages and serves nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from dilocod.config import Config
from dilocod.data.shards import INDEX_FILE, TOKENIZER_FILE, parse_index
from dilocod.data.tokenizer import BYTE, load_tokenizer, tokenizer_json
from dilocod.diloco.outer import global_sha256
from dilocod.export.errors import ExportError
from dilocod.export.export import check_out, write_export
from dilocod.export.run import BYTE_VOCAB, RunModel, check_params, run_tokenizer
from dilocod.manifest.adopt import adopt
from dilocod.manifest.obtain import fetch
from dilocod.manifest.record import Manifest
from dilocod.node.autodeadlines import resolve_deadlines
from dilocod.node.groupsettings import averaging_settings
from dilocod.observability.runview import read_run
from dilocod.statesync.ledger import remember_hashes
from dilocod.trainer.lm import lm_skeleton
from dilocod.trainer.model import ModelConfig
from peers.datafetch import fetch_file, remote_size
from peers.datashare import DataFetchError
from peers.errors import PeersError
from peers.group import DownloadedState, GroupAverager
from peers.node import Node, NodeSettings, parse_multiaddr
from peers.runinfo import dial, start_client
from proto import ProtoError, decode_state_meta

log = logging.getLogger("dilocod.export")

MANIFEST_SECONDS = 15.0  # a maddr that gives no manifest by then does not answer
RECORD_SECONDS = 20.0  # how long to wait for the run's records (peers publish every few seconds)
DONORS = 3  # donors tried before giving up
WATCH_SECONDS = 0.5  # records are read this often while a state downloads
MAX_META_BYTES = 64 << 20


@dataclass(frozen=True)
class Agreement:
    """Who reported which θ_global at one outer step."""

    agreeing: int
    reporting: int

    @property
    def majority(self) -> bool:
        return 2 * self.agreeing > self.reporting


def agreement(seen: dict[int, dict[str, str]], step: int, served: str) -> Agreement:
    """How many of the peers that reported a θ_global for `step` report `served` (pure)."""
    reports = seen.get(step, {})
    return Agreement(sum(h == served for h in reports.values()), len(reports))


async def export_from(
    maddr: str,
    out: Path,
    local_raw: dict[str, Any],
    *,
    data_path: Path | None = None,
    record_seconds: float | None = None,
) -> Path:
    """Export the run's θ_global, as the peers of the run MADDR belongs to agree on it, into `out`.
    `record_seconds`: how long to wait for the peers' records and their agreement (None: RECORD_SECONDS)."""
    out = Path(out)
    check_out(out)
    try:
        parse_multiaddr(maddr)
    except PeersError as e:
        raise ExportError(str(e)) from None
    manifest = await _manifest(maddr)
    cfg = adopt(manifest, local_raw)
    model = ModelConfig(cfg.model.preset, cfg.model.vocab_size, hf_config_json=cfg.model.hf_config_json)
    vocab = (
        model.vocab_size if model.hf_config_json and model.vocab_size else lm_skeleton(model).shape.vocab_size
    )
    with tempfile.TemporaryDirectory(prefix="dilocod-export-") as tmp:
        tok, raw = await _tokenizer(cfg, vocab, maddr, Path(tmp), data_path)
    run = await _theta_global(cfg, manifest, model, maddr, record_seconds or RECORD_SECONDS)
    return await asyncio.to_thread(write_export, out, run, tok, raw)


async def _manifest(maddr: str) -> Manifest:
    try:
        return await fetch([maddr], None, "127.0.0.1", deadline=MANIFEST_SECONDS)
    except PeersError as e:
        raise ExportError(f"{maddr} does not answer as a node of a run: {e}") from None


async def _tokenizer(
    cfg: Config, vocab: int, maddr: str, tmp: Path, data_path: Path | None
) -> tuple[Tokenizer, bytes]:
    """The run's tokenizer: from `data_path` (a local copy of the dataset), or the index and tokenizer
    files over the data protocol from `maddr`, each checked against the hash the manifest pins."""
    dataset = cfg.data.dataset or None
    if data_path is not None:
        return run_tokenizer(tmp, vocab, dataset, data_path)
    if dataset is None:
        if vocab == BYTE_VOCAB:
            return load_tokenizer(BYTE), tokenizer_json(BYTE)
        raise ExportError("the run pins no dataset: pass --data-path with a copy that has its tokenizer")
    p2p = await start_client("127.0.0.1")
    try:
        peer = await dial(p2p, parse_multiaddr(maddr), 10.0)
        index = await _small(p2p, peer, INDEX_FILE, dataset, tmp)
        await _small(
            p2p, peer, TOKENIZER_FILE, parse_index(index.read_bytes(), str(index)).tokenizer_sha256, tmp
        )
    except (DataFetchError, OSError, PeersError) as e:
        raise ExportError(f"cannot fetch the run's tokenizer from {maddr}: {e}") from None
    finally:
        with contextlib.suppress(Exception):
            await p2p.shutdown()
    return run_tokenizer(tmp, vocab, dataset, tmp)


async def _small(p2p: Any, peer: Any, name: str, sha256: str, tmp: Path) -> Path:
    size = await remote_size(p2p, peer, name)
    if size > MAX_META_BYTES:
        raise DataFetchError(f"it says its {name} has {size} bytes")
    await fetch_file(p2p, [peer], name, size, sha256, tmp / name)
    return tmp / name


async def _theta_global(
    cfg: Config, manifest: Manifest, model: ModelConfig, maddr: str, record_seconds: float
) -> RunModel:
    """θ_global from a donor, checked as the module's docstring says, with what identifies it."""
    family = "::" if ":" in cfg.net.host else "0.0.0.0"
    options = NodeSettings(
        run_id=manifest.run_id, initial_peers=(maddr,), host=family, client_mode=True,
        auth=cfg.run.auth(), bootstrap_wait=MANIFEST_SECONDS,
    )  # fmt: skip
    node = Node(options)
    loop = asyncio.get_running_loop()
    try:
        await loop.run_in_executor(None, node.start)
    except PeersError as e:
        raise ExportError(str(e)) from None
    # This client never averages: its averager holds a one-element buffer, not a copy of the model.
    group = GroupAverager(
        node, [torch.zeros(1)], averaging_settings(cfg, "client", run_tag=manifest.hash), None
    )
    try:
        group.start()  # forks the averager process: from the main thread, as the peer does
        return await _Download(cfg, manifest, model, node, group, record_seconds).run()
    finally:
        await loop.run_in_executor(None, group.stop)
        await loop.run_in_executor(None, node.stop)


class _Download:
    """Donors tried in turn until one serves a θ_global most reporting peers hold."""

    def __init__(
        self,
        cfg: Config,
        manifest: Manifest,
        model: ModelConfig,
        node: Node,
        group: GroupAverager,
        record_seconds: float = RECORD_SECONDS,
    ):
        self.cfg, self.manifest, self.model, self.node, self.group = cfg, manifest, model, node, group
        self.record_seconds = record_seconds
        self.seen: dict[int, dict[str, str]] = {}  # outer step → peer → θ hash reported

    async def run(self) -> RunModel:
        await self._wait_for_records()
        # A record says only its peer's latest step, and a download can take rounds (a big model, a short
        # round): the steps reported meanwhile, the donor's among them, are what its θ_global is held to.
        watcher = asyncio.create_task(self._watch_records())
        try:
            return await self._from_donors()
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _watch_records(self) -> None:
        while True:
            await self.records()
            await asyncio.sleep(WATCH_SECONDS)

    async def _from_donors(self) -> RunModel:
        tried: list[str] = []
        problems: list[str] = []
        # a donor's state is at most 4 model-sized sets: θ_global, m, v (FedAdam/FedYogi), a round in flight
        elements = sum(t.numel() for t in named_params_shapes(self.model))
        for _ in range(DONORS):
            got = await self.group.download_state(
                exclude=tried, min_step=0, max_elements=4 * elements, timeout=self._state_timeout()
            )
            if got is None:
                break
            tried.append(got.donor)
            try:
                return await self._checked(got)
            except ExportError as e:
                log.warning("refused the state of %s: %s", got.donor, e)
                problems.append(f"{got.donor[-8:]}: {e}")
        if not problems:
            raise ExportError(f"no peer of run '{self.manifest.run_id}' served its state")
        raise ExportError("no θ_global to trust: " + "; ".join(problems))

    def _state_timeout(self) -> float:
        """The state download's deadline: the run's value, or the rule's for this model (0 = auto)."""
        return resolve_deadlines(self.cfg)[0].averaging.state_timeout

    async def records(self) -> list[dict[str, Any]]:
        try:
            records = await read_run(self.node)
        except Exception as e:
            log.debug("could not read the run's records: %r", e)
            return []
        peers = [r for r in records if r["role"] == "peer" and r.get("manifest_hash") == self.manifest.hash]
        remember_hashes(self.seen, peers)
        return peers

    async def _wait_for_records(self) -> None:
        deadline = time.monotonic() + self.record_seconds
        while not await self.records():
            if time.monotonic() >= deadline:
                raise ExportError(
                    f"no peer of run '{self.manifest.run_id}' holds a θ_global: none published a status "
                    f"record in {self.record_seconds:g}s"
                )
            await asyncio.sleep(0.5)

    async def _checked(self, got: DownloadedState) -> RunModel:
        try:
            meta = decode_state_meta(got.meta)
        except ProtoError as e:
            raise ExportError(f"bad state metadata: {e}") from None
        n = int(meta["param_count"])
        params = list(got.tensors[:n])
        if len(got.tensors) < n or any(
            t.dtype != torch.float32 or not bool(torch.isfinite(t).all()) for t in params
        ):
            raise ExportError("its θ_global is not whole, finite fp32")
        try:
            check_params(params, self.model)
        except ExportError as e:
            raise ExportError(f"its θ_global is not the run's model: {e}") from None
        sha, step = global_sha256(params), int(meta["outer_step"])
        if sha != meta["global_sha256"]:
            raise ExportError("its θ_global does not match its own hash")
        votes = await self._agreement(step, sha)
        if not votes.majority:
            raise ExportError(
                f"θ_global {sha[:12]} at outer step {step} is reported by {votes.agreeing} of the "
                f"{votes.reporting} peers that reported that step"
            )
        log.info("θ_global %s at outer step %d from %s, as %d of %d peers report", sha[:12], step,
                 got.donor, votes.agreeing, votes.reporting)  # fmt: skip
        m = self.manifest
        return RunModel(
            run_id=m.run_id, preset=self.cfg.model.preset, model=self.model, params=params, outer_step=step,
            global_sha256=sha, tokens_trained=None, checkpoint=None, manifest_hash=m.hash,
            dataset=self.cfg.data.dataset or None,
            swarm={"donor": got.donor, "peers_agreeing": votes.agreeing, "peers_reporting": votes.reporting},
        )  # fmt: skip

    async def _agreement(self, step: int, sha: str) -> Agreement:
        """The reports for `step`, once a majority agrees or the records had time to arrive (the watcher
        of `run` reads them)."""
        deadline = time.monotonic() + self.record_seconds
        while True:
            votes = agreement(self.seen, step, sha)
            if votes.majority or time.monotonic() >= deadline:
                return votes
            await asyncio.sleep(WATCH_SECONDS)


def named_params_shapes(model: ModelConfig) -> Sequence[torch.Tensor]:
    """θ_global's tensors as meta tensors (shapes only), in the model's parameter order."""
    return list(lm_skeleton(model).parameters())
