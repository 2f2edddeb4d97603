"""Who really trained, in the running peer (`scoring.enabled`): keep and serve our Δ, score the contributions
the round's assignment gives us, publish the verdicts, and fold everyone's verdicts into ratings that gate
a peer's weight (the rules: dilocod/trust/scoring.py; docs/trust.md).

Scoring runs beside training, off the trainer thread, on a copy of the model in a thread of its own at a
lower OS priority, so the inner steps never wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dilocod.config import Config
from dilocod.data.corpus import TokenSource
from dilocod.data.cursor import part_windows
from dilocod.node.runtime import one_core_here
from dilocod.observability.metrics import Metrics
from dilocod.observability.peerstate import PeerState
from dilocod.observability.runview import read_run
from dilocod.observability.scoreview import SCORES_KEY, published_verdicts, score_view
from dilocod.trainer.batches import batch_at
from dilocod.trust.deltas import MAX_REQUEST, PROTOCOL, DeltaStore, fetch_delta
from dilocod.trust.measure import Batch, measure, pick, random_starts
from dilocod.trust.scoring import (
    MIN_DATA_GAIN,
    MIN_GAIN,
    MIN_REFERENCE_MARGIN,
    Rating,
    RatingRule,
    Score,
    Verdict,
    assign_scorers,
    gated,
    ratings,
    score,
    scores_round,
    to_ban,
)
from peers.node import Node
from proto.deltas import PART_BYTES
from proto.scores import MAX_VERDICTS, encode_scores

log = logging.getLogger("dilocod.scoring")

FETCH_TIMEOUT = 30.0  # per part of a Δ
KEEP_STEPS = 256  # rounds whose assignment table (and accepted verdicts) we remember
NICE = 10  # the scoring thread's OS priority below the trainer's
# How far the claimed data's gain may fall short of random text's before a Δ fails, when there is no reference:
# on 8 + 8 sequences an honest Δ measured −0.006 once in a 4-peer run (noise), and one failure gates a
# provisional peer.
MIN_DATA_GAIN_MEASURED = MIN_DATA_GAIN - 0.02
# Against the reference (MIN_REFERENCE_MARGIN) no slack: bench/score_calibration.py (tiny, 24 rounds)
# measured honest margins of +0.013 at the least (H = 5, a contributor with 2 of its scorer's 5 steps;
# ≥ +0.03 at H = 20), while a Δ trained on other data passed 5–9 rounds of 24.


@dataclass
class Target:
    """A contributor we scored, as /api/status shows it."""

    step: int
    peer_id: str
    passed: bool
    gain: float
    data_gain: float | None  # None: not measured (scored against a reference)
    reason: str | None = None
    reference_margin: float | None = None  # None: scored without a reference Δ


def _lower_priority() -> None:
    """Initializer of the scoring thread: the OS schedules it after the trainer (Linux: per thread), and its
    forward passes run on one core, leaving torch's OpenMP team to the trainer (`one_core_here`)."""
    with contextlib.suppress(Exception):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    one_core_here()


