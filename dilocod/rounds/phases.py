"""Where a round's fixed cost goes: the seconds between two stretches of inner steps, by phase.

A peer trains, the run's clock closes the round, and until the next inner step the trainer waits: it
computes Δ, matchmakes, all-reduces, takes the outer step, evaluates, samples, checkpoints, publishes.
With overlap it launches the round and only waits for a round in flight that outlasted the next one's
training. `PhaseTimes` adds up those seconds per phase; the driver closes the tally as the next stretch
of inner steps begins, and `/api/status` shows it (`last_round_phases`), as does each round's record.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

# The phases, in the order a round goes through them (for display).
PHASES = (
    "close",  # the pseudo-gradient taken from the working copy (and, with overlap, the round launched)
    "matchmaking",  # until the group's all-reduce began
    "allreduce",  # the exchange of tensors
    "waiting",  # overlap: a round in flight still averaging when the next round closed
    "outer_step",  # θ_global's step and the working copy reset
    "eval",  # the new θ_global's eval loss
    "sample",  # a completion of the run's prompt
    "checkpoint",  # building the checkpoint (it is written in the background)
    "publish",  # our status record into the DHT
    "sync",  # a state download (re-sync)
    "other",  # records, checks of the run, keeping progress
)


class PhaseTimes:
    """Seconds per phase since the last stretch of inner steps."""

    def __init__(self) -> None:
        self.current: dict[str, float] = {}

    def add(self, phase: str, seconds: float) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown round phase {phase!r}")
        self.current[phase] = self.current.get(phase, 0.0) + max(0.0, seconds)

    def exchange(self, waited: float, allreduce_seconds: float) -> None:
        """An averaging wait: the all-reduce the outcome measured, the rest matchmaking."""
        allreduce = min(max(0.0, allreduce_seconds), max(0.0, waited))
        self.add("matchmaking", waited - allreduce)
        self.add("allreduce", allreduce)

    @contextlib.contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - started)

    def close(self) -> dict[str, float]:
        """The tally since the last close, in PHASES order, rounded to ms; a new tally starts."""
        tally, self.current = self.current, {}
        return {phase: round(tally[phase], 3) for phase in PHASES if phase in tally}
