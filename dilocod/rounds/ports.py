"""What the round driver needs from the rest of the peer, as small protocols the daemon hands in.

The driver never sees the daemon: it trains through `Training`, averages through `Averaging`, re-syncs
through `StateSyncing`, reads the run through `RunView` and publishes and checkpoints through
`Publisher`. Tests hand in fakes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from dilocod.rounds.pipeline import Contribution
from dilocod.statesync.catchup import SyncResult
from dilocod.trainer import StepStats
from peers.group import RoundOutcome

T = TypeVar("T")


class Training(Protocol):
    """The trainer thread: inner steps, and any other tensor work on the model."""

    async def train(self, should_stop: Callable[[], bool]) -> StepStats:
        """Take inner steps until `should_stop()` says so before a step (always at least one step, unless
        the peer is stopping)."""
        ...

    async def run(self, fn: Callable[[], T]) -> T:
        """Run `fn` in the trainer thread (every read or write of the model goes through it)."""
        ...

    async def evaluate(self) -> float:
        """Held-out loss of the working copy (called right after θ_global was applied to it)."""
        ...


class Averaging(Protocol):
    @property
    def in_allreduce(self) -> bool:
        """Tensors are being exchanged right now: leaving would cost the group its parts."""
        ...

    async def average(self, contribution: Contribution, ticket: bytes, group_target: int) -> RoundOutcome:
        """Average a contribution with the group at its outer step (groups of up to `group_target`)."""
        ...

    async def judge(self, outcome: RoundOutcome) -> None:
        """Count and ban the peers a round caught lying (screened senders, implausible reducers)."""
        ...


class StateSyncing(Protocol):
    async def catch_up(
        self, min_step: int, announce: Callable[[int], Awaitable[None]] | None = None
    ) -> SyncResult:
        """Download the run's state at `min_step` or later; `announce(run step)` before each download."""
        ...

    def share(self) -> None:
        """Offer our (new) θ_global and momentum to peers that re-sync."""
        ...

    def withdraw(self) -> None:
        """Stop offering our state until the next `share` (while the outer step replaces it)."""
        ...

    def share_pending(self, step: int, averaged: list[torch.Tensor]) -> None:
        """Overlap: offer with it the average of the round we launched at `step`, once it completed."""
        ...


class RunView(Protocol):
    async def records(self) -> list[dict[str, Any]]:
        """The run's live status records (every role), validated."""
        ...

    async def helpers(self) -> list[dict[str, Any]]:
        """The live records of auxiliary reducers (the bootstrap, helpers)."""
        ...

    async def manifest_differences(self, manifest_hash: str) -> tuple[str, ...]:
        """The run-wide keys on which the run's manifest with this hash differs from ours (() unknown)."""
        ...


class Publisher(Protocol):
    async def publish(self) -> None:
        """Publish our status record now."""
        ...

    async def checkpoint(self) -> None:
        """Write a checkpoint (it may finish in the background)."""
        ...


class Scoring(Protocol):
    """Contribution scoring (dilocod/node/scorer.py): optional."""

    def sent(
        self, step: int, sent: list[torch.Tensor], indices: list[int] | None, tokens: int, chunks: list[int]
    ) -> None:
        """Our contribution at `step` left (what went on the wire, what its ticket claimed)."""
        ...

    def applied(self, step: int, start: list[torch.Tensor], members: tuple[str, ...], new_hash: str) -> None:
        """A group's round at `step` was applied: θ_global was `start`, now hashes to `new_hash`; `members`:
        the group's members that held its θ_global (the ones whose Δ can be scored)."""
        ...

    def gated_peers(self) -> list[str]:
        """Peers rated below the gate: our tickets list them with our bans."""
        ...


@dataclass(frozen=True)
class Parts:
    """The ports the daemon hands the round driver."""

    training: Training
    averaging: Averaging
    sync: StateSyncing
    view: RunView
    publisher: Publisher
    # A greedy completion of the run's prompt from the model (run in the trainer thread); None: no samples.
    sample: Callable[[], str] | None = None
    scoring: Scoring | None = None  # contribution scoring (`scoring.enabled`)
