"""The run's clock at work while a peer trains: when our round closes, and whether the run already left it.

While the trainer thread takes inner steps, `RoundTimer.track` re-reads the run's records (often near the
close) and keeps `close_at` up to date; the trainer asks `should_stop` before every step. It also sizes
the coming group (the live trainers in our round, plus auxiliary reducers), and notices when another
trainers are already past our round — they closed and averaged it without us (we were frozen, or a round
of ours failed while theirs completed): then there is nothing left to wait for, and the round ends at
once. "The others" means more than half of them: one peer's record claiming to be far ahead is no reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from dilocod.rounds import clock
from dilocod.rounds.core import RoundCore
from dilocod.rounds.facts import past_round, same_manifest, trainers
from dilocod.rounds.ports import RunView

log = logging.getLogger("dilocod.rounds")


class RoundTimer:
    def __init__(
        self,
        core: RoundCore,
        view: RunView,
        settings: clock.ClockSettings,
        on_estimate: Callable[[float], None] = lambda at: None,
    ) -> None:
        self.state, self.tokens, self.view, self.settings = core.state, core.tokens, view, settings
        self.status_interval = core.settings.status_interval
        self.on_estimate = on_estimate  # each new estimate of the close (it goes to the peer's status)
        self.close_at = float("inf")  # read by the trainer thread
        self.left_behind = False  # the run is past our round: stop now
        self.hold = False  # train to the clock's close even if the run is past our round
        self.group_target = 2
        self.last_group = 0  # members of our last successful round's group
        self.seconds_per_step: float | None = None  # set as the trainer times its steps

    def reset(self, hold: bool = False) -> None:
        """A new stretch of training: nothing is known about its close until the records are read."""
        self.close_at = float("inf")
        self.left_behind = False
        self.hold = hold

    def should_stop(self) -> bool:
        """Called by the trainer thread before each inner step."""
        return self.left_behind or clock.should_stop(self.close_at, time.time(), self.seconds_per_step)

    async def track(self, step: int) -> None:
        """Keep `close_at` (and `left_behind`) up to date until cancelled."""
        while True:
            wait = self.status_interval
            try:
                close = await self.estimate(step)
                wait = clock.refresh_interval(close, time.time(), self.status_interval)
            except Exception as e:  # a DHT hiccup: keep the last estimate
                log.debug("round clock: %r", e)
            await asyncio.sleep(wait)

    async def estimate(self, step: int) -> clock.Close:
        now = time.time()
        records = await self.view.records()
        round_index = self.state.rounds.round
        ours = trainers(same_manifest(records, self.state.facts.manifest_hash), self.state.peer_id)
        others = [p for r in ours if (p := clock.progress_from_record(r))]
        live = clock.in_round(others, round_index, now, self.settings.stale_after)
        arriving = clock.in_round(others, round_index - 1, now, self.settings.stale_after)
        joiners = clock.joining_records(ours, round_index, now, self.settings.stale_after)
        own = clock.Progress(
            self.state.peer_id, round_index, self.tokens.round, self.state.inner.tokens_per_second, now,
            self.state.rounds.round_opened or now, self.settings.reference_tokens,
        )  # fmt: skip
        opened = clock.round_opened([*live, own], fallback=self.state.rounds.round_opened or now)
        # A trainer whose record still shows the round before is about to join this one, and one that is
        # downloading the state to join it is awaited by the clock: the group waits for both (at most the
        # matchmaking window) rather than forming without them.
        expected = len(live) + len(arriving) + len(joiners) + 1
        self.group_target = clock.group_target(expected, len(await self.view.helpers()), self.last_group)
        close = clock.estimate_close([*live, own], self.settings, now, opened, arriving, joiners)
        self.close_at = close.at
        self.on_estimate(close.at)
        behind = past_round(
            trainers(same_manifest(records, self.state.facts.manifest_hash), self.state.peer_id),
            round_index,
            step,
        )
        if behind and not self.left_behind and not self.hold:
            self.left_behind = True
            log.debug("round %d: the run is already past it; closing now", round_index)
        log.debug(
            "round %d clock: %.0f of %d tokens from %d trainers at %.0f tokens/s, %d joining: closes at %.2f (%s)",
            round_index, close.expected, close.target, close.trainers, close.rate, len(joiners), close.at, close.by,
        )  # fmt: skip
        return close

    async def run_opened(self, round_index: int) -> float | None:
        """When the run opened `round_index`, as the trainers in it say (None: none says)."""
        now = time.time()
        records = await self.view.records()
        others = [
            p
            for r in trainers(same_manifest(records, self.state.facts.manifest_hash), self.state.peer_id)
            if (p := clock.progress_from_record(r))
        ]
        live = clock.in_round(others, round_index, now, self.settings.stale_after)
        return clock.round_opened(live, fallback=now) if live else None

    async def run_left(self, step: int) -> bool:
        """Whether the run is past our round now (one read of the records)."""
        try:
            records = await self.view.records()
        except Exception:
            return False
        return past_round(trainers(records, self.state.peer_id), self.state.rounds.round, step)
