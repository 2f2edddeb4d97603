"""The peer's trainer thread: inner steps and every other piece of torch work on the model.

All torch work runs in one single-worker thread pool, so the event loop keeps serving HTTP, publishing
status records and talking to the averager while the peer trains. This is the round driver's `Training`
port; each inner step is counted on the event loop (inner step, tokens, throughput) as it happens.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from dilocod.node.coreshare import RECHECK_SECONDS
from dilocod.observability.metrics import Metrics
from dilocod.observability.peerstate import InnerProgress
from dilocod.rounds.tokens import Part, TokenLedger
from dilocod.trainer import InnerTrainer, StepStats
from peers import heap

T = TypeVar("T")
log = logging.getLogger("dilocod.training")

# Weight of the newest step in the throughput average (a few steps smooth out noise, yet a peer that
# slows down shows it within a round: the run's clock relies on it).
THROUGHPUT_EMA = 0.2


class TrainerThread:
    def __init__(
        self,
        trainer: InnerTrainer,
        pool: ThreadPoolExecutor,
        inner: InnerProgress,
        metrics: Metrics,
        stopping: asyncio.Event,
    ) -> None:
        # `inner` is ours alone to write: the status and the round clock read it
        self.trainer, self.pool, self.inner, self.metrics = trainer, pool, inner, metrics
        self.stopping = stopping
        self.tokens: TokenLedger | None = None  # set once the ledger exists (it resumes from a checkpoint)
        self.seconds_per_step: float | None = None
        self.on_step: Callable[[], None] = lambda: None  # after each step is counted (the driver's hook)
        # Awaited before every job but inner steps: a checkpoint being written reads θ_global, the outer
        # momentum and the residual live, and only these jobs (outer step, re-sync, step back) change them.
        self.guard: Callable[[], Awaitable[None]] | None = None
        # Torch threads the trainer should run on now (the machine's share, `coreshare.py`); None: leave them.
        self.threads: Callable[[], int] | None = None
        self._threads_checked = -math.inf

    async def run(self, fn: Callable[[], T]) -> T:
        if self.guard is not None:
            await self.guard()
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn)

    async def evaluate(self) -> float:
        return await self.run(self.trainer.evaluate)

    async def train(self, should_stop: Callable[[], bool]) -> StepStats:
        """Inner steps until `should_stop()` before a step; at least one unless the peer is stopping."""
        loop = asyncio.get_running_loop()
        trainer = self.trainer
        taken = [0]
        last = [time.perf_counter()]

        def stop_now() -> bool:
            return self.stopping.is_set() or (taken[0] > 0 and should_stop())

        def stepped(step: int, loss: float) -> None:  # trainer thread
            now = time.perf_counter()
            seconds, last[0] = now - last[0], now
            taken[0] += 1
            self._follow_share(loop)
            # The chunk parts of this step, drained before the next step takes its windows.
            parts = self._drain_parts()
            loop.call_soon_threadsafe(self._count_step, step, loss, seconds, parts)

        def steps() -> StepStats:
            # The last round's buffers (Δ, the average, the outer step's temporaries) are free by now:
            # give their pages back before training makes new ones (peers/heap.py; a few ms a round).
            heap.trim()
            self._follow_share(loop)
            return trainer.train_steps(1 << 62, should_stop=stop_now, on_step=stepped)

        self.inner.training_began(time.monotonic())  # compute utilization: time in inner steps
        try:
            stats = await self.run(steps)
        finally:
            self.inner.training_ended(time.monotonic())
        if stats.steps:
            self.metrics.inner_step_seconds.observe(stats.seconds / stats.steps)
            self.inner.loss = stats.mean_loss  # the mean train loss of the round's steps
        return stats

    def _follow_share(self, loop: asyncio.AbstractEventLoop) -> None:
        """Trainer thread: run on the machine's share of threads, re-read every RECHECK_SECONDS."""
        now = time.monotonic()
        if self.threads is None or now - self._threads_checked < RECHECK_SECONDS:
            return
        self._threads_checked = now
        wanted, running = self.threads(), torch.get_num_threads()
        if wanted != running:
            log.info(
                "training on %d thread(s), was %d: this machine's CPU trainers share its cores",
                wanted,
                running,
            )
            torch.set_num_threads(wanted)
            loop.call_soon_threadsafe(self._show_threads, wanted)

    def _show_threads(self, threads: int) -> None:
        self.inner.threads = threads

    def _drain_parts(self) -> list[Part]:
        cursor = self.trainer.cursor
        return [] if cursor is None else [(p.epoch, p.chunk, p.lo, p.hi) for p in cursor.drain()]

    def _count_step(self, step: int, loss: float, seconds: float, parts: list[Part]) -> None:
        """One inner step, on the event loop: counters, throughput, the token ledger."""
        tokens = self.trainer.tokens_per_step
        self.inner.inner_step = step
        self.metrics.inner_steps.inc()
        self.metrics.tokens.inc(tokens)
        if math.isfinite(loss):
            self.metrics.train_loss.set(loss)
        if seconds > 0:
            self._throughput(tokens / seconds, seconds)
        if self.tokens is not None:
            self.tokens.stepped(tokens, seconds, parts)
        self.on_step()

    def _throughput(self, tokens_per_second: float, seconds: float) -> None:
        old = self.inner.tokens_per_second
        tps = (
            tokens_per_second if old <= 0 else (1 - THROUGHPUT_EMA) * old + THROUGHPUT_EMA * tokens_per_second
        )
        self.inner.tokens_per_second = tps
        self.seconds_per_step = self.trainer.tokens_per_step / tps
        self.metrics.tokens_per_second.set(tps)
        self.inner.mfu = self.trainer.mfu(tps)
        self.metrics.mfu.set(math.nan if self.inner.mfu is None else self.inner.mfu)

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.state_dict()
