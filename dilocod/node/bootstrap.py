"""`dilocod bootstrap`: a long-lived public DHT node that seeds the run, relays, and shows the run."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dilocod import __version__
from dilocod.config import Config
from dilocod.data.localcopy import open_dataset
from dilocod.manifest.book import ManifestBook
from dilocod.manifest.record import Manifest
from dilocod.node.chunks import ChunkService, serve_no_schedule, start_service
from dilocod.node.dataset import serve_dataset, served_status
from dilocod.node.helper import AuxReducer
from dilocod.node.runtime import STOP_GRACE_SECONDS, install_stop_signals, wait_while
from dilocod.observability.history import RunHistory
from dilocod.observability.http import HttpServer
from dilocod.observability.metrics import Metrics
from dilocod.observability.runview import flag_manifests, newest_sample, read_run
from dilocod.observability.scoreview import published_verdicts, score_view
from dilocod.trust.scoring import RatingRule
from peers.datashare import DataServer
from peers.errors import PeersError
from peers.node import Node, NodeSettings, first_public_maddrs
from peers.reachability import free_ports
from peers.relay import RELAY_IDENTITIES, RelayProcess, public_ipv4

log = logging.getLogger("dilocod.node.bootstrap")

REFRESH_SECONDS = 5.0


@dataclass(frozen=True)
class BootstrapArgs:
    run_id: str
    host: str
    port: int
    http_host: str
    http_port: int | None
    maddr_file: Path | None
    identity_path: Path | None
    announce: tuple[str, ...] = ()
    initial_peers: tuple[str, ...] = ()
    config: Config | None = None  # the run's config: model shapes and deadlines for the aux reducer
    manifest: Manifest | None = None  # the run's manifest, served to nodes that join (None: tests only)
    run_dir: Path | None = None  # the run's home: identity, manifest, log (dilocod/manifest/obtain.py)
    reduce: bool = True  # join every round as an auxiliary reducer (peers behind NAT need one)
    relay: bool = False  # run a circuit relay that carries pseudo-gradients between NATed peers
    relay_port: int = 0  # first of the relay's ports (0: bootstrap port + 1, or free ports)
    serve_files: dict[str, Path] = field(default_factory=dict)  # beside the dataset: the starting weights


class BootstrapDaemon:
    def __init__(self, args: BootstrapArgs) -> None:
        self.args = args
        self.metrics = Metrics()
        self.stopping = asyncio.Event()
        self.node: Node | None = None
        self.http: HttpServer | None = None
        self.history = RunHistory()
        self.aux: AuxReducer | None = None
        self.relay: RelayProcess | None = None
        self.relays: list[str] = []
        self.started = time.time()
        self._peers: list[dict[str, Any]] = []
        self._dht_records: int | None = None  # records our DHT node holds, read with the run
        self.manifests: ManifestBook | None = None
        self.data_server: DataServer | None = None
        self.chunk_service: ChunkService | None = None

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        try:
            self.node = Node(
                NodeSettings(
                    run_id=self.args.run_id,
                    initial_peers=self.args.initial_peers,
                    host=self.args.host,
                    port=self.args.port,
                    announce=self.args.announce,
                    identity_path=str(self.args.identity_path) if self.args.identity_path else None,
                    relay_service=True,
                    reachability="public",
                    auth=self.args.config.run.auth() if self.args.config is not None else None,
                )
            )
            if self.args.identity_path is not None:
                self.args.identity_path.parent.mkdir(parents=True, exist_ok=True)
            await loop.run_in_executor(None, self.node.start)
            if self.args.config is not None:  # the run's dataset, to peers that have no copy
                config, files = self.args.config, self.args.serve_files
                self.data_server = await serve_dataset(self.node, config, self.metrics, files)
            tasks = self._start_reducing()
            tasks += await self._coordinate_chunks()
            self.relays = await loop.run_in_executor(None, self._start_relay)
            # After the aux reducer's fork: peers ask us whether they are reachable (a dial-back), and
            # learn the relays there.
            await self.node.serve_dialback(self.relays)
            tasks += await self._serve_manifest()
            if self.args.http_port is not None:
                self.http = HttpServer(
                    self.metrics, self.status, self.run_view, self.history, manifest=self._manifest_json,
                    dataset=self.dataset_progress, sample=self.sample, scoring=self.scoring_view,
                )  # fmt: skip
                port = await self.http.start(self.args.http_host, self.args.http_port)
                log.info("dashboard: http://%s:%d/  (run API: /api/run)", self._display_host(), port)
            self._announce()
            await self._watch_until_stopped()
            if self.aux is not None and self.aux.group.in_allreduce:
                # A reducer that vanishes mid-round leaves the group with partial means: finish serving
                # the parts we hold (the round ends on its own deadline at the latest), then stop.
                log.info("stopping after the round being reduced (at most %.0fs)", STOP_GRACE_SECONDS)
                aux = self.aux
                await wait_while(lambda: aux.group.in_allreduce, STOP_GRACE_SECONDS)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            if self.http is not None:
                await self.http.stop()
            if self.data_server is not None:  # its HTTP listener; the p2p side goes with the node
                await self.data_server.stop()
            if self.aux is not None:
                await loop.run_in_executor(None, self.aux.stop)
            if self.relay is not None:
                await loop.run_in_executor(None, self.relay.stop)
                shutil.rmtree(self.relay.workdir, ignore_errors=True)  # its temporary log and address file
            if self.node is not None:
                await loop.run_in_executor(None, self.node.stop)
        return 0

    async def _serve_manifest(self) -> list[asyncio.Task[None]]:
        """Serve the run's manifest over p2p and keep it in the DHT: joining nodes take it from us."""
        if self.args.manifest is None or self.node is None:
            return []
        self.manifests = ManifestBook(self.node, self.args.manifest)
        await self.node.serve_manifest(self.manifests.blob)
        return [asyncio.create_task(self.manifests.keep_published(self.stopping))]

    async def _coordinate_chunks(self) -> list[asyncio.Task[None]]:
        """Keep the run's chunk schedule (dilocod/data/schedule.py), unless we joined another bootstrap's run:
        one run has one coordinator, the first bootstrap."""
        cfg = self.args.config
        if cfg is None or not cfg.data.dataset or not cfg.data.path or self.args.initial_peers:
            return []
        assert self.node is not None
        if cfg.data.chunk_tokens == 0:
            await serve_no_schedule(self.node)
            return []
        index = await asyncio.to_thread(open_dataset, Path(cfg.data.path), cfg.data.dataset)
        self.chunk_service = await start_service(
            self.node, index.train.tokens, cfg.data.dataset, cfg.data.chunk_tokens, cfg.data.lease_seconds,
            self.args.run_dir, serve=True,
        )  # fmt: skip
        return [asyncio.create_task(self.chunk_service.keep_saved(self.stopping))]

    def dataset_progress(self) -> dict[str, Any] | None:
        return self.chunk_service.progress() if self.chunk_service is not None else None

    def sample(self, records: list[dict[str, Any]]) -> dict[str, Any] | None:
        prompt = self.args.config.trainer.sample_prompt if self.args.config is not None else ""
        return newest_sample([r for r in records if not r.get("other_manifest")], prompt)

    def _manifest_json(self) -> dict[str, Any] | None:
        return None if self.args.manifest is None else self.args.manifest.to_json()

    def _start_reducing(self) -> list[asyncio.Task[None]]:
        if not self.args.reduce or self.node is None:
            return []
        manifest_hash = self.args.manifest.hash if self.args.manifest is not None else "0" * 64
        self.aux = AuxReducer(self.node, self.args.config or Config(), manifest_hash)
        # hivemind forks the averager from this (main) thread and resets SIGINT there: ours go back on.
        self.aux.start()
        install_stop_signals(self.stopping)
        log.info("reducing for the run as an auxiliary peer (--no-reduce turns this off)")
        return [asyncio.create_task(self.aux.serve(self.stopping))]

    def _start_relay(self) -> list[str]:
        """Start the py-libp2p relay child (peers/relay.py) on our public IP; its multiaddrs."""
        if not self.args.relay:
            return []
        assert self.node is not None
        ip = self._public_ip()
        first = self.args.relay_port or (self.args.port + 1 if self.args.port else 0)
        ports = [first + i for i in range(RELAY_IDENTITIES)] if first else free_ports(ip, RELAY_IDENTITIES)
        self.relay = RelayProcess(ip, ports, Path(tempfile.mkdtemp(prefix="dilocod-relay-")))
        maddrs = self.relay.start()
        log.info(
            "relaying for peers behind NAT (log: %s): %s", self.relay.workdir / "relay.log", " ".join(maddrs)
        )
        return maddrs

    def _public_ip(self) -> str:
        """The IPv4 address the relay listens on and announces: --announce, --host, or what p2pd sees."""
        assert self.node is not None
        ip = public_ipv4([*self.args.announce, f"/ip4/{self.args.host}/tcp/0", *self.node.visible_maddrs()])
        if ip is None and self.args.host.startswith("127."):  # a bootstrap on loopback relays on loopback
            ip = self.args.host
        if ip is None:
            raise PeersError(
                "--relay needs the bootstrap's public IPv4 address: pass --announce /ip4/IP/tcp/PORT"
            )
        return ip

    def _display_host(self) -> str:
        return "127.0.0.1" if self.args.http_host in ("0.0.0.0", "::") else self.args.http_host

    def _announce(self) -> None:
        assert self.node is not None
        maddrs = first_public_maddrs(self.node.visible_maddrs())
        for maddr in maddrs:
            print(f"bootstrap maddr: {maddr}", flush=True)
        if self.args.maddr_file is not None:
            tmp = self.args.maddr_file.with_suffix(".tmp")
            tmp.write_text("".join(f"{m}\n" for m in maddrs))
            tmp.replace(self.args.maddr_file)  # readers never see a half-written file

    async def _watch_until_stopped(self) -> None:
        while not self.stopping.is_set():
            try:
                self._peers = await self.run_view()
                self.metrics.peers_known.set(len(self._peers))
                if self.node is not None and self.node.dht is not None:
                    self._dht_records = await self.node.dht_records()
            except Exception as e:
                log.debug("reading the run failed: %r", e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), REFRESH_SECONDS)

    async def scoring_view(self) -> dict[str, Any] | None:
        """The scorers' published verdicts, unchecked: a bootstrap is in no round (dilocod/observability/scoreview.py)."""
        cfg = self.args.config
        if cfg is None or not cfg.scoring.enabled or self.node is None or self.node.dht is None:
            return None
        return score_view(await published_verdicts(self.node, self.args.run_id), RatingRule())

    async def run_view(self) -> list[dict[str, Any]]:
        if self.node is None or self.node.dht is None:
            return []
        records = await read_run(self.node, self.metrics, self.history)
        return flag_manifests(records, self.args.manifest.hash if self.args.manifest else None)

    def status(self) -> dict[str, Any]:
        node = self.node
        live = node is not None and node.dht is not None
        return {
            "peer_id": node.peer_id if live and node else None,
            "run_id": self.args.run_id,
            "role": "bootstrap",
            "manifest_hash": self.args.manifest.hash if self.args.manifest else None,
            "maddrs": first_public_maddrs(node.visible_maddrs()) if live and node else [],
            "relays": list(self.relays),
            "peers_known": len(self._peers),
            "dht_records": self._dht_records,
            "outer_step": max((p["outer_step"] for p in self._peers), default=0),
            "uptime_seconds": time.time() - self.started,
            "version": __version__,
            "dataset": self.args.config.data.dataset if self.args.config is not None else None,
            # sha256 of the weights θ_global started from (--init-from); null: the seed's random init
            "init_weights": (self.args.config.model.init or None) if self.args.config is not None else None,
            "data_served": served_status(self.data_server),
            "data_schedule": self.dataset_progress(),
            # What it did as an auxiliary reducer (null with --no-reduce).
            "reducer": None
            if self.aux is None
            else {
                "rounds_reduced": self.aux.rounds_reduced,
                "bytes_sent": self.aux.bytes_sent,
                "bytes_received": self.aux.bytes_received,
            },
        }
