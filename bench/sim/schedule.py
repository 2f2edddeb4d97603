"""How many inner steps each replica takes in each round: the run's clock, without a clock.

The daemon closes a round once the run's trainers together have trained `round.tokens` (by default H
inner steps × one step's tokens × the trainers), so a peer of average speed takes H steps, a faster one
more and a slower one fewer, each in proportion to its speed; with streaming a round holds 1/fragments
of that. Here time is counted in inner steps of an average-speed replica: round r covers the run's time
[r·H/F, (r+1)·H/F), and replica i, whose speed relative to the mean is ρ_i, has taken ⌊t·ρ_i⌋ steps by
time t. Exact fractions, so the total over a run does not drift with rounding.

The budget is in the same unit: S steps of an average-speed replica, the steps each replica takes when
all have the same speed and the steps the data-parallel baseline takes with M× the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class RoundPlan:
    """One round: each replica's inner steps, and what the group weighs its contributions by."""

    steps: tuple[int, ...]  # inner steps of each replica this round
    seconds: Fraction  # the round's length in steps of an average-speed replica (the claims' train time)
    # The weights the group agreed on, when they are known from elsewhere (a real run's round records);
    # None: the daemon's rule, the tokens behind each contribution capped (`peers.membership`).
    weights: tuple[float, ...] | None = None


def budget_steps(tokens: int, replicas: int, tokens_per_step: int) -> int:
    """S: the inner steps of an average-speed replica that make `tokens` across `replicas` (at least 1)."""
    if tokens < 1 or replicas < 1 or tokens_per_step < 1:
        raise ValueError("tokens, replicas and tokens per step must all be >= 1")
    return max(1, round(tokens / (replicas * tokens_per_step)))


def relative_speeds(speeds: Sequence[float] | None, replicas: int) -> tuple[Fraction, ...]:
    """Each replica's speed over the replicas' mean speed (all 1 without `speeds`)."""
    if speeds is None:
        return (Fraction(1),) * replicas
    if len(speeds) != replicas:
        raise ValueError(f"--speeds gives {len(speeds)} speeds for {replicas} replicas")
    if not all(math.isfinite(s) and s > 0 for s in speeds):
        raise ValueError(f"every speed must be a finite number > 0, got {list(speeds)}")
    # Exact fractions of the decimal the user typed: 0.1 stays 1/10, not the nearest binary float.
    exact = [Fraction(str(s)).limit_denominator(10**6) for s in speeds]
    mean = sum(exact, Fraction(0)) / len(exact)
    return tuple(s / mean for s in exact)


def plan_rounds(
    budget: int, inner_steps: int, speeds: Sequence[Fraction], fragments: int = 1
) -> list[RoundPlan]:
    """The rounds of a run of `budget` average-speed steps, rounds of H / `fragments` such steps; the
    last round is cut short at the budget."""
    if budget < 1 or inner_steps < 1 or fragments < 1:
        raise ValueError("budget, inner steps and fragments must all be >= 1")
    length = Fraction(inner_steps, fragments)
    count = math.ceil(budget / length)
    plans = []
    for r in range(count):
        start, end = r * length, min((r + 1) * length, Fraction(budget))
        steps = tuple(math.floor(end * rho) - math.floor(start * rho) for rho in speeds)
        plans.append(RoundPlan(steps, end - start))
    return plans
