"""The effects of the round machine's decisions: apply, keep, step back, record, publish, checkpoint.

Each effect is a few lines on the parts the daemon handed in (ports), the pipeline (tensors), the token
ledger and the observable state; no decision is taken here. This module is the one writer of the peer's
round progress (`PeerState.rounds`): the driver, its clock and its joining say what changed through the
methods at the end.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

from dilocod.observability.peerstate import Phase, RoundRecord
from dilocod.rounds.core import RoundCore
from dilocod.rounds.events import (
    SUCCESS,
    Apply,
    Checkpoint,
    Contributing,
    Effect,
    Evaluate,
    Keep,
    Outcome,
    Publish,
    Record,
    StepBack,
    Warn,
)
from dilocod.rounds.phases import PhaseTimes
from dilocod.rounds.pipeline import Contribution
from dilocod.rounds.ports import Parts, Publisher
from peers.group import RoundOutcome, incomplete_reason

log = logging.getLogger("dilocod.rounds")

FAILURES = frozenset(
    {Outcome.NO_GROUP, Outcome.FAILED, Outcome.DIVERGED, Outcome.BANNED, Outcome.LATE, Outcome.SYNC_FAILED}
)


@dataclass
class RoundContext:
    """What the driver and the effects share about the round at hand."""

    contribution: Contribution | None = None  # the contribution being settled
    outcome: RoundOutcome | None = None  # its averaging outcome
    sent_tokens: int = 0  # tokens behind that contribution
    counted: float = 0.0  # of those, what reached θ_global
    phases: PhaseTimes = field(default_factory=PhaseTimes)  # where the time between stretches of steps goes


class Effects:
    def __init__(self, core: RoundCore, context: RoundContext, parts: Parts) -> None:
        self.settings, self.state, self.metrics = core.settings, core.state, core.metrics
        self.outer, self.pipeline, self.tokens = core.outer, core.pipeline, core.tokens
        self.rounds = core.state.rounds  # ours alone to write; the rest of `state` we only read
        self.context = context
        self.training, self.sync, self.publisher = parts.training, parts.sync, parts.publisher
        self.sample, self.scoring = parts.sample, parts.scoring
        self._contributed_reported = 0.0  # what the tokens-contributed counter holds
        self._phased: RoundRecord | None = None  # the latest round record given its phases
        self.new_global_shown()

    async def perform(self, effect: Effect) -> None:
        if isinstance(effect, Apply):
            await self.apply(effect.alone)
        elif isinstance(effect, Keep):
            await self.keep()
        elif isinstance(effect, StepBack):
            await self.step_back()
        elif isinstance(effect, Record):
            self.record(effect)
        elif isinstance(effect, Contributing):
            self.contributing(effect.reason)
        elif isinstance(effect, Warn):
            log.warning("%s", effect.text)
        elif isinstance(effect, Publish):
            await self.publisher.publish()
        elif isinstance(effect, Evaluate):
            await self.evaluate()
        elif isinstance(effect, Checkpoint):
            await self.publisher.checkpoint()
        else:  # Launch is the driver's: it starts a round
            raise TypeError(f"not an effect of this module: {effect!r}")

    # ---- θ_global ------------------------------------------------------------------------------------------
    async def apply(self, alone: bool) -> None:
        contribution, outcome = self.context.contribution, self.context.outcome
        assert contribution is not None, "an outer step needs the round's contribution"
        # While the step replaces θ_global and the momentum, our snapshot must not hold the old tensors.
        self.sync.withdraw()
        try:
            if alone:
                await self.training.run(lambda: self.pipeline.apply_alone(contribution))
                self.context.counted = self.tokens.applied(None)
            else:
                await self._apply_average(contribution, outcome)
        finally:
            self.rounds.alone = alone
            self.new_global()

    async def _apply_average(self, contribution: Contribution, outcome: RoundOutcome | None) -> None:
        assert outcome is not None and outcome.averaged is not None
        averaged = outcome.averaged
        scored = self.scoring is not None and contribution.indices is None and not contribution_empty(outcome)
        # θ_global before the step, for scoring the group's Δ: the tensors themselves, as the outer step
        # replaces them and never writes them (`OuterOptimizer.apply`); the scorer only reads them.
        start = list(self.outer.params) if scored else None
        await self.training.run(lambda: self.pipeline.apply(contribution, averaged))
        self.context.counted = self.tokens.applied(outcome.my_weight)
        if start is not None and self.scoring is not None:
            self.scoring.applied(contribution.step, start, outcome.majority, self.outer.sha256)

    async def evaluate(self) -> None:
        """The eval loss of the new θ_global, into the state and the round's record, and a completion of the
        run's prompt (each when it is due)."""
        with self.context.phases.timing("eval"):
            await self._eval()
        every = self.settings.sample_every
        if self.sample is not None and every > 0 and self.outer.step % every == 0:
            started = time.perf_counter()
            with self.context.phases.timing("sample"):
                self.rounds.sample = await self.training.run(self.sample)
            self.rounds.sample_step = self.outer.step
            log.info("outer step %d: sample %r (%.2fs)", self.outer.step, self.rounds.sample,
                     time.perf_counter() - started)  # fmt: skip

    async def _eval(self) -> None:
        step = self.outer.step
        if step % self.settings.eval_every:
            return
        self.rounds.eval_loss = await self.training.evaluate()
        self.metrics.eval_loss.set(self.rounds.eval_loss)
        bits = self.state.eval_bits_per_byte
        if bits is not None:
            self.metrics.eval_bits_per_byte.set(bits)
        entry = self.rounds.history[-1] if self.rounds.history else None
        if entry is not None and entry.outer_step == step and entry.result in SUCCESS:
            entry.eval_loss = self.rounds.eval_loss
        log.info(
            "outer step %d: eval loss %.4f (%.3f bits per byte)",
            step,
            self.rounds.eval_loss,
            bits or math.nan,
        )

    async def keep(self) -> None:
        contribution = self.context.contribution
        if contribution is not None:
            self.pipeline.keep(contribution)
        self.tokens.kept()
        self.context.counted = 0.0

    async def step_back(self) -> None:
        undone = self.outer.step
        previous = await self.training.run(self.pipeline.step_back)
        if previous is None:
            return
        for entry in self.rounds.history:
            if entry.outer_step == undone and entry.result in SUCCESS:
                entry.result = Outcome.UNDONE.value
        self.new_global()
        log.warning(
            "every other peer is at outer step %d and none can fetch step %d from us (we are private): "
            "stepping back to outer step %d (θ %s) to average with them; our inner progress is kept",
            previous.step, undone, previous.step, previous.sha256[:12],
        )  # fmt: skip

    def new_global(self) -> None:
        """θ_global changed: offer it to peers that re-sync, and show it."""
        self.sync.share()
        self.new_global_shown()

    def new_global_shown(self) -> None:
        self.rounds.outer_step = self.outer.step
        self.rounds.global_sha256 = self.outer.sha256
        self.metrics.outer_step.set(self.outer.step)

    # ---- what the run sees --------------------------------------------------------------------------------
    def record(self, effect: Record) -> None:
        outcome = effect.outcome
        sent, received = self._bytes()
        loss = self.state.inner.loss if outcome in SUCCESS else None
        # A step due for evaluation gets its own eval loss once `evaluate` has it (None until then)
        due = self.outer.step % self.settings.eval_every == 0
        eval_loss = self.rounds.eval_loss if outcome in SUCCESS and not due else None
        entry = RoundRecord(
            self.outer.step, outcome.value, effect.group_size, round(effect.seconds, 3), self.outer.sha256,
            loss, eval_loss, sent, received,
            tokens=self.context.sent_tokens, tokens_counted=round(self.context.counted, 1),
            reason=self._failure(outcome, effect), allreduce_seconds=self._allreduce_seconds(),
        )  # fmt: skip
        self.rounds.history.append(entry)
        self.metrics.rounds.labels(result=outcome.value).inc()
        self._count(outcome, effect)
        self._log(outcome, effect, entry)
        # Settled: its Δ and average (4 + 4 bytes a parameter) must not live through the next round.
        self.context.outcome = self.context.contribution = None
        self.context.sent_tokens, self.context.counted = 0, 0.0
        self.sync_tokens()

    def _failure(self, outcome: Outcome, effect: Record) -> str | None:
        if outcome is Outcome.FAILED:
            return effect.detail or incomplete_reason(self._reducer_errors())
        return effect.detail if outcome in FAILURES else None

    def _allreduce_seconds(self) -> float:
        outcome = self.context.outcome
        return 0.0 if outcome is None else round(outcome.allreduce_seconds, 3)

    def _bytes(self) -> tuple[int, int]:
        outcome = self.context.outcome
        return (0, 0) if outcome is None else (outcome.bytes_sent, outcome.bytes_received)

    def _count(self, outcome: Outcome, effect: Record) -> None:
        if outcome in SUCCESS:
            self.rounds.rounds_ok += 1
            self.rounds.group_size = effect.group_size
            self.rounds.last_round_seconds = effect.seconds
            self.metrics.group_size.set(effect.group_size)
            self.metrics.round_seconds.observe(effect.seconds)
        elif outcome in FAILURES:
            self.rounds.rounds_failed += 1
        elif outcome is Outcome.RESYNCED:
            self.rounds.resyncs += 1
            self.rounds.alone = False
            self.metrics.resyncs.inc()

    def _log(self, outcome: Outcome, effect: Record, entry: RoundRecord) -> None:
        step = self.outer.step
        if outcome is Outcome.OK:
            allreduce = self.context.outcome.allreduce_seconds if self.context.outcome is not None else 0.0
            log.info(
                "outer step %d: ok, group of %d, %d of our tokens counted, loss %.4f, %.0f tokens/s, "
                "round %.1fs (all-reduce %.1fs), θ %s",
                step, effect.group_size, int(entry.tokens_counted), self.state.inner.loss,
                self.state.inner.tokens_per_second, effect.seconds, allreduce, self.outer.sha256[:12],
            )  # fmt: skip
        elif outcome is Outcome.ALONE:
            log.info("alone in the run: applied our own pseudo-gradient (outer step %d)", step)
        elif outcome is Outcome.NO_GROUP:
            log.info("no group at outer step %d; keeping our progress for the next round", step)
        elif outcome is Outcome.FAILED:
            log.warning("round %d failed (%s); keeping our progress for the next round", step, entry.reason)
        elif outcome is Outcome.DIVERGED:
            log.warning("our θ_global is not the run's at outer step %d: re-syncing", step)
        elif outcome is Outcome.BANNED:
            log.warning("round %d: most of our group bans us, our contribution did not count", step)
        elif outcome is Outcome.LATE:
            log.warning("the run closed round %d without us: re-syncing, keeping our progress", step)
        elif outcome is Outcome.CAUGHT_UP:
            log.info(
                "outer step %d: applied the run's round our donor had in flight (θ %s); our progress goes "
                "out in the next round", step, self.outer.sha256[:12],
            )  # fmt: skip

    def _reducer_errors(self) -> tuple[str, ...]:
        outcome = self.context.outcome
        return () if outcome is None else outcome.reducer_errors

    def contributing(self, reason: str | None) -> None:
        self.rounds.contributing = reason is None
        self.rounds.not_contributing_reason = reason

    def sync_tokens(self) -> None:
        """The ledger's numbers into the metrics (the status reads the ledger itself)."""
        gained = self.tokens.contributed - self._contributed_reported
        if gained > 0:  # a counter only moves up (a restart resumes the ledger, not the counter)
            self.metrics.tokens_contributed.inc(gained)
            self._contributed_reported = self.tokens.contributed
        share = self.tokens.share
        self.metrics.contribution_share.set(math.nan if share is None else share)

    def open_round(self, opened: float | None = None) -> None:
        """The run's clock starts timing a new round for us."""
        self.tokens.new_round()
        self.rounds.round_opened = time.time() if opened is None else opened

    # ---- what the driver, its clock and its joining report --------------------------------------------------
    def doing(self, activity: Phase) -> None:
        """The driver trains, averages or downloads the run's state now (`/api/status` `phase`)."""
        self.rounds.activity = activity

    def entered(self, round_index: int) -> None:
        """We train `round_index` now, with the state we hold."""
        self.rounds.round = round_index
        self.joined()

    def joining(self, run_step: int) -> None:
        """We download the run's state of `run_step` to train that round (the run's clock waits for us)."""
        if self.rounds.joining != run_step:
            self.rounds.joining, self.rounds.joining_since = run_step, time.time()

    def joined(self) -> None:
        """The download is over, adopted or not."""
        self.rounds.joining = self.rounds.joining_since = None

    def closes_at(self, at: float) -> None:
        """The run's clock's latest estimate of when our round closes."""
        self.rounds.round_closes_at = at

    def phases_closed(self, phases: dict[str, float]) -> None:
        """Inner steps start again: the gap since the last ones, by phase, is the last round's cost; it goes
        with the round recorded in that gap (once)."""
        self.rounds.last_round_phases = phases
        latest = self.rounds.history[-1] if self.rounds.history else None
        if latest is not None and latest is not self._phased:
            latest.phases, self._phased = phases, latest

    def exchanged(self, sent: int, received: int) -> None:
        """Payload bytes of an all-reduce."""
        self.rounds.bytes_sent += sent
        self.rounds.bytes_received += received
        self.metrics.bytes_sent.inc(sent)
        self.metrics.bytes_received.inc(received)


def contribution_empty(outcome: RoundOutcome) -> bool:
    """A round with fewer than two contributors has nobody to score."""
    return outcome.contributors < 2


async def cancelled_quietly(task: asyncio.Task[object]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def published_quietly(publisher: Publisher) -> None:
    """Publish our record now; a DHT hiccup is not an error (the periodic record follows within a status
    interval)."""
    try:
        await publisher.publish()
    except Exception as e:
        log.debug("status publish failed: %r", e)
