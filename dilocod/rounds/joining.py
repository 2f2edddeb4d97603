"""Joining the run's round while our state downloads: the run's clock waits for a peer that says it is
coming, and with overlap a peer that keeps missing the group waits for the round in flight first."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from dilocod.rounds import clock
from dilocod.rounds.core import RoundCore
from dilocod.rounds.effects import published_quietly
from dilocod.rounds.ports import Publisher
from dilocod.rounds.timing import RoundTimer
from peers.grouping import matchmaking_window


class Joining:
    """How we announce a download of the run's state, and when it starts."""

    def __init__(
        self,
        core: RoundCore,
        timer: RoundTimer,
        publisher: Publisher,
        overlapped: bool,
        announced: Callable[[int], None],
    ) -> None:
        self.settings, self.state, self.timer = core.settings, core.state, timer
        self.publisher, self.overlapped = publisher, overlapped
        self.announced = announced  # our status says we are joining that round (before it is published)
        # overlap: our last re-sync came without the run's round in flight, and no round has succeeded since
        self.synced_short = False

    async def announce(self, run_step: int) -> None:
        """Tell the run that we are downloading its θ_global of `run_step` to train round `run_step`: its
        clock keeps that round open for us (the others train on) until we have it.

        With overlap the group of `run_step` forms at the close that made that state, and we meet it only if
        our download beats its matchmaking window. A donor serves that round's average with its state once
        the round completed. So a peer whose last re-sync came without it, and who then missed the group,
        waits for the run's round in flight to complete before downloading (`clock.in_flight_done_at`):
        it then applies that round at the run's next close, which the hold keeps open for the download.
        A first download goes at once: on a fast link it makes the window, and waiting would cost a round."""
        self.announced(run_step)
        await published_quietly(self.publisher)
        if self.overlapped and self.synced_short:
            await self._until_in_flight_done(run_step)

    async def _until_in_flight_done(self, run_step: int) -> None:
        opened = await self.timer.run_opened(run_step + 1)  # the round the run trains while it averages
        recent = [e.allreduce_seconds for e in list(self.state.rounds.history)[-8:] if e.result == "ok"]
        cfg = self.settings
        window = matchmaking_window(
            cfg.min_matchmaking_time, self.timer.group_target, cfg.matchmaking_timeout, cfg.request_timeout
        )
        ready = clock.in_flight_done_at(opened, window, cfg.request_timeout, recent)
        if ready is not None:
            await asyncio.sleep(min(max(0.0, ready - time.time()), cfg.state_timeout / 2))
