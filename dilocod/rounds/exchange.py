"""One round's averaging as the driver sees it: the ticket we send, the group we ask for, and waiting for the
outcome until a stop or the run moving past our round ends the wait."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from dilocod.rounds.core import RoundCore
from dilocod.rounds.effects import cancelled_quietly
from dilocod.rounds.events import Attempt
from dilocod.rounds.pipeline import Contribution
from dilocod.rounds.ports import Parts
from dilocod.rounds.timing import RoundTimer
from dilocod.trust.bans import BanList
from dilocod.trust.hooks import HONEST, Tampering
from peers.group import RoundOutcome
from proto import encode_ticket
from proto.records import TICKET_SEGMENTS

log = logging.getLogger("dilocod.rounds")

NO_MANIFEST = "0" * 64  # a ticket's manifest when the driver runs without one (unit tests of the driver)
MAX_TICKET_BANS = 32  # proto.ROUND_TICKET `bans`
STOP_GRACE_SECONDS = 15.0  # a round exchanging tensors may finish serving our parts this long at a stop


@dataclass(frozen=True)
class InFlight:
    """A round averaging in the background (overlap), or one a donor handed us already averaged."""

    contribution: Contribution
    tokens: int  # tokens behind the contribution
    task: asyncio.Task[RoundOutcome]
    adopted: bool = False  # the donor's round: we were not in it, and apply it as its members do


class Exchange:
    def __init__(
        self,
        core: RoundCore,
        timer: RoundTimer,
        parts: Parts,
        bans: BanList,
        tampering: Tampering = HONEST,
    ) -> None:
        self.settings, self.state, self.outer = core.settings, core.state, core.outer
        self.pipeline, self.tokens = core.pipeline, core.tokens
        self.timer, self.bans, self.tampering = timer, bans, tampering
        self.training, self.averaging, self.scoring = parts.training, parts.averaging, parts.scoring

    async def start(self) -> InFlight:
        """Take our contribution from the trainer and ask the network for a group to average it in."""
        contribution = await self.training.run(self.pipeline.contribution)
        tokens, seconds = self.tokens.send(contribution.fragment)
        ticket = self.ticket(contribution.step, tokens, seconds)
        if self.scoring is not None:  # kept to be served to whoever scores it
            claimed, _ = self.tampering.claimed(tokens, 0.0)
            chunks = [v for part in self.tokens.parts_sent[-TICKET_SEGMENTS:] for v in part]
            own = contribution.own if contribution.own is not None else contribution.sent
            self.scoring.sent(contribution.step, own, contribution.indices, claimed, chunks)
        average = self.averaging.average(contribution, ticket, self.timer.group_target)
        return InFlight(contribution, tokens, asyncio.create_task(average))

    def ticket(self, step: int, tokens: int, seconds: float) -> bytes:
        tokens_per_second = max(0.0, self.state.inner.tokens_per_second)
        tokens, tokens_per_second = self.tampering.claimed(tokens, tokens_per_second)
        return encode_ticket(
            {
                "outer_step": step,
                "global_sha256": self.outer.sha256,
                "num_params": self.outer.num_elements,
                "role": "peer",
                "bans": self._bans(),
                "tokens": tokens,
                "tokens_per_second": tokens_per_second,
                "train_seconds": max(0.0, seconds),
                "manifest_hash": self.state.facts.manifest_hash or NO_MANIFEST,
                # The data behind the tokens (the latest parts, if a long run of failed rounds made more).
                "chunks": [v for part in self.tokens.parts_sent[-TICKET_SEGMENTS:] for v in part] or None,
            }
        )

    def _bans(self) -> list[str]:
        """The peers we ban, and those scoring rates below the gate (most tickets listing one: weight 0)."""
        gated = self.scoring.gated_peers()[:16] if self.scoring is not None else []
        banned = [p for p in self.bans.peer_ids() if p not in gated]
        return banned[-(MAX_TICKET_BANS - len(gated)) :] + gated

    async def unless_stopped(
        self, task: asyncio.Task[RoundOutcome], stopping: asyncio.Event
    ) -> RoundOutcome | None:
        """The round's outcome; None when a stop came first. A stop while matchmaking leaves at once; one
        while tensors are exchanged lets the round serve our parts first (others would get partial means).
        Matchmaking is also given up as soon as the run is past our round: no group can meet us there."""
        stop = asyncio.create_task(stopping.wait())
        left = asyncio.create_task(self._run_leaves(task))
        await asyncio.wait({task, stop, left}, return_when=asyncio.FIRST_COMPLETED)
        await cancelled_quietly(stop)  # type: ignore[arg-type]
        await cancelled_quietly(left)  # type: ignore[arg-type]
        if not task.done() and not stopping.is_set():  # the run left us while we were matchmaking
            await cancelled_quietly(task)  # type: ignore[arg-type]
            return RoundOutcome(
                False, 0, 0, False, False, None, 0.0, error="the run closed this round without us"
            )
        if task.done():
            return task.result()
        if self.averaging.in_allreduce:
            log.info(
                "stopping after the all-reduce in progress (our parts; at most %.0fs)", STOP_GRACE_SECONDS
            )
            await asyncio.wait({task}, timeout=STOP_GRACE_SECONDS)
            if task.done():  # it completed: apply it as the rest of its group does, then stop
                return task.result()
        await cancelled_quietly(task)  # type: ignore[arg-type]
        return None

    async def drain(self, round_: InFlight | None, grace: float = STOP_GRACE_SECONDS) -> None:
        """At a stop, a round averaging in the background that is exchanging tensors may finish serving
        our parts."""
        if round_ is None:
            return
        if not round_.task.done() and self.averaging.in_allreduce:
            await asyncio.wait({round_.task}, timeout=grace)
        await cancelled_quietly(round_.task)  # type: ignore[arg-type]

    async def _run_leaves(self, task: asyncio.Task[RoundOutcome]) -> None:
        """Return once the run is past our round while we are still matchmaking (never during an exchange)."""
        interval = min(1.0, self.settings.status_interval)
        while not task.done():
            await asyncio.sleep(interval)
            if not self.averaging.in_allreduce and await self.timer.run_left(self.outer.step):
                return


async def already(outcome: RoundOutcome) -> RoundOutcome:
    """A round a donor already averaged, as a task's coroutine."""
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
