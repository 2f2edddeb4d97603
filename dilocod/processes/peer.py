"""The peer daemon: one asyncio loop owns the node; training runs in one worker thread.

Life cycle (`startup → main_loop → shutdown`):
- startup: resume from the run dir's checkpoint (if any), build the trainer, start the DHT and the
  averager (`netstart.py`), serve HTTP, start publishing our status record;
- main loop: catch up with the run if it is ahead of us, take the round's H inner steps in the worker
  thread (the loop keeps serving HTTP and the DHT meanwhile), average pseudo-gradients with whoever is
  ready (`rounds.py`), write a checkpoint; repeat;
- shutdown (SIGINT/SIGTERM): let the current inner step finish, write a checkpoint, leave the DHT.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dilocod.adversary import Adversary
from dilocod.bans import BanList
from dilocod.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from dilocod.codecs import FEEDBACK_CODECS, ErrorFeedback
from dilocod.config import Config
from dilocod.diloco import OuterOptimizer
from dilocod.helper import HELPERS_KEY
from dilocod.history import RunHistory
from dilocod.http import HttpServer
from dilocod.metrics import Metrics
from dilocod.netstart import NetworkStart
from dilocod.peerstate import PeerState
from dilocod.progress import show_progress
from dilocod.rounds import RoundKeeper, make_round_keeper
from dilocod.runtime import STOP_GRACE_SECONDS
from dilocod.runview import STATUS_KEY, read_run
from dilocod.trainer import InnerTrainer, LocalGroup, StepStats
from peers.group import GroupAverager
from peers.node import Node
from proto import encode_status

log = logging.getLogger("dilocod.daemon")


@dataclass(frozen=True)
class PeerArgs:
    """What the command line adds to the config: where to find the run and where to keep our files."""

    config: Config
    run_dir: Path
    initial_peers: tuple[str, ...]
    http_host: str = "127.0.0.1"
    http_port: int | None = None


class PeerDaemon(NetworkStart):
    def __init__(self, args: PeerArgs) -> None:
        self.args = args
        self.cfg = args.config
        self.metrics = Metrics()
        self.state = PeerState(run_id=self.cfg.run.id)
        # Read at every scrape, so it keeps moving while the peer averages or re-syncs.
        self.metrics.compute_utilization.set_function(self.state.compute_utilization)
        self.stopping = asyncio.Event()
        self.train_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer")
        self.trainer: InnerTrainer | None = None
        self.local_group: LocalGroup | None = None  # ranks 1..N-1 when the peer trains on N devices
        self.outer: OuterOptimizer | None = None
        self.feedback: ErrorFeedback | None = None  # error-feedback residual (int4/int2 compression)
        self.node: Node | None = None
        self.group: GroupAverager | None = None
        self.http: HttpServer | None = None
        self.bans = BanList(args.run_dir)
        self.state.bans = len(self.bans.active())
        self.state.banned = self.bans.peer_ids()
        self.adversary = Adversary(self.cfg.adversary, self.cfg.run.seed)
        if self.adversary.active:
            log.warning(
                "ADVERSARY MODE '%s': this peer attacks the run (for testing defenses)", self.adversary.mode
            )
        self.history = RunHistory()  # the run over time, for the dashboard (`/api/history`)
        self.rounds: RoundKeeper | None = None
        self._snapshot: tuple[bytes, list[torch.Tensor]] | None = None
        self._tasks: list[asyncio.Task[Any]] = []

    # ---- life cycle ----------------------------------------------------------------------------------
    async def run(self) -> int:
        try:
            await self.startup()
            await self.main_loop()
        finally:
            await self.shutdown()
        return 0

    async def startup(self) -> None:
        loop = asyncio.get_running_loop()
        checkpoint = await loop.run_in_executor(None, load_checkpoint, self.args.run_dir)
        await loop.run_in_executor(self.train_pool, self._build_trainer, checkpoint)
        await self._start_network()
        # After the network: hivemind forks its children from this process, and they need no copy of
        # the local group's sockets and threads.
        await loop.run_in_executor(self.train_pool, self._start_local_group)
        await self._start_http()
        assert self.trainer is not None and self.outer is not None and self.group is not None
        self.rounds = make_round_keeper(
            self.cfg,
            self.state,
            self.metrics,
            self.trainer,
            self.outer,
            self.group,
            self,
            self.bans,
            self.adversary,
            feedback=self.feedback,
        )
        self.rounds.share_state()
        self._tasks.append(asyncio.create_task(self._publish_status_forever()))
        self._tasks.append(asyncio.create_task(show_progress(self.state, self.cfg.trainer.inner_steps)))
        self.state.phase = "training"
        log.info(
            "peer %s joined run '%s' at outer step %d (inner step %d); listening on %s",
            self.state.peer_id, self.cfg.run.id, self.state.outer_step, self.state.inner_step,
            ", ".join(self.state.maddrs) or "(client mode)",
        )  # fmt: skip

    def _build_trainer(self, checkpoint: dict[str, Any] | None) -> None:
        """Runs in the trainer thread: torch work stays off the event loop."""
        cfg = self.cfg
        if cfg.trainer.threads > 0:
            torch.set_num_threads(cfg.trainer.threads)
        # The data order is tied to our persistent identity, so it survives restarts.
        trainer = InnerTrainer(cfg.model, cfg.data, cfg.trainer, seed=cfg.run.seed, peer_key=self._peer_key())
        outer = OuterOptimizer(trainer.working_params_fp32(), cfg.outer)
        if trainer.device.type == "cuda":
            outer.pin_memory()
        if checkpoint is not None:
            try:
                self._restore(checkpoint, trainer, outer)
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                path = self.args.run_dir / "checkpoint.pt"
                reason = str(e).split("\n")[0]
                raise CheckpointError(f"checkpoint {path} cannot be resumed: {reason}") from None
        self.feedback = self._make_feedback(outer, checkpoint)
        # Only now: a daemon that failed to restore must not overwrite the checkpoint at shutdown.
        self.trainer, self.outer = trainer, outer
        self._sync_state_counters()

    def _start_local_group(self) -> None:
        """Runs in the trainer thread: with N > 1 devices, start ranks 1..N-1 and give them our state."""
        assert self.trainer is not None
        if len(self.trainer.devices) > 1:
            self.local_group = LocalGroup(self.trainer)
            self.local_group.start()
            log.info(
                "training on %d local devices (%s); workers: pids %s",
                self.trainer.world_size,
                ", ".join(str(d) for d in self.trainer.devices),
                ", ".join(str(pid) for pid in self.local_group.pids),
            )
        self.state.devices = self.trainer.world_size

    def _restore(self, checkpoint: dict[str, Any], trainer: InnerTrainer, outer: OuterOptimizer) -> None:
        if checkpoint.get("run_id") != self.cfg.run.id or checkpoint.get("preset") != self.cfg.model.preset:
            raise ValueError(
                f"checkpoint in {self.args.run_dir} belongs to run '{checkpoint.get('run_id')}' "
                f"(preset {checkpoint.get('preset')}), not '{self.cfg.run.id}' ({self.cfg.model.preset}); "
                "use another --run-dir"
            )
        saved = checkpoint["outer"]
        outer.load_state(int(saved["step"]), [*saved["params"], *saved["momentum"]])
        trainer.load_state_dict(checkpoint["trainer"])
        counters = checkpoint.get("counters", {})
        self.state.round_steps = int(counters.get("round_steps", 0))
        self.state.rounds_ok = int(counters.get("rounds_ok", 0))
        self.state.rounds_failed = int(counters.get("rounds_failed", 0))
        self.state.resyncs = int(counters.get("resyncs", 0))
        log.info("resumed from checkpoint at outer step %d, inner step %d", outer.step, trainer.step)

    def _make_feedback(
        self, outer: OuterOptimizer, checkpoint: dict[str, Any] | None
    ) -> ErrorFeedback | None:
        """Error feedback for the coarse codecs; the residual resumes from the checkpoint when it fits."""
        if self.cfg.averaging.compression not in FEEDBACK_CODECS:
            return None
        feedback = ErrorFeedback([p.shape for p in outer.params])
        saved = (checkpoint or {}).get("error_feedback")
        if saved is not None:
            try:
                feedback.load_state_dict(saved)
            except ValueError as e:  # harmless: the residual only delays what the codec dropped
                log.warning("checkpoint's error-feedback residual not resumed (%s); starting from zero", e)
            if not math.isfinite(feedback.norm()):
                feedback.reset()
        return feedback

    async def _start_http(self) -> None:
        if self.args.http_port is None:
            return
        self.http = HttpServer(self.metrics, self.status, self.run_view, self.history)
        port = await self.http.start(self.args.http_host, self.args.http_port)
        log.info("http: http://%s:%d/api/status", self.args.http_host, port)

    async def main_loop(self) -> None:
        assert self.rounds is not None
        await self.rounds.catch_up()
        H = self.rounds.sync_every  # inner steps between syncs (H / fragments with streaming)
        while not self.stopping.is_set():
            if self.state.round_steps == 0 and self.state.outer_step > 0:
                await self.rounds.check_agreement()
            stats = await self.train(H - self.state.round_steps)
            if self.stopping.is_set():
                break
            if self.state.round_steps < H:
                continue
            await self._until_stopped(self.rounds.sync(stats), grace=STOP_GRACE_SECONDS)
            if not self.stopping.is_set() and self.rounds.checkpoint_due:
                await self.checkpoint()

    async def _until_stopped(self, work: Any, grace: float) -> None:
        """Await `work`; if a stop arrives first, give it `grace` seconds more, then cancel it."""
        task = asyncio.ensure_future(work)
        stop = asyncio.create_task(self.stopping.wait())
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not task.done():
            # Still matchmaking: leave at once. Exchanging tensors: finish serving our parts first.
            in_allreduce = self.group is not None and self.group.in_allreduce
            if in_allreduce:
                log.info("stopping after the all-reduce in progress (our parts; at most %.0fs)", grace)
            done, _ = await asyncio.wait({task}, timeout=grace if in_allreduce else 0.0)
            if not done:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return
        task.result()

    async def shutdown(self) -> None:
        self.state.phase = "stopping"
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.rounds is not None:  # delayed overlap: a round may still be averaging in the background
            await self.rounds.drain(STOP_GRACE_SECONDS)
        if self.trainer is not None and self.outer is not None:
            try:
                await self.checkpoint()
            except Exception as e:  # never lose the shutdown of the network to a full disk
                log.error("could not write the final checkpoint: %s", e)
        loop = asyncio.get_running_loop()
        if self.http is not None:
            await self.http.stop()
        if self.group is not None:
            await loop.run_in_executor(None, self.group.stop)
        if self.node is not None:
            await loop.run_in_executor(None, self.node.stop)
        if self.local_group is not None:
            await loop.run_in_executor(self.train_pool, self.local_group.stop)
        self.train_pool.shutdown(wait=True, cancel_futures=True)
        if self.node is not None:  # a daemon that never started says nothing more than its error
            log.info("stopped at outer step %d, inner step %d", self.state.outer_step, self.state.inner_step)

    # ---- training ------------------------------------------------------------------------------------
    async def train(self, steps: int) -> StepStats:
        """Take up to `steps` inner steps in the trainer thread; returns early when stopping."""
        assert self.trainer is not None
        self.state.phase = "training"
        loop = asyncio.get_running_loop()
        trainer = self.trainer
        stopping = self.stopping

        def _on_step(step: int, loss: float) -> None:
            loop.call_soon_threadsafe(self._count_step, step, loss)

        self.state.training_began(time.monotonic())  # compute utilization: time in inner steps
        try:
            stats = await loop.run_in_executor(
                self.train_pool,
                lambda: trainer.train_steps(steps, should_stop=stopping.is_set, on_step=_on_step),
            )
        finally:
            self.state.training_ended(time.monotonic())
        self.state.round_steps += stats.steps
        if stats.steps:
            self.state.tokens_per_second = stats.tokens / max(stats.seconds, 1e-9)
            self.metrics.tokens_per_second.set(self.state.tokens_per_second)
            self.state.mfu = trainer.mfu(self.state.tokens_per_second)
            self.metrics.mfu.set(math.nan if self.state.mfu is None else self.state.mfu)
            self.metrics.inner_step_seconds.observe(stats.seconds / stats.steps)
        return stats

    def _count_step(self, step: int, loss: float) -> None:
        assert self.trainer is not None
        self.state.inner_step = step
        self.metrics.inner_steps.inc()
        self.metrics.tokens.inc(self.trainer.tokens_per_step)
        if math.isfinite(loss):
            self.metrics.train_loss.set(loss)

    # ---- state ---------------------------------------------------------------------------------------
    def _sync_state_counters(self) -> None:
        assert self.trainer is not None and self.outer is not None
        self.state.outer_step = self.outer.step
        self.state.inner_step = self.trainer.step
        self.state.global_sha256 = self.outer.sha256
        self.metrics.outer_step.set(self.outer.step)

    def _current_state(self) -> tuple[bytes, list[torch.Tensor]]:
        """What a peer downloading our state gets (called from hivemind's thread; returns a snapshot)."""
        if self._snapshot is None:
            raise RuntimeError("no state to share yet")
        return self._snapshot

    def set_snapshot(self, snapshot: tuple[bytes, list[torch.Tensor]]) -> None:
        self._snapshot = snapshot

    async def checkpoint(self) -> None:
        assert self.trainer is not None and self.outer is not None
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        payload = await loop.run_in_executor(self.train_pool, self._checkpoint_payload)
        await loop.run_in_executor(None, save_checkpoint, self.args.run_dir, payload)
        self.metrics.checkpoint_seconds.observe(time.monotonic() - started)

    def _checkpoint_payload(self) -> dict[str, Any]:
        assert self.trainer is not None and self.outer is not None
        return {
            "run_id": self.cfg.run.id,
            "preset": self.cfg.model.preset,
            "outer": {
                "step": self.outer.step,
                "params": [p.clone() for p in self.outer.params],
                "momentum": [m.clone() for m in self.outer.momentum],
                "sha256": self.outer.sha256,
            },
            "trainer": self.trainer.state_dict(),
            "error_feedback": None if self.feedback is None else self.feedback.state_dict(),
            "counters": {
                "round_steps": self.state.round_steps,
                "rounds_ok": self.state.rounds_ok,
                "rounds_failed": self.state.rounds_failed,
                "resyncs": self.state.resyncs,
            },
        }

    # ---- observability -------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        status = self.state.status()
        if self.group is not None:  # the deadlines the next round will use (they follow recent rounds)
            status["in_allreduce"] = self.group.in_allreduce
            status["matchmaking_deadline"] = round(self.group.deadlines.matchmaking, 3)
            status["allreduce_deadline"] = round(self.group.deadlines.allreduce, 3)
        return status

    async def run_view(self) -> list[dict[str, Any]]:
        if self.node is None or self.node.dht is None:
            return []
        return await read_run(self.node, self.metrics, self.history)

    async def public_reducers(self) -> int:
        """Live nodes of the run that can reduce for a private peer: public peers and helpers."""
        if self.node is None or self.node.dht is None:
            return 0
        helpers = await read_run(self.node, key=HELPERS_KEY)
        peers = await self.run_view()
        public = [r for r in peers if r["reachability"] == "public" and r["peer_id"] != self.state.peer_id]
        return len(helpers) + len(public)

    async def publish_status(self) -> None:
        if self.node is None or self.node.dht is None:
            return
        ttl = max(3 * self.cfg.net.status_interval, 15.0)
        await self.node.publish(STATUS_KEY, encode_status(self.state.record()), ttl=ttl)

    async def _publish_status_forever(self) -> None:
        while True:
            try:
                await self.publish_status()
                others = [r for r in await self.run_view() if r["peer_id"] != self.state.peer_id]
                self.state.peers_known = sum(1 for r in others if r["role"] != "bootstrap")
                self.metrics.peers_known.set(self.state.peers_known)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the DHT being briefly unreachable must not stop the heartbeat
                log.debug("status publish failed: %r", e)
            await asyncio.sleep(self.cfg.net.status_interval)
