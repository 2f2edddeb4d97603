"""The peer daemon (`dilocod join`): one asyncio loop owns the node; training runs in one worker thread.

Life cycle (`startup → main_loop → shutdown`):
- startup: serve HTTP, take the run's dataset, start the DHT and the averager (`netstart.py`; before
  any tensor exists, so that their forks share none), resume from the run dir's checkpoint (if any),
  build the trainer, wire the round driver (`dilocod/rounds/`) to the parts it
  needs, start the status heartbeat;
- main loop: the round driver: get in step with the run, train until the run's clock closes each round,
  average, apply, re-sync when the run went on without us;
- shutdown (SIGINT/SIGTERM): let the current inner step finish (and a running all-reduce serve our
  parts), write a checkpoint, leave the DHT.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dilocod.config import Config
from dilocod.manifest.book import ManifestBook
from dilocod.manifest.record import Manifest
from dilocod.node.autodeadlines import resolve_deadlines
from dilocod.node.averaging import PeerAveraging
from dilocod.node.coreshare import CoreShare, machine_share
from dilocod.node.datafeed import DataFeed
from dilocod.node.dataset import fetch_dataset, local_dataset, serve_dataset, served_status
from dilocod.node.initweights import ensure_init, served_init
from dilocod.node.judge import Judge
from dilocod.node.netstart import Network, peer_key, start_network
from dilocod.node.publishing import CheckpointWriter, StatusPublisher
from dilocod.node.resume import Resumed, build_trainer, checkpoint_payload
from dilocod.node.roundconfig import (
    clock_settings,
    machine_settings,
    pipeline_settings,
    reference_tokens,
    round_settings,
    sync_settings,
)
from dilocod.node.scorer import ContributionScoring
from dilocod.node.training import TrainerThread
from dilocod.observability.history import RunHistory
from dilocod.observability.http import HttpServer
from dilocod.observability.metrics import Metrics
from dilocod.observability.peerstate import InnerProgress, NodeFacts, PeerState, Phase, RoundProgress
from dilocod.observability.progress import show_progress
from dilocod.observability.runview import NodeRunView, flag_manifests, newest_sample, read_run
from dilocod.rounds.core import RoundCore
from dilocod.rounds.driver import RoundDriver
from dilocod.rounds.pipeline import RoundPipeline
from dilocod.rounds.ports import Parts
from dilocod.statesync.catchup import StateSync, SyncPorts
from dilocod.statesync.checkpoint import check_checkpoint, open_checkpoint
from dilocod.statesync.parts import PartsSource
from dilocod.trainer import LocalGroup
from dilocod.trainer.lm import parameter_template
from dilocod.trainer.sampling import run_sampler
from dilocod.trust.adversary import tampering_for
from dilocod.trust.bans import BanList
from peers import heap
from peers.datashare import DataServer
from peers.linkbudget import MBIT
from peers.state.download import PartsDownload
from peers.state.share import StateServer

log = logging.getLogger("dilocod.daemon")


@dataclass(frozen=True)
class PeerArgs:
    """What the command line adds to the config: where to find the run and where to keep our files."""

    config: Config  # the run manifest's run-wide settings, this machine's local ones
    manifest: Manifest
    run_dir: Path
    initial_peers: tuple[str, ...]
    http_host: str = "127.0.0.1"
    http_port: int | None = None


class PeerDaemon:
    def __init__(self, args: PeerArgs) -> None:
        self.args, self.cfg = args, args.config
        self.metrics = Metrics()
        self.bans = BanList(args.run_dir)
        # Put together here; each part has one writer (the parts' table in observability/peerstate.py):
        # ours are `facts` and which parts the state holds (the trainer's and the rounds' once resumed).
        self.state = PeerState(
            NodeFacts(run_id=self.cfg.run.id, manifest_hash=args.manifest.hash), banned_now=self.bans.peer_ids
        )
        self.manifests: ManifestBook | None = None
        # Read at every scrape, so it keeps moving while the peer averages or re-syncs.
        self.metrics.compute_utilization.set_function(self.state.compute_utilization)
        self.stopping = asyncio.Event()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer")
        # An adversary mode (tests of the defences) reaches the daemon only through these hooks.
        self.tampering = tampering_for(self.cfg.adversary, self.cfg.run.seed)
        if self.tampering.active:
            log.warning(
                "ADVERSARY MODE '%s': this peer attacks the run (for testing defenses)",
                self.cfg.adversary.mode,
            )
        self.history = RunHistory()  # the run over time, for the dashboard (`/api/history`)
        self.resumed: Resumed | None = None
        self.network: Network | None = None
        self.sync: StateSync | None = None
        self.driver: RoundDriver | None = None
        self.checkpoints: CheckpointWriter | None = None
        self.local_group: LocalGroup | None = None  # ranks 1..N-1 when the peer trains on N devices
        self.http: HttpServer | None = None
        self.data_server: DataServer | None = None
        self.state_server: StateServer | None = None
        # Our batches from the run's chunk schedule, and the training shards they need.
        self.feed = DataFeed(
            args.run_dir, args.initial_peers, self.state, self.metrics, self.bans.ban, self.stopping,
            fetching=self._fetching_data,
        )  # fmt: skip
        self._tasks: list[asyncio.Task[Any]] = []
        self.scoring: ContributionScoring | None = None  # with `scoring.enabled`
        self.cores: CoreShare | None = None  # our claim among the machine's CPU trainers (not on a GPU)

    # ---- life cycle ----------------------------------------------------------------------------------------
    async def run(self) -> int:
        try:
            await self.startup()
            await self.driver.run(self.stopping)  # type: ignore[union-attr]
        finally:
            await self.shutdown()
        return 0

    async def startup(self) -> None:
        loop = asyncio.get_running_loop()
        await self._start_http()  # first: /api/status shows a dataset download (`data_fetch`)
        self.cfg = await self._dataset()
        # A checkpoint this dilocod must not use stops us before anything starts (one line, no network).
        await loop.run_in_executor(None, check_checkpoint, self.args.run_dir)
        self.cfg, link = resolve_deadlines(self.cfg)  # auto (0) deadlines from the model and our link
        # The network before any tensor: hivemind forks its DHT and averager processes from this one, and
        # a fork keeps every page we hold at that moment. Forked after the model and the checkpoint were
        # read, each child kept a private copy of every page we later wrote or freed (copy-on-write): the
        # working copy, θ_global, the momentum, ~8-12 bytes a parameter each. The averager needs only shapes.
        template = parameter_template(self.cfg.model)
        self.network = await start_network(
            self.cfg, self.args.run_dir, self.args.initial_peers, template, self._serve_state,
            self.stopping, run_tag=self.args.manifest.hash, link=link,
            tampering=self.tampering,
        )  # fmt: skip
        opened = await loop.run_in_executor(None, open_checkpoint, self.args.run_dir)
        for note in opened.notes:  # a killed write or a damaged file: said once, then we go on
            log.warning("%s", note)
        checkpoint = opened.state
        if checkpoint is None:  # θ at step 0 may be the run's starting weights: this node needs a copy
            self.cfg = await ensure_init(
                self.cfg, self.args.run_dir, self.args.initial_peers, self._client_host(), self.metrics
            )
        key = peer_key(self.args.run_dir)  # the data order is tied to our persistent identity
        partial = self.feed.partial_copy(self.cfg)
        # After the network's forks (they would inherit our registry file's lock), before the trainer.
        self.cores = machine_share(self.cfg.trainer)
        threads = self.cores.threads() if self.cores is not None and self.cores.takes_a_share else 0
        build = functools.partial(
            build_trainer, self.cfg, key, checkpoint, self.args.run_dir, partial=partial,
            threads=threads,
        )  # fmt: skip
        del checkpoint, opened  # once restored, the checkpoint's tensors are garbage
        resumed = await loop.run_in_executor(self.pool, build)
        del build
        if [tuple(p.shape) for p in resumed.outer.params] != [tuple(t.shape) for t in template]:
            raise RuntimeError("the model's parameters do not have the shapes the averager was started with")
        self.resumed = resumed
        self._show_resumed(resumed)
        window_map = self.tampering.training_windows(self.cfg.trainer.seq_len)
        if window_map is not None:
            resumed.trainer.window_map = window_map
        self.manifests = ManifestBook(self.network.node, self.args.manifest)
        if not self.network.client:  # a newcomer given our address takes the run's manifest from us
            await self.network.node.serve_manifest(self.manifests.blob)
        # After the network: hivemind forks its children from this process, and they need no copy of the
        # local group's sockets and threads.
        await loop.run_in_executor(self.pool, self._start_local_group)
        self._describe_network(self.network)
        self.driver = self._wire(resumed, self.network, await self._parts_source(resumed, self.network))
        if not self.network.client:  # a private peer accepts no connections: it cannot serve
            self.state_server = await self.network.node.serve_state(self._state_or_none)
        if not self.network.client:  # a private peer accepts no connections: it cannot serve
            init = await asyncio.to_thread(served_init, self.cfg)  # ours to serve once verified
            self.data_server = await serve_dataset(self.network.node, self.cfg, self.metrics, init)
        if self.scoring is not None:
            await self.scoring.start()
        self._tasks += await self.feed.start(self.cfg, resumed, self.network)
        self._tasks.append(asyncio.create_task(self._publisher.heartbeat()))
        assert self.manifests is not None
        self._tasks.append(asyncio.create_task(self.manifests.keep_published(self.stopping)))
        self._tasks.append(asyncio.create_task(show_progress(self.state, self.cfg.trainer.inner_steps)))
        self.state.facts.life = Phase.TRAINING
        log.info(
            "peer %s joined run '%s' at outer step %d (inner step %d, θ %s); listening on %s",
            self.state.peer_id, self.cfg.run.id, self.state.rounds.outer_step, self.state.inner.inner_step,
            self.state.rounds.global_sha256[:12], ", ".join(self.state.facts.maddrs) or "(client mode)",
        )  # fmt: skip

    def _show_resumed(self, resumed: Resumed) -> None:
        """The state now holds the parts of what was resumed: the trainer's inner progress, the rounds'
        progress (the checkpoint's counters) and the token ledger; their components write them from here."""
        self.state.facts.eval_tokens_per_byte = resumed.trainer.corpus.eval_tokens_per_byte
        self.state.inner = InnerProgress(inner_step=resumed.trainer.step, threads=resumed.threads)
        counters = resumed.counters
        self.state.rounds = RoundProgress(
            outer_step=resumed.outer.step, global_sha256=resumed.outer.sha256,
            rounds_ok=counters.get("rounds_ok", 0), rounds_failed=counters.get("rounds_failed", 0),
            resyncs=counters.get("resyncs", 0),
        )  # fmt: skip
        self.state.tokens = resumed.tokens

    def _fetching_data(self) -> None:
        self.state.facts.life = Phase.FETCHING_DATA

    async def _dataset(self) -> Config:
        """Our config pointing at a verified copy of the run's dataset: on this machine, or fetched from the
        peers we were given (a node that started the run prepares it from `data.source`)."""
        args = self.args
        found = await local_dataset(self.cfg, args.run_dir, may_prepare=not args.initial_peers)
        if found is not None:
            return found
        self._fetching_data()
        cfg = await fetch_dataset(
            self.cfg,
            args.run_dir,
            args.initial_peers,
            self._client_host(),
            self.state.dataset,
            self.metrics,
            self.bans.ban,
            train=False,  # the training shards come as our chunks need them (`datafeed.py`)
        )
        return cfg

    def _client_host(self) -> str:
        return "::1" if ":" in self.cfg.net.host else "127.0.0.1"  # the short-lived client only dials out

    async def _parts_source(self, resumed: Resumed, network: Network) -> PartsSource:
        """Our state downloads in parts from several donors at once (peers/state/download.py)."""
        download = PartsDownload(
            await network.node.state_client(),
            max_bytes=3 * 4 * resumed.outer.num_elements,  # θ_global, momentum, a round in flight (fp32)
        )

        def on_status(progress: dict[str, Any]) -> None:
            self.state.facts.state_fetch = {**(self.state.facts.state_fetch or {}), **progress}

        return PartsSource(download, on_status)

    def _wire(
        self, resumed: Resumed, network: Network, parts_source: PartsSource | None = None
    ) -> RoundDriver:
        """Hand every part of the round protocol what it needs (and nothing of the daemon)."""
        cfg, outer, trainer = self.cfg, resumed.outer, resumed.trainer
        training = TrainerThread(trainer, self.pool, self.state.inner, self.metrics, self.stopping)
        if self.cores is not None and self.cores.takes_a_share:
            training.threads = self.cores.threads
        training.tokens = resumed.tokens
        judge = Judge(
            self.bans, self.state, self.metrics, network.group.set_banned, cfg.averaging.ban_seconds
        )
        pipeline = RoundPipeline(
            pipeline_settings(cfg, network.client), trainer, outer, resumed.feedback, self.tampering,
            cfg.averaging.wire_codec(), release=heap.trim,
        )  # fmt: skip
        view = NodeRunView(network.node, excluded=self.bans.peer_ids, manifests=self.manifests)
        ports = SyncPorts(
            in_trainer=training.run, records=self._other_records(view), punish=judge.punish,
            banned=self.bans.peer_ids, on_adopted=pipeline.adopted, count_bytes=self._count_download,
        )  # fmt: skip
        self.sync = StateSync(
            sync_settings(cfg), outer, trainer, network.group, self.tampering, ports, parts_source
        )
        self.sync.share()
        self.checkpoints = CheckpointWriter(
            self.args.run_dir,
            lambda: checkpoint_payload(cfg, resumed, self.state.rounds),
            training.run,
            self.metrics,
            every=cfg.checkpoint.every,
        )
        training.guard = self.checkpoints.guard  # the write reads θ_global live: its changes wait for it
        self._publisher = StatusPublisher(
            network.node, self.state, self.metrics, self.history, cfg.net.status_interval, self.checkpoints
        )
        sampler = run_sampler(cfg.data.path, trainer.model.shape.vocab_size, cfg.trainer.sample_prompt,
                              cfg.trainer.sample_tokens)  # fmt: skip
        self.scoring = (
            ContributionScoring(
                cfg,
                network.node,
                self.state,
                self.metrics,
                trainer.model,
                trainer.train_source,
                trainer.train_tokens,
                judge.punish,
                serve=not network.client,
            )  # fmt: skip
            if cfg.scoring.enabled
            else None
        )
        parts = Parts(
            training, PeerAveraging(network.group, judge), self.sync, view, self._publisher,
            sample=None if sampler is None else lambda: sampler(trainer.model), scoring=self.scoring,
        )  # fmt: skip
        fragments = pipeline.fragment_count
        self.state.facts.reference_tokens = reference_tokens(cfg)
        core = RoundCore(round_settings(cfg), self.state, self.metrics, outer, pipeline, resumed.tokens)
        driver = RoundDriver(
            core, parts, machine_settings(cfg, network.client, fragments), clock_settings(cfg, fragments),
            self.bans, self.tampering,
        )  # fmt: skip
        training.on_step = lambda: setattr(driver.timer, "seconds_per_step", training.seconds_per_step)
        return driver

    def _other_records(self, view: NodeRunView) -> Any:
        async def others() -> list[dict[str, Any]]:
            records = await view.records()
            # State comes only from peers of our manifest (another's θ_global is another run's model).
            return [
                r
                for r in records
                if r["peer_id"] != self.state.peer_id
                and r["role"] == "peer"
                and r.get("manifest_hash") == self.state.facts.manifest_hash
            ]

        return others

    def _count_download(self, sent: int, received: int) -> None:
        self.state.facts.download_bytes_sent += sent
        self.state.facts.download_bytes_received += received
        self.metrics.bytes_sent.inc(sent)
        self.metrics.bytes_received.inc(received)

    def _serve_state(self) -> tuple[bytes, list[Any]]:
        """What a peer downloading our state gets (called from hivemind's thread)."""
        if self.sync is None:
            raise RuntimeError("no state to share yet")
        return self.sync.current()

    def _state_or_none(self) -> tuple[bytes, list[Any]] | None:
        """What a peer downloading our state in parts gets (peers/state/share.py); None before we have one."""
        if self.state_server is not None:
            self.state.facts.state_served = self.state_server.status()
        return None if self.sync is None or self.sync.snapshot is None else self.sync.current()

    def _describe_network(self, network: Network) -> None:
        facts = self.state.facts
        facts.peer_id = network.node.peer_id
        facts.maddrs = network.node.visible_maddrs(latest=True)
        facts.reachability = network.reachability
        facts.relayed = network.relayed
        network.group.set_banned(self.bans.peer_ids())

    def _start_local_group(self) -> None:
        """Runs in the trainer thread: with N > 1 devices, start ranks 1..N-1 and give them our state."""
        assert self.resumed is not None
        trainer = self.resumed.trainer
        if len(trainer.devices) > 1:
            self.local_group = LocalGroup(trainer)
            self.local_group.start()
            log.info(
                "training on %d local devices (%s); workers: pids %s",
                trainer.world_size,
                ", ".join(str(d) for d in trainer.devices),
                ", ".join(str(pid) for pid in self.local_group.pids),
            )
        self.state.facts.devices = trainer.world_size

    async def _start_http(self) -> None:
        if self.args.http_port is None:
            return
        self.http = HttpServer(
            self.metrics, self.status, self.run_view, self.history, manifest=self.args.manifest.to_json,
            dataset=self.dataset_progress, sample=self.sample, scoring=self.scoring_view,
        )  # fmt: skip
        port = await self.http.start(self.args.http_host, self.args.http_port)
        log.info("http: http://%s:%d/api/status", self.args.http_host, port)

    async def shutdown(self) -> None:
        self.state.facts.life = Phase.STOPPING
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.scoring is not None:
            await self.scoring.stop()
        await self._final_checkpoint()
        loop = asyncio.get_running_loop()
        if self.http is not None:
            await self.http.stop()
        if self.data_server is not None:  # its HTTP listener; the p2p side goes with the node
            await self.data_server.stop()
        if self.network is not None:
            await loop.run_in_executor(None, self.network.group.stop)
            await loop.run_in_executor(None, self.network.node.stop)
        if self.local_group is not None:
            await loop.run_in_executor(self.pool, self.local_group.stop)
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.cores is not None:
            self.cores.close()
        if self.resumed is not None:  # a daemon that never started says nothing more than its error
            log.info(
                "stopped at outer step %d, inner step %d",
                self.state.rounds.outer_step,
                self.state.inner.inner_step,
            )

    async def _final_checkpoint(self) -> None:
        if self.resumed is None:  # never restored: never overwrite the checkpoint we could not read
            return
        writer = self.checkpoints or CheckpointWriter(
            self.args.run_dir,
            lambda: checkpoint_payload(self.cfg, self.resumed, self.state.rounds),  # type: ignore[arg-type]
            lambda fn: asyncio.get_running_loop().run_in_executor(self.pool, fn),
            self.metrics,
        )
        try:
            await writer.checkpoint(force=True)  # the last one, whether due or not
            await writer.flush()
        except Exception as e:  # never lose the shutdown of the network to a full disk
            log.error("could not write the final checkpoint: %s", e)

    # ---- observability -------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        status = self.state.status()
        status["data_served"] = served_status(self.data_server)
        status["data_schedule"] = self.feed.status(self.resumed)
        if self.scoring is not None:
            status["scoring"] = self.scoring.status()
            reason = self.scoring.gate_reason()
            if reason is not None:  # rated below the gate: the most specific reason our work does not count
                status["contributing"], status["not_contributing_reason"] = False, reason
        if self.network is not None:  # the deadlines the next round will use (they follow recent rounds)
            group = self.network.group
            status["in_allreduce"] = group.in_allreduce
            status["matchmaking_deadline"] = round(group.matchmaking_deadline, 3)
            status["allreduce_deadline"] = round(group.deadlines.allreduce, 3)
            # the link the auto deadlines assume: measured from completed transfers, else the prior
            status["link_mbit"] = round(group.link.rate / MBIT, 2)
            status["link_measured"] = group.link.measured
        return status

    def dataset_progress(self) -> dict[str, Any] | None:
        return self.feed.progress()

    def sample(self, records: list[dict[str, Any]]) -> dict[str, Any] | None:
        ours = [r for r in records if not r.get("other_manifest")]
        return newest_sample(ours, self.cfg.trainer.sample_prompt)

    async def scoring_view(self) -> dict[str, Any] | None:
        return self.scoring.run_view() if self.scoring is not None else None

    async def run_view(self) -> list[dict[str, Any]]:
        if self.network is None or self.network.node.dht is None:
            return []
        records = await read_run(self.network.node, self.metrics, self.history)
        return flag_manifests(records, self.args.manifest.hash)
