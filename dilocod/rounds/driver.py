"""The round driver: runs the pure round machine (`machine.py`) through the ports the daemon hands in.

Its loop is three lines: ask the machine what to do with the last event, perform the effects, perform
the command and turn its result into the next event. The commands are here (train until the run's clock
closes the round, average, await a round in flight, re-sync, stop); the effects are in `effects.py`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace

import torch

from dilocod.config import Config
from dilocod.diloco import OuterOptimizer
from dilocod.observability.metrics import Metrics
from dilocod.observability.peerstate import PeerState
from dilocod.rounds import clock
from dilocod.rounds.effects import Effects, RoundContext, cancelled_quietly
from dilocod.rounds.events import (
    Action,
    Attempt,
    Average,
    Averaged,
    AwaitRound,
    Begin,
    CheckRun,
    Closed,
    Download,
    Event,
    Launch,
    RunChecked,
    Stop,
    Stopping,
    Synced,
    Train,
)
from dilocod.rounds.machine import MachineSettings, RoundState, transition
from dilocod.rounds.observe import RunObserver
from dilocod.rounds.pipeline import Contribution, RoundPipeline
from dilocod.rounds.ports import Averaging, Publisher, RunView, StateSyncing, Training
from dilocod.rounds.timing import RoundTimer
from dilocod.rounds.tokens import TokenLedger
from dilocod.trust.adversary import Adversary
from dilocod.trust.bans import BanList
from peers.group import RoundOutcome
from peers.grouping import matchmaking_window
from proto import encode_ticket

log = logging.getLogger("dilocod.rounds")

ALONE_AFTER_TIMEOUTS = 4  # matchmaking timeouts without seeing another trainer before applying alone
NO_MANIFEST = "0" * 64  # a ticket's manifest when the driver runs without one (unit tests of the driver)
STOP_GRACE_SECONDS = 15.0  # a round exchanging tensors may finish serving our parts this long at a stop


@dataclass(frozen=True)
class InFlight:
    """A round averaging in the background (overlap), or one a donor handed us already averaged."""

    contribution: Contribution
    tokens: int  # tokens behind the contribution
    task: asyncio.Task[RoundOutcome]
    adopted: bool = False  # the donor's round: we were not in it, and apply it as its members do


@dataclass(frozen=True)
class Parts:
    """What the driver is handed."""

    training: Training
    averaging: Averaging
    sync: StateSyncing
    view: RunView
    publisher: Publisher


class RoundDriver:
    def __init__(
        self,
        cfg: Config,
        state: PeerState,
        metrics: Metrics,
        outer: OuterOptimizer,
        pipeline: RoundPipeline,
        tokens: TokenLedger,
        bans: BanList,
        parts: Parts,
        machine: MachineSettings,
        clock_settings: clock.ClockSettings,
        adversary: Adversary | None = None,
    ) -> None:
        self.cfg, self.state, self.metrics, self.outer = cfg, state, metrics, outer
        self.pipeline, self.tokens, self.bans, self.parts = pipeline, tokens, bans, parts
        self.machine, self.clock_settings = machine, clock_settings
        self.adversary = adversary
        self.context = RoundContext()
        self.effects = Effects(
            cfg, state, metrics, outer, pipeline, tokens, self.context,
            training=parts.training, sync=parts.sync, publisher=parts.publisher,
        )  # fmt: skip
        self.timer = RoundTimer(state, tokens, parts.view, clock_settings, cfg.net.status_interval)
        self.observer = RunObserver(
            state, outer, parts.view,
            previous=lambda: None if pipeline.previous is None else (pipeline.previous.step, pipeline.previous.sha256),
            alone_after=ALONE_AFTER_TIMEOUTS * cfg.averaging.matchmaking_timeout,
            private=machine.private,
        )  # fmt: skip
        self.facts = self.observer.facts
        self._in_flight: InFlight | None = None
        self._outlasted = 0  # rounds in a row that outlasted the next one's training (overlap)
        self._reopen: tuple[float | None] | None = None  # (when the run opened it,) of the round we open next
        # overlap: our last re-sync came without the run's round in flight, and no round has succeeded since
        self._synced_short = False

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
            self.state.round = mstate.round
            self.state.joining = self.state.joining_since = None
            if self._reopen is not None:  # a new round opens for us: its number and its clock change together
                self.effects.open_round(self._reopen[0])
                self._reopen = None
            *effects, command = actions
            for effect in effects:
                await self._effect(effect)
            if isinstance(command, Stop):
                await self._drain(STOP_GRACE_SECONDS)
                return
            # A stop is seen by every command before it starts new work; a round that completes during a
            # stop is still applied (its group applies it too), then the next command sees the stop.
            event = await self._command(command)

    async def _effect(self, effect: Action) -> None:
        if isinstance(effect, Launch):
            await self._launch()
        else:
            await self.effects.perform(effect)  # type: ignore[arg-type]

    async def _command(self, command: Action) -> Event:
        if self._stopping.is_set() and isinstance(command, Train | Average | Download):
            return Stopping()
        if isinstance(command, CheckRun):  # at start: our round is the run's, opened when it says
            self._reopen = (await self.timer.run_opened(self.outer.step),)
            return RunChecked(await self.facts())
        if isinstance(command, Train):
            return await self._train(command.hold)
        if isinstance(command, Average):
            return await self._average_now()
        if isinstance(command, AwaitRound):
            return await self._await_in_flight()
        if isinstance(command, Download):
            return await self._download(command.min_step)
        raise TypeError(f"unknown command {command!r}")

    # ---- training until the run's clock closes the round ----------------------------------------------------
    async def _train(self, hold: bool) -> Event:
        self.state.phase = "training"
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
            self.state.round, time.time(), timer.close_at, "; the run left it" if timer.left_behind else "",
            self.tokens.round, timer.group_target,
        )  # fmt: skip
        return Closed(await self.facts())

    async def _announce_training(self) -> None:
        """Tell the others' clocks at once that our tokens grow again: until our record says so, they count
        none of this round's (a record made while we evaluated or averaged says we were not training)."""
        await asyncio.sleep(0)  # the trainer task has marked the stretch of inner steps as begun
        await self._publish_quietly()

    def _should_stop(self) -> bool:
        """Called by the trainer thread before each inner step."""
        return self._stopping.is_set() or self.timer.should_stop()

    # ---- averaging -----------------------------------------------------------------------------------------
    async def _start_round(self) -> InFlight:
        contribution = await self.parts.training.run(self.pipeline.contribution)
        tokens, seconds = self.tokens.send(contribution.fragment)
        ticket = self._ticket(contribution.step, tokens, seconds)
        average = self.parts.averaging.average(contribution, ticket, self.timer.group_target)
        return InFlight(contribution, tokens, asyncio.create_task(average))

    def _ticket(self, step: int, tokens: int, seconds: float) -> bytes:
        tokens_per_second = max(0.0, self.state.tokens_per_second)
        if self.adversary is not None:
            tokens, tokens_per_second = self.adversary.claim(tokens, tokens_per_second)
        return encode_ticket(
            {
                "outer_step": step,
                "global_sha256": self.outer.sha256,
                "num_params": self.outer.num_elements,
                "role": "peer",
                "bans": self.bans.peer_ids()[-32:],
                "tokens": tokens,
                "tokens_per_second": tokens_per_second,
                "train_seconds": max(0.0, seconds),
                "manifest_hash": self.state.manifest_hash or NO_MANIFEST,
            }
        )

    async def _average_now(self) -> Event:
        self.state.phase = "averaging"
        round_ = await self._start_round()
        outcome = await self._unless_stopped(round_.task)
        if outcome is None:
            return Stopping()
        return await self._settle(round_, outcome)

    async def _unless_stopped(self, task: asyncio.Task[RoundOutcome]) -> RoundOutcome | None:
        """The round's outcome; None when a stop came first. A stop while matchmaking leaves at once; one
        while tensors are exchanged lets the round serve our parts first (others would get partial means).
        Matchmaking is also given up as soon as the run is past our round: no group can meet us there."""
        stop = asyncio.create_task(self._stopping.wait())
        left = asyncio.create_task(self._run_leaves(task))
        await asyncio.wait({task, stop, left}, return_when=asyncio.FIRST_COMPLETED)
        await cancelled_quietly(stop)  # type: ignore[arg-type]
        await cancelled_quietly(left)  # type: ignore[arg-type]
        if not task.done() and not self._stopping.is_set():  # the run left us while we were matchmaking
            await cancelled_quietly(task)  # type: ignore[arg-type]
            return RoundOutcome(
                False, 0, 0, False, False, None, 0.0, error="the run closed this round without us"
            )
        if task.done():
            return task.result()
        if self.parts.averaging.in_allreduce:
            log.info(
                "stopping after the all-reduce in progress (our parts; at most %.0fs)", STOP_GRACE_SECONDS
            )
            await asyncio.wait({task}, timeout=STOP_GRACE_SECONDS)
            if task.done():  # it completed: apply it as the rest of its group does, then stop
                return task.result()
        await cancelled_quietly(task)  # type: ignore[arg-type]
        return None

    async def _launch(self) -> None:
        """Overlap: start this round's averaging in the background; the next round opens now."""
        self._in_flight = round_ = await self._start_round()
        round_.task.add_done_callback(lambda task: self._offer_pending(round_.contribution, task))
        self.effects.open_round()
        await self.parts.publisher.publish()  # the others' clocks follow our round

    async def _await_in_flight(self) -> Event:
        assert self._in_flight is not None, "AwaitRound without a round in flight"
        round_, self._in_flight = self._in_flight, None
        waited = not round_.task.done()
        if waited:
            self.state.phase = "averaging"  # the network is slower than a round of inner steps
        outcome = await self._unless_stopped(round_.task)
        if outcome is None:
            return Stopping()
        self._note_overlap(waited and outcome.found_group and outcome.complete)
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
        averaged = asyncio.create_task(_already(RoundOutcome(True, 0, 0, True, True, pending, 0.0)))
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
        self._count_bytes(outcome.bytes_sent, outcome.bytes_received)
        if attempt(outcome).succeeded:
            self._synced_short = False
            self.timer.last_group = outcome.group_size
        await self.parts.averaging.judge(outcome)
        facts = await self.facts()
        if not self.machine.overlapped:  # whatever came of it, the round we train next opens now
            self._reopen = (None,)
        return Averaged(replace(attempt(outcome), adopted=round_.adopted), facts)

    async def _run_leaves(self, task: asyncio.Task[RoundOutcome]) -> None:
        """Return once the run is past our round while we are still matchmaking (never during an exchange)."""
        interval = min(1.0, self.cfg.net.status_interval)
        while not task.done():
            await asyncio.sleep(interval)
            if not self.parts.averaging.in_allreduce and await self.timer.run_left(self.outer.step):
                return

    def _count_bytes(self, sent: int, received: int) -> None:
        self.state.bytes_sent += sent
        self.state.bytes_received += received
        self.metrics.bytes_sent.inc(sent)
        self.metrics.bytes_received.inc(received)

    # ---- re-syncing -----------------------------------------------------------------------------------------
    async def _download(self, min_step: int) -> Event:
        self.state.phase = "syncing"
        download = asyncio.create_task(self.parts.sync.catch_up(min_step, self._announce_joining))
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
            self.state.joining = self.state.joining_since = None
            await self._publish_quietly()  # the run's clock stops waiting for us
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
        self._synced_short = self.machine.overlapped and not caught_up
        return Synced(True, self.outer.step, facts, caught_up=caught_up)

    async def _announce_joining(self, run_step: int) -> None:
        """Tell the run that we are downloading its θ_global of `run_step` to train round `run_step`: its
        clock keeps that round open for us (the others train on) until we have it.

        With overlap the group of `run_step` forms at the close that made that state, and we meet it only if
        our download beats its matchmaking window. A donor serves that round's average with its state once
        the round completed. So a peer whose last re-sync came without it, and who then missed the group,
        waits for the run's round in flight to complete before downloading (`clock.in_flight_done_at`):
        it then applies that round at the run's next close, which the hold keeps open for the download.
        A first download goes at once: on a fast link it makes the window, and waiting would cost a round."""
        if self.state.joining != run_step:
            self.state.joining, self.state.joining_since = run_step, time.time()
        await self._publish_quietly()
        if self.machine.overlapped and self._synced_short:
            await self._until_in_flight_done(run_step)

    async def _until_in_flight_done(self, run_step: int) -> None:
        opened = await self.timer.run_opened(run_step + 1)  # the round the run trains while it averages
        recent = [e.allreduce_seconds for e in list(self.state.history)[-8:] if e.result == "ok"]
        cfg = self.cfg.averaging
        window = matchmaking_window(
            cfg.min_matchmaking_time, self.timer.group_target, cfg.matchmaking_timeout, cfg.request_timeout
        )
        ready = clock.in_flight_done_at(opened, window, cfg.request_timeout, recent)
        if ready is not None:
            await asyncio.sleep(min(max(0.0, ready - time.time()), cfg.state_timeout / 2))

    async def _publish_quietly(self) -> None:
        try:
            await self.parts.publisher.publish()
        except Exception as e:  # a DHT hiccup: the periodic record follows within a status interval
            log.debug("status publish failed: %r", e)

    # ---- stopping ------------------------------------------------------------------------------------------
    async def _drain(self, grace: float) -> None:
        """A round averaging in the background that is exchanging tensors may finish serving our parts."""
        if self._in_flight is None:
            return
        task = self._in_flight.task
        self._in_flight = None
        if not task.done() and self.parts.averaging.in_allreduce:
            await asyncio.wait({task}, timeout=grace)
        await cancelled_quietly(task)  # type: ignore[arg-type]


async def _already(outcome: RoundOutcome) -> RoundOutcome:
    return outcome


def attempt(outcome: RoundOutcome) -> Attempt:
    """The machine's view of an averaging outcome."""
    return Attempt(
        found_group=outcome.found_group,
        complete=outcome.complete,
        in_majority=outcome.in_majority,
        banned=outcome.banned,
        has_average=outcome.averaged is not None,
        majority_size=outcome.majority_size,
        contributors=outcome.contributors,
        group_size=outcome.group_size,
        seconds=outcome.seconds,
        error=outcome.error,
    )
