"""The one majority vote of the project: which value most voters hold, ties broken the same way everywhere.

Peers decide many things by counting what others report: which tickets a group follows, which θ_global
a step has, which step the run is at, whether the peers behind us all hold our previous θ_global. Every
one of those votes must come out the same on every peer that sees the same reports, so a tie is never
left to dictionary order: it goes to the smallest value (values must be orderable). Pure, no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T", bound=Hashable)


@dataclass(frozen=True)
class Vote(Generic[T]):
    """The winner of a vote, its votes, and how many votes were cast in all."""

    winner: T
    votes: int
    cast: int


def plurality(values: Iterable[T | None]) -> Vote[T] | None:
    """The most common value (None entries abstain); ties go to the smallest value; None if nobody voted."""
    counts: Counter[T] = Counter(v for v in values if v is not None)
    if not counts:
        return None
    top = max(counts.values())
    tied: list[Any] = [v for v, c in counts.items() if c == top]
    return Vote(min(tied), top, sum(counts.values()))


def votes_for(values: Iterable[T | None], value: T) -> int:
    """How many of `values` equal `value`."""
    return sum(1 for v in values if v is not None and v == value)
