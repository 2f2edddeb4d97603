"""Receiver-side plausibility check of an averaged part returned by another peer's reducer (issue 3, item 3).

The receiver knows its own copy ``own`` of the part and the averaged part ``avg`` it got back. Whatever an
honest reducer does, the result is bounded by the inputs it reduced. Let N be the largest norm among the
rows the reducer included, ŵ_i their normalised weights and W = Σ ŵ_i. Then for every reducer in
``reducers``, whatever the weights:

- mean: a convex combination of the rows, so ‖avg‖ ≤ N;
- median: at least half the weight of a coordinate lies on values with |x_ij| ≥ |m_j| (those ≤ lo if
  m_j < 0, those ≥ hi otherwise), so ‖m‖² ≤ (2/W)·Σ ŵ_i‖x_i‖² ≤ 2N²;
- trimmed_mean (T = t·W/k cut per side): for a_j ≥ 0 (a_j < 0 is the mirror image) the kept weight
  W − 2T averages to a_j, so it holds Σ x² ≥ (W − 2T)·a_j² (Jensen), and the top T weight lies on values
  ≥ the largest kept one ≥ a_j; so a_j² ≤ Σ_i ŵ_i·x_ij² / (W − T) and ‖a‖² ≤ N²·W/(W − T) = N²·k/(k − t)
  < 2N² (t ≤ (k−1)/2);
- centered_clip: every step is a convex combination of v and the inputs, starting from the median, so
  ‖avg‖ ≤ max(‖median‖, N) ≤ √2·N.

So ‖avg‖ ≤ √2·N ≤ √3·N (the check keeps the factor √3 it shipped with) and ‖avg − own‖ ≤ ‖own‖ + √3·N. Screening at the reducer bounds N ≤ norm_ratio·M, where M
is the median norm of the included rows; with fewer than half lying senders M is at most the largest honest
norm of that part. ``average_bound`` turns this into the rule

    bound = ‖own‖ + √3 · norm_ratio · M_ref,

where M_ref is the caller's estimate of M (e.g. the median of part norms it has seen from honest peers, or
``slack × ‖own‖`` when it knows nothing else). ``plausible_average`` then rejects a result that has the
wrong shape, any NaN/Inf, or ‖avg − own‖ > bound.

False positives: none when the reducer is honest, screens with the same ``norm_ratio`` and M_ref ≥ M. The
risk is an M_ref that is too small — e.g. ``slack × ‖own‖`` when the receiver's own pseudo-gradient is more
than ``slack`` times smaller than the group's median one for this part — and a broken receiver: a
non-finite ``own`` makes the distance NaN and the check fail. False negatives: this is a cheap sanity check
(one pass over the part) that catches garbage — non-finite or blown-up results, e.g. a ×1000 scaled or
random vector; a lying reducer that returns a wrong vector of plausible norm (a zero vector, a sign flip of
a typical row) passes it and needs a stronger check (redundant reduction by a second peer).
"""

from __future__ import annotations

import math

import torch

from dilocod.aggregation._det import vector_norm

# a bound on ‖honest reducer output‖ / N for every reducer. The docstring's arguments give √2; √3 is the
# bound this check shipped with (an older, looser argument for trimmed_mean) and is kept: a slightly
# looser check of garbage, never a false positive.
REDUCER_NORM_FACTOR = math.sqrt(3.0)


def average_bound(own_norm: float, reference_norm: float, *, norm_ratio: float) -> float:
    """The bound ‖own‖ + √3·norm_ratio·M_ref on ‖avg − own‖ for an honest, screening reducer."""
    return own_norm + REDUCER_NORM_FACTOR * norm_ratio * reference_norm


def plausible_average(averaged: torch.Tensor, own_part: torch.Tensor, *, bound: float) -> bool:
    """True iff ``averaged`` has ``own_part``'s shape, is finite and lies within ``bound`` of it (L2)."""
    if math.isnan(bound) or bound < 0:
        raise ValueError(f"bound must be a number >= 0, got {bound!r}")
    if averaged.shape != own_part.shape or not bool(torch.isfinite(averaged).all()):
        return False
    # float64 difference: no overflow for finite float32 inputs; NaN (a broken own part) compares False
    return vector_norm(averaged.to(torch.float64) - own_part.to(torch.float64)) <= bound
