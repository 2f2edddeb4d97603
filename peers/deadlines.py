"""Matchmaking and all-reduce deadlines that follow how long recent rounds actually took.

Fixed deadlines are wrong in both directions on the internet: set for the slowest link a run might
see, a dead peer stalls everybody for a minute every time; set for loopback, a slow link never
finishes a round. So each peer keeps the durations of its last few successful rounds and sets

    deadline = clamp(factor × the longest recent duration, floor, ceiling)

separately for matchmaking (from the start of a round until the group formed) and for the all-reduce
(from then until the averages arrived). The configured timeouts are the ceilings; a peer with no
history yet (or after only failures) uses them. Failed rounds are not measured: a round cut by its
deadline says nothing about how long a healthy one takes, and feeding it back would only ever push the
deadline up to the ceiling. Pure bookkeeping, no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class DeadlineBounds:
    matchmaking_ceiling: float  # averaging.matchmaking_timeout
    matchmaking_floor: float
    allreduce_ceiling: float  # averaging.allreduce_timeout
    allreduce_floor: float
    factor: float = 3.0
    window: int = 8  # successful rounds remembered
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.factor < 1 or self.window < 1:
            raise ValueError("deadline factor must be ≥ 1 and the window ≥ 1 round")
        if self.matchmaking_floor > self.matchmaking_ceiling or self.allreduce_floor > self.allreduce_ceiling:
            raise ValueError("a deadline's floor is above its ceiling")


class AdaptiveDeadlines:
    def __init__(self, bounds: DeadlineBounds) -> None:
        self.bounds = bounds
        self._matchmaking: deque[float] = deque(maxlen=bounds.window)
        self._allreduce: deque[float] = deque(maxlen=bounds.window)

    def set_allreduce_ceiling(self, ceiling: float) -> None:
        """A new ceiling for the all-reduce (an auto deadline that follows the measured link)."""
        b = self.bounds
        self.bounds = replace(b, allreduce_ceiling=ceiling, allreduce_floor=min(b.allreduce_floor, ceiling))

    def observe(self, matchmaking_seconds: float, allreduce_seconds: float) -> None:
        """Record one successful round's two phases."""
        self._matchmaking.append(max(0.0, matchmaking_seconds))
        self._allreduce.append(max(0.0, allreduce_seconds))

    @property
    def matchmaking(self) -> float:
        b = self.bounds
        return _deadline(self._matchmaking, b.factor, b.matchmaking_floor, b.matchmaking_ceiling, b.adaptive)

    @property
    def allreduce(self) -> float:
        b = self.bounds
        return _deadline(self._allreduce, b.factor, b.allreduce_floor, b.allreduce_ceiling, b.adaptive)


def _deadline(recent: deque[float], factor: float, floor: float, ceiling: float, adaptive: bool) -> float:
    if not adaptive or not recent:
        return ceiling
    return min(ceiling, max(floor, factor * max(recent)))


def allreduce_cancelled_reason(elapsed: float, deadline: float | None) -> str:
    """Why an all-reduce task was cancelled, for the round's failure reason: hivemind cancels it when the
    all-reduce deadline passes (and the daemon when it stops), and a bare `CancelledError()` told a user
    neither which nor how long the round had."""
    if deadline is not None and elapsed >= 0.95 * deadline:
        return (
            f"all-reduce timed out after {elapsed:.1f} s (deadline {deadline:.1f} s): "
            "a member or reducer was too slow this round"
        )
    return f"all-reduce cancelled after {elapsed:.1f} s (the round was stopped)"