class ContributionScoring:
    def __init__(
        self,
        cfg: Config,
        node: Node,
        state: PeerState,
        metrics: Metrics,
        model: nn.Module,
        train_source: TokenSource,
        train_tokens: int,
        punish: Callable[[list[tuple[str, str]]], Awaitable[None]],
        *,
        serve: bool,
        rule: RatingRule | None = None,
    ) -> None:
        self.cfg, self.node, self.state, self.metrics = cfg, node, state, metrics
        self.model = copy.deepcopy(model).to("cpu", torch.float32)  # our own copy: the trainer's is busy
        self.source, self.train_tokens, self.punish = train_source, train_tokens, punish
        self.serve, self.rule = serve, rule or RatingRule()
        self.store = DeltaStore()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="scoring", initializer=_lower_priority)
        self.tables: dict[int, dict[str, list[str]]] = {}  # outer step → scorer → targets
        self.accepted: set[Verdict] = set()
        self.published: list[Verdict] = []  # every verdict the scorers publish, checked or not
        self.ratings: dict[str, Rating] = {}
        self.mine: deque[Verdict] = deque(maxlen=MAX_VERDICTS)  # our verdicts, as published
        self.scored: deque[Target] = deque(maxlen=MAX_VERDICTS)
        self.banned: set[str] = set()
        self.warned_self = False
        self.scores_computed = 0
        self.scoring_seconds = 0.0  # wall time, fetches and waits for the CPU included
        self.scoring_cpu_seconds = 0.0  # the scoring thread's CPU time measuring losses
        self.bytes_fetched = 0
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- life cycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self.serve:  # a private peer accepts no streams: its Δ cannot be fetched (it is not scored)
            await self.node.serve_unary(PROTOCOL, self.store.handle, max_request=MAX_REQUEST)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- the round's hooks (dilocod/rounds/ports.py `Scoring`) ----------------------------------------------
    def sent(self, step: int, sent: Sequence[torch.Tensor], indices: list[int] | None, tokens: int,
             chunks: list[int]) -> None:  # fmt: skip
        """Our contribution left: keep it encoded, to serve it to our scorers."""
        tensors = [t.detach().clone() for t in sent]
        loop = asyncio.get_running_loop()

        async def keep() -> None:
            await loop.run_in_executor(self.pool, self.store.keep, step, tensors, indices, tokens, chunks)

        self._spawn(keep())

    def applied(self, step: int, start: list[torch.Tensor], members: Sequence[str], new_hash: str) -> None:
        """A round at `step` was applied; `members` held the group's θ_global, which was `start` before it and
        hashes to `new_hash` after (the assignment's seed: nobody knew it before the round)."""
        self._spawn(self._score_round(step, start, list(members), new_hash))

    def gated_peers(self) -> list[str]:
        """The peers our tickets list with our bans: rated below the gate (weight 0 when most agree)."""
        return sorted(p for p, r in self.ratings.items() if gated(r, self.rule) and p != self.state.peer_id)

    # ---- scoring -------------------------------------------------------------------------------------------------
    async def _score_round(
        self, step: int, start: list[torch.Tensor], members: list[str], new_hash: str
    ) -> None:
        if not scores_round(step):
            return
        try:
            records = {r["peer_id"]: r for r in await read_run(self.node)}
            trainers = [m for m in members if records.get(m, {}).get("role") == "peer"]
            # A private contributor cannot be asked for its Δ: it is not scored (docs/trust.md).
            targets = [m for m in trainers if records[m].get("reachability") != "private"]
            table = assign_scorers(new_hash, trainers, targets)
            self.tables[step] = table
            for old in sorted(self.tables)[:-KEEP_STEPS]:
                del self.tables[old]
            for target in table.get(self.state.peer_id, []):
                await self._score_one(step, start, target, new_hash)
            await self._publish()
            await self.refresh()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # scoring must never take the peer down
            log.warning("scoring round %d failed: %s", step, str(e).splitlines()[0] if str(e) else repr(e))

    async def _score_one(self, step: int, start: list[torch.Tensor], target: str, seed: str) -> None:
        started = time.perf_counter()

        async def ask(request: bytes) -> bytes:
            return await self.node.ask_unary_peer(
                target, PROTOCOL, request, timeout=FETCH_TIMEOUT, max_reply=PART_BYTES + 4096
            )

        try:
            fetched = await fetch_delta(ask, step, [t.shape for t in start])
        except Exception as e:  # no Δ to show for a counted contribution is a failed score
            reason = f"no Δ: {str(e).splitlines()[0][:120] if str(e) else type(e).__name__}"
            self._verdict(Target(step, target, False, 0.0, 0.0, reason), started)
            return
        self.bytes_fetched += fetched.bytes
        loop = asyncio.get_running_loop()
        verdict = await loop.run_in_executor(
            self.pool, self._timed_measure, start, fetched, f"{seed}:{target}"
        )
        verdict.step, verdict.peer_id = step, target
        self._verdict(verdict, started)

    def _timed_measure(self, start: list[torch.Tensor], fetched: Any, seed: str) -> Target:
        """`_measure`, with the CPU time it took this thread (what scoring costs the machine, waits excluded)."""
        began = time.thread_time()
        target = self._measure(start, fetched, seed)
        self.scoring_cpu_seconds += time.thread_time() - began
        return target

    def _measure(self, start: list[torch.Tensor], fetched: Any, seed: str) -> Target:
        """In the scoring thread: the losses and the verdict."""
        seq_len, n = self.cfg.trainer.seq_len, self.cfg.scoring.sequences
        windows = [
            w
            for part in fetched.parts
            for w in part_windows(self.cfg.data.dataset, part, self.cfg.data.chunk_tokens, self.train_tokens, seq_len)
        ] if self.cfg.data.chunk_tokens > 0 else []  # fmt: skip
        claimed = pick(windows, n, f"claimed:{seed}")
        # With a reference the claimed windows are compared with it, and random text is not needed; without
        # the chunk schedule a ticket names no data: only whether Δ helps at all is checked, on random text.
        reference = self._reference(fetched, start) if claimed else None
        random_batch: Batch | None = None
        if reference is not None:
            claimed_batch = batch_at(self.source, claimed, seq_len)
        else:
            rand = random_starts(self.train_tokens, seq_len, n, f"random:{seed}")
            if not rand:
                return Target(0, "", True, 0.0, None, "no data to score on")
            random_batch = batch_at(self.source, rand, seq_len)
            claimed_batch = batch_at(self.source, claimed, seq_len) if claimed else random_batch
        losses = measure(self.model, start, fetched.delta, fetched.indices, claimed_batch, random_batch,
                         self.cfg.scoring.step, reference)  # fmt: skip
        min_data_gain = MIN_DATA_GAIN_MEASURED if claimed else -float("inf")
        verdict: Score = score(losses, MIN_GAIN, min_data_gain, MIN_REFERENCE_MARGIN)
        reason = None if verdict.passed else (
            "its Δ does not lower the loss" if verdict.gain <= MIN_GAIN
            else "its Δ lowers the loss on random text as much as on the data it claims"
            if verdict.reference_margin is None
            else "its Δ lowers the loss on the data it claims no more than our Δ, trained on other data, does"
        )  # fmt: skip
        return Target(
            0, "", verdict.passed, verdict.gain, verdict.data_gain, reason, verdict.reference_margin
        )

    def _reference(self, fetched: Any, start: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Our own Δ of the round, when it covers the tensors the contributor's does: work on other chunks
        from the same θ_global, what the contributor's Δ must beat on its claimed data."""
        own = self.store.own(fetched.step, [t.shape for t in start])
        if own is None or own[1] != fetched.indices:
            return None
        return own[0]

    def _verdict(self, target: Target, started: float) -> None:
        seconds = time.perf_counter() - started
        self.scores_computed += 1
        self.scoring_seconds += seconds
        self.metrics.scores_computed.inc()
        self.metrics.scoring_seconds.inc(seconds)
        self.mine.append((target.step, self.state.peer_id, target.peer_id, target.passed))
        self.scored.append(target)
        beyond = (
            f"beyond our Δ {target.reference_margin:.4f}" if target.reference_margin is not None
            else f"beyond random {target.data_gain:.4f}" if target.data_gain is not None
            else "unchecked"
        )  # fmt: skip
        log.info(
            "scored %s's Δ of outer step %d: %s (gain %.4f, on its data %s%s) in %.2fs",
            target.peer_id[-12:], target.step, "pass" if target.passed else "FAIL", target.gain,
            beyond, f"; {target.reason}" if target.reason else "", seconds,
        )  # fmt: skip

    # ---- verdicts → ratings -------------------------------------------------------------------------------------
    async def _publish(self) -> None:
        record = {
            "peer_id": self.state.peer_id,
            "run_id": self.cfg.run.id,
            "time": time.time(),
            "steps": [v[0] for v in self.mine],
            "targets": [v[2] for v in self.mine],
            "passed": [int(v[3]) for v in self.mine],
        }
        ttl = max(60.0, 30 * self.cfg.net.status_interval)
        await self.node.publish(SCORES_KEY, encode_scores(record), ttl)

    async def refresh(self) -> None:
        """Read every scorer's verdicts, keep those we can check (the scorer was assigned that contributor in
        a round we were in), and recompute the ratings, gates and bans."""
        self.published = await published_verdicts(self.node, self.cfg.run.id)
        for step, scorer, target, passed in self.published:
            if target in self.tables.get(step, {}).get(scorer, ()):
                self.accepted.add((step, scorer, target, passed))
        if self.tables:
            oldest = min(self.tables)
            self.accepted = {v for v in self.accepted if v[0] >= oldest}
        self.ratings = ratings(sorted(self.accepted), self.rule)
        self.metrics.peers_gated.set(len(self.gated_peers()))
        for peer, rating in self.ratings.items():
            if peer != self.state.peer_id and to_ban(rating, self.rule) and peer not in self.banned:
                self.banned.add(peer)
                await self.punish(
                    [(peer, f"failed {rating.failures} contribution scores in a row (no work in its Δ)")]
                )
        self._warn_self()

    def _warn_self(self) -> None:
        reason = self.gate_reason()
        if reason is not None and not self.warned_self:
            log.warning("our work does not count: %s", reason)
        self.warned_self = reason is not None

    def gate_reason(self) -> str | None:
        """Why our own contributions weigh 0 (None: they count)."""
        rating = self.ratings.get(self.state.peer_id)
        if rating is None or not gated(rating, self.rule):
            return None
        return (
            f"the run's scorers rate our pseudo-gradients {rating.value:.2f}, below the gate "
            f"{self.rule.gate}: they do not lower the loss on the data our tickets claim "
            f"({rating.failures} failed scores in a row); our tokens count 0 until we pass again"
        )

    # ---- observability -------------------------------------------------------------------------------------------
    def run_view(self) -> dict[str, Any]:
        """`/api/run` `scoring`: every scored peer's rating as we computed it, and its latest verdicts."""
        return score_view(self.published, self.rule, self.ratings)

    def status(self) -> dict[str, Any]:
        """`/api/status` `scoring`."""
        own = self.ratings.get(self.state.peer_id)
        return {
            "rating": None if own is None else round(own.value, 4),
            "gated": self.gated_peers(),
            "scores_computed": self.scores_computed,
            "scoring_seconds": round(self.scoring_seconds, 3),
            "scoring_cpu_seconds": round(self.scoring_cpu_seconds, 3),
            "bytes_fetched": self.bytes_fetched,
            "ratings": {p: round(r.value, 4) for p, r in sorted(self.ratings.items())},
            "last_scores": [
                {
                    "outer_step": t.step,
                    "peer_id": t.peer_id,
                    "passed": t.passed,
                    "gain": round(t.gain, 6),
                    "data_gain": None if t.data_gain is None else round(t.data_gain, 6),
                    "reference_margin": None if t.reference_margin is None else round(t.reference_margin, 6),
                    "reason": t.reason,
                }
                for t in self.scored
            ],  # fmt: skip
        }
