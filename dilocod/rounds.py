"""One outer round, and when to get back in step with the run (how: `dilocod/catchup.py`).

The rules, which keep every group member's θ_global bit-identical:
- a pseudo-gradient is only averaged with peers at the same outer step holding the same θ_global
  (the group's tickets decide who counts, see `peers/averager.py`);
- a complete, agreed average is applied by everyone with the same code: same bytes in, same bytes out;
- a peer whose round failed, or that found itself in the minority, or that finds the run ahead of it,
  downloads θ_global and the outer momentum from a
  peer (verified against its hash) before it contributes again; with `outer.rebase_on_resync` its inner
  progress not yet averaged is kept on top of the new θ_global unless it was far behind;
- a peer that found no group keeps its inner progress and tries again after H more steps, unless no
  other peer of the run is alive: then it is alone and applies its own pseudo-gradient.

With error feedback (int4/int2 compression) a peer sends Δ + e, where e is what the codec dropped from its
earlier contributions, and after an applied round keeps e ← (Δ + e) − decode(encode(Δ + e)). Encoding
tensor by tensor here gives exactly what the all-reduce sent part by part (parts start on block
boundaries, see `peers/allreduce.py`). A round that was not applied leaves e as it was (the next Δ is
measured from the same θ_global and includes this one); applying alone pays e back in full (e ← 0);
adopting another peer's θ_global forgets it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from dilocod.adversary import Adversary
from dilocod.bans import BanList
from dilocod.catchup import CatchUp
from dilocod.codecs import CodecError, ErrorFeedback, roundtrip
from dilocod.config import Config
from dilocod.diloco import OuterOptimizer
from dilocod.metrics import Metrics
from dilocod.peerstate import PeerState, RoundRecord
from dilocod.stepback import Previous, StepBack
from dilocod.trainer import InnerTrainer, StepStats
from peers.group import GroupAverager, RoundOutcome, incomplete_reason
from proto import encode_ticket

if TYPE_CHECKING:
    from dilocod.daemon import PeerDaemon

log = logging.getLogger("dilocod.rounds")

# Matchmaking timeouts without seeing any other peer before a peer that saw some applies alone.
ALONE_AFTER_TIMEOUTS = 4


class RoundKeeper(CatchUp, StepBack):
    def __init__(
        self,
        cfg: Config,
        state: PeerState,
        metrics: Metrics,
        trainer: InnerTrainer,
        outer: OuterOptimizer,
        group: GroupAverager,
        daemon: PeerDaemon,
        bans: BanList,
        adversary: Adversary,
        *,
        feedback: ErrorFeedback | None = None,
    ) -> None:
        self.cfg, self.state, self.metrics = cfg, state, metrics
        self.trainer, self.outer, self.group, self.daemon = trainer, outer, group, daemon
        self.bans, self.adversary = bans, adversary
        self.feedback = feedback  # touched in the trainer thread only (checkpoints read it there)
        self.codec = cfg.averaging.wire_codec()
        self._round_bytes = (0, 0)  # payload bytes of the round being recorded
        # delayed overlap: the round averaging in the background (raw progress, what we sent, its task),
        # where the working copy started this round (None: θ_global), and the progress to keep on top of
        # θ_global when a late outer step lands
        self._inflight: tuple[list[torch.Tensor], list[torch.Tensor], asyncio.Task[RoundOutcome]] | None = (
            None
        )
        self._start: list[torch.Tensor] | None = None
        self._carry: list[torch.Tensor] | None = None
        self._seen_hashes: dict[int, dict[str, str]] = {}  # what peers reported per step (catchup.py)
        self._previous: Previous | None = None  # θ_global before our last outer step (stepback.py)
        self._others_seen_at = -math.inf
        self._stranded = 0

    # ---- one round -----------------------------------------------------------------------------------
    @property
    def sync_every(self) -> int:
        """Inner steps between two calls of `sync`: H (a fraction of it with streaming)."""
        return self.cfg.trainer.inner_steps

    @property
    def serves_no_state(self) -> bool:
        """A client (behind NAT, no relay): nobody can download θ_global from us."""
        return self.group.options.mode == "client"

    @property
    def checkpoint_due(self) -> bool:
        """Whether the daemon writes a checkpoint after this `sync`."""
        return True

    async def sync(self, stats: StepStats) -> None:
        """End of H inner steps: average this round's pseudo-gradient with a group, apply the outer step."""
        self.state.loss = stats.mean_loss if stats.steps else self.state.loss
        if self.cfg.outer.overlap == "delayed":
            await self._sync_delayed()
            return
        self.state.phase = "averaging"
        local = await self._in_trainer(self.trainer.working_params_fp32)
        raw = self.outer.pseudo_gradient(local)
        delta, task = await self._send(raw)
        await self._settle(await task, delta)

    async def _send(self, raw: list[torch.Tensor]) -> tuple[list[torch.Tensor], asyncio.Task[RoundOutcome]]:
        """Start averaging `raw` (+ the error-feedback residual) at our outer step; returns what we sent
        honestly (Δ + e) and the round's task."""
        delta = raw
        if self.feedback is not None:  # Δ + e: what the codec dropped before is sent again
            delta = await self._in_trainer(functools.partial(self.feedback.compensate, raw))
        sent = self.adversary.corrupt_delta(delta) if self.adversary.active else delta
        return delta, asyncio.create_task(self.group.average(self.outer.step, self._ticket(), sent))

    def _ticket(self) -> bytes:
        return encode_ticket(
            {
                "outer_step": self.outer.step,
                "global_sha256": self.outer.sha256,
                "num_params": self.outer.num_elements,
                "role": "peer",
                "bans": self.bans.peer_ids()[-32:],
            }
        )

    async def _settle(self, outcome: RoundOutcome, delta: list[torch.Tensor]) -> str:
        """Act on a round's outcome: "applied" (a new θ_global), "adopted" (re-synced from a peer: our
        progress is rebased onto it, or gone) or "kept" (nothing changed: our progress waits for the next round)."""
        self._count_bytes(outcome.bytes_sent, outcome.bytes_received)
        self._round_bytes = (outcome.bytes_sent, outcome.bytes_received)
        await self._judge(outcome)
        self.state.last_round_seconds = outcome.seconds
        self.metrics.round_seconds.observe(outcome.seconds)
        if outcome.found_group:
            self._stranded = 0
        if outcome.averaged is not None and outcome.contributors > 1:
            # group_size counts the trainers that averaged; auxiliary reducers are not part of it.
            await self._apply(outcome.averaged, "ok", outcome.contributors, outcome.seconds, sent=delta)
            return "applied"
        if outcome.averaged is not None:
            # Only an auxiliary reducer met us. Applying our own Δ would move us to the next outer step on
            # our own and fork the run while other peers train at this one: decide as if no group formed.
            return await self._no_group(delta, outcome.seconds)
        if outcome.found_group and not outcome.in_majority and outcome.error is None:
            log.warning("our θ_global is not the group's at outer step %d: re-syncing", self.outer.step)
            self._count_failure("diverged", outcome.group_size, outcome.seconds)
            return await self._catch_up_or_retry(force=True)
        if outcome.found_group:
            log.warning(
                "round %d failed (%s); checking whether the run moved on",
                self.outer.step, outcome.error or incomplete_reason(outcome.reducer_errors),
            )  # fmt: skip
            self._count_failure("failed", outcome.group_size, outcome.seconds)
            return await self._catch_up_or_retry()
        return await self._no_group(delta, outcome.seconds)

    # ---- delayed overlap ---------------------------------------------------------------------------------
    # The working copy always equals θ_global − (progress not yet in θ_global): the progress of the round
    # being averaged in the background plus that of the round being trained. When round k's average lands
    # (at the end of round k + 1), θ_global takes its outer step and the working copy becomes
    # θ_global − (round k + 1's progress), which is then sent. θ_global only ever changes by agreed
    # averages, so it stays bit-identical across the group exactly as without overlap.
    async def _sync_delayed(self) -> None:
        local = await self._in_trainer(self.trainer.working_params_fp32)
        start = self._start if self._start is not None else self.outer.params
        progress = [s - t for s, t in zip(start, local)]  # this round's inner steps only
        if self._inflight is not None:
            pending, delta, task = self._inflight
            self._inflight = None
            if not task.done():
                self.state.phase = "averaging"  # the network is slower than H inner steps: wait for it
            self._carry = progress
            try:
                settled = await self._settle(await task, delta)
            finally:
                self._carry = None
            if settled == "adopted":  # progress is now measured from the downloaded θ_global
                self._start = None
                return
            if settled == "kept":  # the last round's progress was not applied: send it again with ours
                progress = [p + c for p, c in zip(pending, progress)]
        delta, task = await self._send(progress)
        self._inflight = (progress, delta, task)
        self.state.round_steps = 0
        self._start = await self._in_trainer(self.trainer.working_params_fp32)

    async def drain(self, grace: float) -> None:
        """At shutdown: let a background all-reduce that is exchanging tensors finish serving our parts
        (others would be left with partial means), for at most `grace` seconds; then drop it."""
        if self._inflight is None:
            return
        task = self._inflight[2]
        self._inflight = None
        if not task.done() and self.group.in_allreduce:
            await asyncio.wait({task}, timeout=grace)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    def _count_bytes(self, sent: int, received: int) -> None:
        self.state.bytes_sent += sent
        self.state.bytes_received += received
        self.metrics.bytes_sent.inc(sent)
        self.metrics.bytes_received.inc(received)

    async def _judge(self, outcome: RoundOutcome) -> None:
        """Count and ban the peers this round caught: screened senders and implausible reducers."""
        caught = [
            (p, "its contribution was screened out (non-finite or far too large)") for p in outcome.faulty
        ]
        caught += [(p, "as a reducer it returned an implausible average") for p in outcome.rejected_reducers]
        await self._punish(caught)

    async def _punish(self, caught: list[tuple[str, str]]) -> None:
        caught = [(peer, reason) for peer, reason in caught if peer != self.state.peer_id]
        if not caught:
            return
        self.state.rejected_contributions += len(caught)
        self.metrics.rejected_contributions.inc(len(caught))
        changed = False
        for peer, reason in caught:
            if self.bans.ban(peer, reason, self.cfg.averaging.ban_seconds):
                self.metrics.bans.inc()
                changed = True
        self.state.bans = len(self.bans.active())
        self.state.banned = self.bans.peer_ids()
        if changed:
            await asyncio.get_running_loop().run_in_executor(
                None, self.group.set_banned, self.bans.peer_ids()
            )

    async def check_agreement(self) -> None:
        """After a round, peers publish their step and θ hash: re-sync if the run went on without us, or if
        most peers at our step hold another θ_global."""
        if self._inflight is not None:  # delayed overlap: a round is under way; its tickets check θ
            return
        others = await self._other_peers()
        # Groups that form apart (a group of 2 here, another there) fork the run, and being keyed by step
        # they would never meet again: the side behind gives way. (Forks at the same step meet in the next
        # round's matchmaking, where the tickets give the minority weight 0 and send it to re-sync.)
        ahead = [r for r in others if r["outer_step"] > self.outer.step]
        if ahead:
            log.warning(
                "%d peers are ahead (outer step %d > %d): re-syncing",
                len(ahead), max(r["outer_step"] for r in ahead), self.outer.step,
            )  # fmt: skip
            await self.catch_up()
            return
        same_step = [r["global_sha256"] for r in others if r["outer_step"] == self.outer.step]
        counts = Counter([*same_step, self.outer.sha256])
        top, votes = counts.most_common(1)[0]
        if top != self.outer.sha256 and votes > counts[self.outer.sha256]:
            log.warning(
                "%d peers at outer step %d hold another θ_global: re-syncing", counts[top], self.outer.step
            )
            await self.catch_up(force=True)

    async def _no_group(self, delta: list[torch.Tensor], seconds: float) -> str:
        if self.state.reachability == "private" and await self.daemon.public_reducers() == 0:
            log.warning(
                "no public reducer in run '%s': a peer behind NAT can only average through a public peer or "
                "a reducing bootstrap/helper (run `dilocod bootstrap` without --no-reduce)",
                self.cfg.run.id,
            )
        others = await self._other_peers()
        if any(r["outer_step"] > self.outer.step for r in others):
            self._count_failure("no_group", 0, seconds)
            return await self._catch_up_or_retry()
        if others:
            self._count_failure("no_group", 0, seconds)
            if await self._maybe_step_back(others):  # they can only meet us at the step they are at
                return "adopted"
            # Others exist at our step but did not meet us in time: keep our progress, retry in H steps.
            log.info(
                "no group at outer step %d; %d peers known, retrying after the next round",
                self.outer.step,
                len(others),
            )
            self.state.round_steps = 0
            return "kept"
        unseen = time.monotonic() - self._others_seen_at
        if unseen < ALONE_AFTER_TIMEOUTS * self.cfg.averaging.matchmaking_timeout:
            # We saw peers a moment ago: more likely our link or the DHT hiccups than the whole run left.
            # Applying alone now would fork the run from them; keep our progress and look again.
            log.warning(
                "no group and no peer visible at outer step %d (one seen %.0fs ago): keeping our progress",
                self.outer.step, unseen,
            )  # fmt: skip
            self._count_failure("no_group", 0, seconds)
            self.state.round_steps = 0
            return "kept"
        log.info("alone in the run: applying our own pseudo-gradient (outer step %d)", self.outer.step + 1)
        await self._apply(delta, "alone", 1, seconds, sent=None)
        return "applied"

    async def _catch_up_or_retry(self, *, force: bool = False) -> str:
        """Re-sync if we can; otherwise keep our inner progress and try the next round after H more steps."""
        if await self.catch_up(force=force):
            return "adopted"
        self.state.round_steps = 0
        return "kept"

    async def _apply(
        self,
        averaged: list[torch.Tensor],
        result: str,
        group_size: int,
        seconds: float,
        *,
        sent: list[torch.Tensor] | None,
    ) -> None:
        """Apply an outer step; `sent` is our contribution when it crossed the wire (None: applied alone)."""
        await self._in_trainer(lambda: self._apply_in_trainer(averaged, sent))
        self.state.alone = result == "alone"
        self.state.group_size = group_size
        self.state.rounds_ok += 1
        self.metrics.rounds.labels(result=result).inc()
        self.metrics.group_size.set(group_size)
        self._after_new_global()
        evaluated = None
        if self.outer.step % self.cfg.trainer.eval_every == 0:
            evaluated = self.state.eval_loss = await self._in_trainer(self.trainer.evaluate)
            self.metrics.eval_loss.set(evaluated)
        self._record(result, group_size, seconds, evaluated)
        log.info(
            "outer step %d: %s, group of %d, loss %.4f, eval %s, %.0f tokens/s, round %.1fs, θ %s",
            self.outer.step, result, group_size, self.state.loss,
            "–" if self.state.eval_loss is None else f"{self.state.eval_loss:.4f}",
            self.state.tokens_per_second, seconds, self.outer.sha256[:12],
        )  # fmt: skip
        await self.daemon.publish_status()

    def _apply_in_trainer(self, averaged: list[torch.Tensor], sent: list[torch.Tensor] | None) -> None:
        self._keep_previous()
        self.outer.apply(averaged)
        if self._carry is None:
            self.trainer.load_params(self.outer.params)  # the working copy restarts from θ_global
        else:  # delayed overlap: keep the progress made since this round's Δ was sent
            self.trainer.load_params([g - c for g, c in zip(self.outer.params, self._carry)])
        if self.feedback is None:
            return
        if sent is None or self.codec is None:  # applied in full: nothing is owed any more
            self.feedback.reset()
            return
        try:
            self.feedback.update(sent, roundtrip(self.codec, sent))
        except CodecError:  # a non-finite contribution, screened out by every reducer: nothing to carry
            self.feedback.reset()

    def _count_failure(self, result: str, group_size: int, seconds: float) -> None:
        self.state.rounds_failed += 1
        self.metrics.rounds.labels(result=result).inc()
        self._record(result, group_size, seconds)

    def _record(self, result: str, group_size: int, seconds: float, eval_loss: float | None = None) -> None:
        loss = self.state.loss if result in ("ok", "alone") else None
        sent, received = self._round_bytes
        self._round_bytes = (0, 0)
        self.state.history.append(
            RoundRecord(
                self.outer.step, result, group_size, round(seconds, 3), self.outer.sha256, loss, eval_loss,
                sent, received,
            )
        )  # fmt: skip

    def _after_new_global(self) -> None:
        self.state.round_steps = 0
        self.state.outer_step = self.outer.step
        self.state.global_sha256 = self.outer.sha256
        self.metrics.outer_step.set(self.outer.step)
        self.share_state()

    async def _in_trainer(self, fn: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.daemon.train_pool, fn)


def make_round_keeper(cfg: Config, *args: Any, **kwargs: Any) -> RoundKeeper:
    """The keeper for `outer.overlap`: streaming has its own (a subclass, in dilocod/streaming.py)."""
    if cfg.outer.overlap == "streaming":
        from dilocod.streaming import StreamingKeeper  # it imports this module

        return StreamingKeeper(cfg, *args, **kwargs)
    return RoundKeeper(cfg, *args, **kwargs)
