"""Judging what a round or a state download caught: count the lies and ban the liars.

A sender whose contribution our reducer screened out (non-finite or far too large), a reducer whose
average we refused as implausible, a donor whose state failed its checks: each is banned for
`averaging.ban_seconds` (persisted in the run dir), and our averager refuses to group with it. Our ban
list also travels in our tickets, so a peer most of a group bans loses its weight there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from dilocod.observability.metrics import Metrics
from dilocod.observability.peerstate import PeerState
from dilocod.trust.bans import BanList
from peers.group import RoundOutcome


class Judge:
    def __init__(
        self,
        bans: BanList,
        state: PeerState,
        metrics: Metrics,
        set_banned: Callable[[list[str]], None],
        ban_seconds: float,
    ) -> None:
        self.bans, self.state, self.metrics = bans, state, metrics
        self._set_banned, self.ban_seconds = set_banned, ban_seconds

    async def judge(self, outcome: RoundOutcome) -> None:
        """Count and ban the peers this round caught: screened senders and implausible reducers."""
        caught = [
            (p, "its contribution was screened out (non-finite or far too large)") for p in outcome.faulty
        ]
        caught += [(p, "as a reducer it returned an implausible average") for p in outcome.rejected_reducers]
        await self.punish(caught)

    async def punish(self, caught: list[tuple[str, str]]) -> None:
        caught = [(peer, reason) for peer, reason in caught if peer != self.state.peer_id]
        if not caught:
            return
        self.state.trust.rejected_contributions += len(caught)
        self.metrics.rejected_contributions.inc(len(caught))
        changed = False
        for peer, reason in caught:
            if self.bans.ban(peer, reason, self.ban_seconds):
                self.metrics.bans.inc()
                changed = True
        if changed:
            await asyncio.get_running_loop().run_in_executor(None, self._set_banned, self.bans.peer_ids())
