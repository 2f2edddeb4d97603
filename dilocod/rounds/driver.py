"""The round driver: runs the pure round machine (`machine.py`) through the ports the daemon hands in.

Its loop is three lines: ask the machine what to do with the last event, perform the effects, perform
the command and turn its result into the next event. The commands are here (train until the run's clock
closes the round, average, await a round in flight, re-sync, stop); the effects are in `effects.py`, a
round's averaging (ticket, group, waiting for the outcome) in `exchange.py`, and how a re-sync announces
itself to the run's clock in `joining.py`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import torch

from dilocod.observability.peerstate import Phase
from dilocod.rounds import clock
from dilocod.rounds.core import RoundCore
from dilocod.rounds.effects import Effects, RoundContext, cancelled_quietly, published_quietly
from dilocod.rounds.events import (
    Action,
    Apply,
    Average,
    Averaged,
    AwaitRound,
    Begin,
    Checkpoint,
    CheckRun,
    Closed,
    Download,
    Evaluate,
    Event,
    Launch,
    Publish,
    RunChecked,
    Stop,
    Stopping,
    Synced,
    Train,
)
from dilocod.rounds.exchange import Exchange, InFlight, already, attempt
from dilocod.rounds.joining import Joining
from dilocod.rounds.machine import MachineSettings, RoundState, transition
from dilocod.rounds.observe import RunObserver
from dilocod.rounds.pipeline import Contribution
from dilocod.rounds.ports import Parts
from dilocod.rounds.timing import RoundTimer
from dilocod.trust.bans import BanList
from dilocod.trust.hooks import HONEST, Tampering
from peers.group import RoundOutcome

log = logging.getLogger("dilocod.rounds")

ALONE_AFTER_TIMEOUTS = 4  # matchmaking timeouts without seeing another trainer before applying alone
# The phase each effect's seconds count in (`phases.py`); Evaluate times its eval and sample itself.
EFFECT_PHASES: dict[type, str] = {
    Launch: "close",
    Apply: "outer_step",
    Checkpoint: "checkpoint",
    Publish: "publish",
}


class RoundDriver:
    def __init__(
        self,
        core: RoundCore,
        parts: Parts,
        machine: MachineSettings,
        clock_settings: clock.ClockSettings,
        bans: BanList,
        tampering: Tampering = HONEST,
    ) -> None:
        self.core, self.parts, self.machine, self.clock_settings = core, parts, machine, clock_settings
        self.settings, self.state, self.metrics = core.settings, core.state, core.metrics
        self.outer, self.pipeline, self.tokens = core.outer, core.pipeline, core.tokens
        self.context = RoundContext()
        self.effects = effects = Effects(core, self.context, parts)
        self.timer = RoundTimer(core, parts.view, clock_settings, on_estimate=effects.closes_at)
        pipeline = core.pipeline
        self.observer = RunObserver(
            core.state, core.outer, parts.view,
            previous=lambda: None if pipeline.previous is None else (pipeline.previous.step, pipeline.previous.sha256),
            alone_after=ALONE_AFTER_TIMEOUTS * core.settings.matchmaking_timeout,
            private=machine.private,
        )  # fmt: skip
        self.facts = self.observer.facts
        self.exchange = Exchange(core, self.timer, parts, bans, tampering)
        self.joining = Joining(
            core, self.timer, parts.publisher, machine.overlapped, announced=effects.joining
        )
        self._in_flight: InFlight | None = None
        self._outlasted = 0  # rounds in a row that outlasted the next one's training (overlap)
        self._reopen: tuple[float | None] | None = None  # (when the run opened it,) of the round we open next

    # ---- the loop ------------------------------------------------------------------------------------------
    async def run(self, stopping: asyncio.Event) -> None:
        """Rounds until `stopping` is set and the machine says stop."""
        self._stopping = stopping
        mstate = RoundState(step=self.outer.step)
        event: Event = Begin()
        while True:
            mstate, actions = transition(mstate, event, self.machine)
            # Our record names our round from here on, not a round we are joining (set only while a
            # state downloads). Both change together: a heartbeat between them would show neither, and
            # the run would stop waiting for us before we are in its round.
            self.effects.entered(mstate.round)
            if self._reopen is not None:  # a new round opens for us: its number and its clock change together
                self.effects.open_round(self._reopen[0])
                self._reopen = None
            *effects, command = actions
            for effect in effects:
                await self._effect(effect)
            if isinstance(command, Stop):
                round_, self._in_flight = self._in_flight, None
                await self.exchange.drain(round_)
                return
            # A stop is seen by every command before it starts new work; a round that completes during a
            # stop is still applied (its group applies it too), then the next command sees the stop.
            event = await self._command(command)

    async def _effect(self, effect: Action) -> None:
        if isinstance(effect, Evaluate):
            await self.effects.perform(effect)
            return
        with self.context.phases.timing(EFFECT_PHASES.get(type(effect), "other")):
            if isinstance(effect, Launch):
                await self._launch()
            else:
                await self.effects.perform(effect)  # type: ignore[arg-type]

    async def _command(self, command: Action) -> Event:
        if self._stopping.is_set() and isinstance(command, Train | Average | Download):
            return Stopping()
        if isinstance(command, CheckRun):  # at start: our round is the run's, opened when it says
            with self.context.phases.timing("other"):
                self._reopen = (await self.timer.run_opened(self.outer.step),)
                return RunChecked(await self.facts())
        if isinstance(command, Train):
            return await self._train(command.hold)
        if isinstance(command, Average):
            return await self._average_now()
        if isinstance(command, AwaitRound):
            return await self._await_in_flight()
        if isinstance(command, Download):
            with self.context.phases.timing("sync"):
                return await self._download(command.min_step)
        raise TypeError(f"unknown command {command!r}")

    # ---- training until the run's clock closes the round ----------------------------------------------------
    async def _train(self, hold: bool) -> Event:
        self.effects.doing(Phase.TRAINING)
        self._close_phases()
        timer = self.timer
        timer.reset(hold)
        tracker = asyncio.create_task(timer.track(self.outer.step))
        training = asyncio.create_task(self.parts.training.train(self._should_stop))
        try:
            await self._announce_training()
            await training
        finally:
            await cancelled_quietly(training)  # type: ignore[arg-type]
            await cancelled_quietly(tracker)  # type: ignore[arg-type]
        if self._stopping.is_set():
            return Stopping()
        log.debug(
            "round %d closed for us at %.2f (clock said %.2f%s): %d of our tokens, group target %d",
            self.state.rounds.round, time.time(), timer.close_at, "; the run left it" if timer.left_behind else "",
            self.tokens.round, timer.group_target,
        )  # fmt: skip
        return Closed(await self.facts())

    async def _announce_training(self) -> None:
        """Tell the others' clocks at once that our tokens grow again: until our record says so, they count
        none of this round's (a record made while we evaluated or averaged says we were not training)."""
        await asyncio.sleep(0)  # the trainer task has marked the stretch of inner steps as begun
        await published_quietly(self.parts.publisher)

    def _close_phases(self) -> None:
        """Inner steps start again: what the time since the last ones went to is the last round's cost."""
        phases = self.context.phases.close()
        if not phases:
            return
        self.effects.phases_closed(phases)
        for phase, seconds in phases.items():
            self.metrics.round_phase_seconds.labels(phase=phase).observe(seconds)

    def _should_stop(self) -> bool:
        """Called by the trainer thread before each inner step."""
        return self._stopping.is_set() or self.timer.should_stop()

    # ---- averaging -----------------------------------------------------------------------------------------
    async def _average_now(self) -> Event:
        self.effects.doing(Phase.AVERAGING)
        phases = self.context.phases
        with phases.timing("close"):
            round_ = await self.exchange.start()
        started = time.perf_counter()
        outcome = await self.exchange.unless_stopped(round_.task, self._stopping)
        if outcome is None:
            return Stopping()
        phases.exchange(time.perf_counter() - started, outcome.allreduce_seconds)
        with phases.timing("other"):
            return await self._settle(round_, outcome)

    async def _launch(self) -> None:
        """Overlap: start this round's averaging in the background; the next round opens now."""
        self._in_flight = round_ = await self.exchange.start()
        round_.task.add_done_callback(lambda task: self._offer_pending(round_.contribution, task))
        self.effects.open_round()
        await self.parts.publisher.publish()  # the others' clocks follow our round

    async def _await_in_flight(self) -> Event:
        assert self._in_flight is not None, "AwaitRound without a round in flight"
        round_, self._in_flight = self._in_flight, None
        waited = not round_.task.done()
        if waited:
            self.effects.doing(Phase.AVERAGING)  # the network is slower than a round of inner steps
        with self.context.phases.timing("waiting"):
            outcome = await self.exchange.unless_stopped(round_.task, self._stopping)
        if outcome is None:
            return Stopping()
        self._note_overlap(waited and outcome.found_group and outcome.complete)
        with self.context.phases.timing("other"):
            return await self._settle(round_, outcome)

    def _offer_pending(self, contribution: Contribution, task: asyncio.Task[RoundOutcome]) -> None:
        """A round in flight completed: serve its average with our state until the close applies it, so a
        peer re-syncing meanwhile applies it with us rather than missing the group it would have needed."""
        if task.cancelled() or task.exception() is not None:
            return
        outcome = task.result()
        if outcome.averaged is not None and attempt(outcome).succeeded:
            self.parts.sync.share_pending(contribution.step, outcome.averaged)

    async def _adopt_in_flight(self, pending: list[torch.Tensor]) -> bool:
        """After a re-sync with overlap: hold the donor's round in flight as ours; False if it does not fit."""
        contribution = await self.parts.training.run(lambda: self.pipeline.caught_up(pending))
        if contribution is None:
            log.warning("the donor's round in flight does not fit our model: launching our own round")
            return False
        averaged = asyncio.create_task(already(RoundOutcome(True, 0, 0, True, True, pending, 0.0)))
        self._in_flight = InFlight(contribution, 0, averaged, adopted=True)
        return True

    def _note_overlap(self, outlasted: bool) -> None:
        # Overlap hides a round only behind the next round's training; once rounds (mostly matchmaking on a
        # fast link) outlast it, inner steps wait every round. Say so once, with the fix; three in a row, so
        # that the first round (waiting for the others to arrive) does not count.
        self._outlasted = self._outlasted + 1 if outlasted else 0
        if self._outlasted == 3:
            log.warning(
                "a round outlasted the next one's training three times in a row, so inner steps wait for the "
                "network: raise trainer.inner_steps (or round.tokens), lower outer.fragments, or lower "
                "averaging.min_matchmaking_time"
            )

    async def _settle(self, round_: InFlight, outcome: RoundOutcome) -> Event:
        self.context.contribution, self.context.outcome = round_.contribution, outcome
        self.context.sent_tokens = round_.tokens
        self.effects.exchanged(outcome.bytes_sent, outcome.bytes_received)
        if attempt(outcome).succeeded:
            self.joining.synced_short = False
            self.timer.last_group = outcome.group_size
        await self.parts.averaging.judge(outcome)
        facts = await self.facts()
        if not self.machine.overlapped:  # whatever came of it, the round we train next opens now
            self._reopen = (None,)
        return Averaged(replace(attempt(outcome), adopted=round_.adopted), facts)

    # ---- re-syncing -----------------------------------------------------------------------------------------
    async def _download(self, min_step: int) -> Event:
        self.effects.doing(Phase.SYNCING)
        download = asyncio.create_task(self.parts.sync.catch_up(min_step, self.joining.announce))
        stop = asyncio.create_task(self._stopping.wait())
        await asyncio.wait({download, stop}, return_when=asyncio.FIRST_COMPLETED)
        await cancelled_quietly(stop)  # type: ignore[arg-type]
        if not download.done():  # a state download is ours alone: leave at once
            await cancelled_quietly(download)  # type: ignore[arg-type]
            return Stopping()
        result = download.result()
        facts = await self.facts()
        if not result.adopted:
            self._reopen = (None,)
            self.effects.joined()
            await published_quietly(self.parts.publisher)  # the run's clock stops waiting for us
            return Synced(False, self.outer.step, facts)
        dropped = self.tokens.resynced(result.kept_progress)
        if dropped:
            log.warning(
                "re-synced from outer step %d to %d: %d tokens of our progress not yet averaged were "
                "dropped (too far behind to rebase, or outer.rebase_on_resync = false)",
                result.from_step, result.step, dropped,
            )  # fmt: skip
        self.effects.new_global()
        self._reopen = (await self.timer.run_opened(self.outer.step),)  # we join the run's round under way
        caught_up = False
        if self.machine.overlapped and result.pending is not None:
            caught_up = await self._adopt_in_flight(result.pending)
        self.joining.synced_short = self.machine.overlapped and not caught_up
        return Synced(True, self.outer.step, facts, caught_up=caught_up)
