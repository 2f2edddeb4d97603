"""Who checks whose work, what a check says, and what the checks add up to: the rules of contribution
scoring, as pure functions (no tensors, no network).

- **Assignment.** Each round, every full node scores one or two other contributors. The choice is seeded
  by the round's agreed θ_global hash, so every peer computes the same table without a message, and a
  contributor cannot pick its scorer (the hash is known only once the round before was applied).
- **A score** compares the loss on a few sequences of the chunks the contributor's ticket named before and
  after a step along its Δ, against what a *reference* Δ does to the same sequences: the scorer's own Δ of
  the round, trained from the same θ_global on other chunks, scaled down to the contributor's size. Real
  work on the claimed data lowers the loss there more than work on other data does; a zero Δ lowers
  nothing, the run's last outer update (copied) and a Δ trained on other data lower it no more than the
  reference. Comparing with a Δ rather than with random text cancels what makes one chunk easier to
  improve than another, which is the same for every Δ. Without a reference (the scorer sent no Δ that
  round) the claimed data must gain at least as much as random training text.
- **A rating** smooths a peer's scores over rounds. A new peer starts provisional; a peer whose rating falls
  below the gate counts with weight 0 until it climbs back; one that keeps failing clearly is banned.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

# ---- assignment --------------------------------------------------------------------------------------------


def _rank(seed: str, *parts: str) -> int:
    return int.from_bytes(hashlib.sha256(":".join((seed, *parts)).encode()).digest()[:8], "big")


def assign_scorers(
    round_hash: str, scorers: list[str], contributors: list[str], per_scorer: int = 2
) -> dict[str, list[str]]:
    """scorer → the contributors it scores this round. Every contributor is scored by at least one scorer
    other than itself whenever there is one; each scorer takes at most `per_scorer` (more when there are
    too few scorers to cover everyone). The same inputs give the same table on every peer."""
    table: dict[str, list[str]] = {s: [] for s in scorers}
    order = sorted(set(contributors), key=lambda c: _rank(round_hash, "target", c))
    pool = sorted(set(scorers), key=lambda s: _rank(round_hash, "scorer", s))
    if not pool:
        return table
    limit = max(per_scorer, -(-len(order) // max(1, len(pool) - 1)))
    for i, target in enumerate(order):
        candidates = [pool[(i + k) % len(pool)] for k in range(len(pool))]
        fit = [s for s in candidates if s != target and len(table[s]) < limit]
        if fit:
            table[fit[0]].append(target)
    return table


def scores_round(step: int) -> bool:
    """Whether the round that started at outer `step` is scored. Not the run's first (step 0): from the initial
    weights every Δ mostly learns what all text shares (each lowers the loss by about half on any data), so
    the claimed data's margin over the reference is a fraction of a percent either way and a verdict on it
    is noise; one such failure gated an honest, provisional late joiner in a test swarm."""
    return step >= 1


# ---- one score ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Losses:
    """Mean losses a scorer measured at θ_global (`before`) and after a step along Δ (`after`) on the
    sequences of the chunks claimed; on the claimed sequences after the step along the reference Δ (None: no
    reference); and on random training sequences (None: not measured, as with a reference)."""

    claimed_before: float
    claimed_after: float
    random_before: float | None = None
    random_after: float | None = None
    reference_after: float | None = None


@dataclass(frozen=True)
class Score:
    gain: float  # relative loss drop on the claimed data (> 0: Δ helps there)
    # the drop on the claimed data beyond the drop on random data (None: not measured)
    data_gain: float | None
    passed: bool
    reference_margin: float | None = None  # the drop on the claimed data beyond the reference Δ's drop there


MIN_GAIN = 1e-4  # a relative loss drop smaller than this is no work
MIN_DATA_GAIN = 0.0  # without a reference: the claimed data must gain at least as much as random text
MIN_REFERENCE_MARGIN = 0.0  # the claimed data must gain more from Δ than from the reference


def _finite(*values: float | None) -> bool:
    return all(v is None or (v == v and abs(v) != float("inf")) for v in values)


def score(
    losses: Losses,
    min_gain: float = MIN_GAIN,
    min_data_gain: float = MIN_DATA_GAIN,
    min_reference_margin: float = MIN_REFERENCE_MARGIN,
) -> Score:
    """The verdict on one contribution from the losses: work at all, and work on the data it claims (beyond
    the reference's gain there when there is one, beyond random text's gain when there is none)."""
    c0, c1, r0, r1 = losses.claimed_before, losses.claimed_after, losses.random_before, losses.random_after
    if not _finite(c0, c1, r0, r1, losses.reference_after) or c0 <= 0 or (r0 is not None and r0 <= 0):
        return Score(0.0, None, False)  # a loss that is not finite and positive proves nothing
    gain = (c0 - c1) / c0
    data_gain = None if r0 is None or r1 is None else gain - (r0 - r1) / r0
    if losses.reference_after is not None:
        margin = gain - (c0 - losses.reference_after) / c0
        return Score(gain, data_gain, gain > min_gain and margin > min_reference_margin, margin)
    if data_gain is None:
        return Score(gain, None, False)  # nothing to compare the claimed data's gain with
    return Score(gain, data_gain, gain > min_gain and data_gain > min_data_gain)


# ---- ratings -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RatingRule:
    smoothing: float = 0.5  # weight of the newest score
    provisional: float = 0.5  # a new peer's rating: enough to count, not enough to survive two failures
    gate: float = 0.3  # below it, a peer counts with weight 0
    ban_after: int = 4  # consecutive failed scores that get a peer banned


@dataclass(frozen=True)
class Rating:
    value: float
    failures: int = 0  # consecutive
    scored: int = 0

    @property
    def provisional(self) -> bool:
        return self.scored == 0


def new_rating(rule: RatingRule) -> Rating:
    return Rating(rule.provisional)


def rated(rating: Rating, verdict: Score, rule: RatingRule) -> Rating:
    """The rating after one more score: 1 for a pass, 0 for a failure, smoothed."""
    value = (1 - rule.smoothing) * rating.value + rule.smoothing * (1.0 if verdict.passed else 0.0)
    failures = 0 if verdict.passed else rating.failures + 1
    return replace(rating, value=value, failures=failures, scored=rating.scored + 1)


def gated(rating: Rating, rule: RatingRule) -> bool:
    """Whether the peer counts with weight 0 now."""
    return rating.value < rule.gate


def to_ban(rating: Rating, rule: RatingRule) -> bool:
    """Whether the peer has failed clearly and repeatedly enough to be banned like any liar."""
    return rating.failures >= rule.ban_after


Verdict = tuple[int, str, str, bool]  # (outer step, scorer, target, passed)


def ratings(verdicts: list[Verdict], rule: RatingRule) -> dict[str, Rating]:
    """Every scored peer's rating from the verdicts accepted so far, folded in the order of their outer
    steps (ties: scorer, then target), so that the same verdicts give the same ratings on every peer. Several
    verdicts on one peer at one step count as one: a pass only when most of them pass."""
    by_step: dict[tuple[int, str], list[bool]] = {}
    for step, _scorer, target, passed in sorted(set(verdicts)):
        by_step.setdefault((step, target), []).append(passed)
    out: dict[str, Rating] = {}
    for (_step, target), passes in sorted(by_step.items()):
        verdict = Score(0.0, None, sum(passes) * 2 > len(passes))
        out[target] = rated(out.get(target, new_rating(rule)), verdict, rule)
    return out
