"""The simulated clock: a heap of timed events, popped in time order (ties in the order they were pushed,
so a seed gives one history)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

Handler = Callable[[], None]


@dataclass(order=True)
class _Entry:
    at: float
    seq: int
    handler: Handler = field(compare=False)


class EventQueue:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[_Entry] = []
        self._seq = itertools.count()

    def at(self, when: float, handler: Handler) -> None:
        """Run `handler` at simulated time `when` (never before now)."""
        heapq.heappush(self._heap, _Entry(max(when, self.now), next(self._seq), handler))

    def after(self, delay: float, handler: Handler) -> None:
        self.at(self.now + delay, handler)

    def run_until(self, done: Callable[[], bool], horizon: float) -> None:
        """Pop events until `done()` or the horizon (a run that stalls still ends)."""
        while self._heap and not done():
            entry = heapq.heappop(self._heap)
            if entry.at > horizon:
                self.now = horizon
                return
            self.now = entry.at
            entry.handler()
