"""The round driver's `Averaging` port on a peer: its `GroupAverager`, and the judge of what a round caught."""

from __future__ import annotations

from dilocod.node.judge import Judge
from dilocod.rounds.pipeline import Contribution
from peers.group import GroupAverager, RoundOutcome


class PeerAveraging:
    def __init__(self, group: GroupAverager, judge: Judge) -> None:
        self.group, self._judge = group, judge

    @property
    def in_allreduce(self) -> bool:
        return self.group.in_allreduce

    async def average(self, contribution: Contribution, ticket: bytes, group_target: int) -> RoundOutcome:
        return await self.group.average(
            contribution.step,
            ticket,
            contribution.sent,
            subset=contribution.indices,
            group_target=group_target,
        )

    async def judge(self, outcome: RoundOutcome) -> None:
        await self._judge.judge(outcome)
