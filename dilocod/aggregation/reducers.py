"""Robust reducers for one part of the butterfly all-reduce.

A reducer receives ``stacked`` ([n, d] float32, one row per sender, all copies of the same part) and
``weights`` ([n], entries in {0, 1}) and returns the reduced part ([d] float32). A row is *included* iff its
weight is > 0 (NaN weights exclude); an included row counts exactly once whatever its weight, so a sender
can never count for more than one. Excluded rows are dropped before any arithmetic, so they cannot
influence the output even when they hold NaN/Inf. Let x_1..x_k be the included rows.

- ``mean``: (1/k)·Σ x_i.
- ``median``: coordinate-wise median; for even k the mean of the two middle values. With b < k/2
  arbitrary rows every coordinate stays within the honest rows' range for that coordinate.
- ``trimmed_mean``: per coordinate, sort the k values, drop t from each side, average the rest, where
  t = ``trim_count(k, trim_fraction)`` = min(max(⌊f·k⌋, 1), ⌊(k−1)/2⌋) for f > 0 and k ≥ 3, else 0.
  The "at least 1" makes small groups robust (4 peers × 0.2 = 0.8 would otherwise trim nothing); the cap
  keeps at least one value (k = 3 gives the median). With b ≤ t arbitrary rows every coordinate stays
  within the honest rows' range.
- ``centered_clip`` (Karimireddy et al. 2021; BTARD, Gorbunov et al. 2022): v₀ = coordinate-wise median,
  then v ← v + (1/k)·Σ (x_i − v)·min(1, τ/‖x_i − v‖) for at most ``iters`` steps, stopping early once
  ‖step‖ ≤ tol·‖v‖. Each step is a convex combination of v and the x_i
  (v' = (1 − c̄)·v + (1/k)·Σ c_i·x_i with c_i = min(1, τ/‖x_i − v‖) ∈ [0, 1]), so the result stays in the
  hull of the median and the inputs, and one row moves v by at most τ/k per step.
  τ = None picks ``AUTO_TAU_FACTOR`` × median_i ‖x_i − v₀‖: the typical distance of a sender from the
  median. With b < k/2 arbitrary rows, that median distance is at most the largest honest distance, so the
  attackers cannot inflate τ; honest rows farther out than the typical one are clipped only mildly.
  The price of robustness: b liars far away, always clipped, pull with b·τ in total, so at a fixed point
  where the h honest rows are unclipped v sits ≈ b·τ/h from the honest mean (vs. unbounded for the mean);
  ``tests/test_aggregation.py`` asserts ‖v − honest mean‖ ≤ 2·(diagonal of the honest bounding box).

Preconditions: included rows are finite (run ``screening.screen`` first); a non-finite included row
yields NaN in ``mean``/``centered_clip`` (the sort-based reducers order NaN last, like +∞).

Determinism: the same inputs give bit-identical outputs whatever the thread count (see ``_det``): sums over
rows run in a fixed row order in float64 and are cast to float32 once; sort-based reducers use values only.
Permutation invariance: exact (as values; −0.0 is normalised to +0.0) for ``median`` and ``trimmed_mean``,
which only sum sorted values; ``mean`` and ``centered_clip`` sum rows in the given order, so reordering
senders may change the float64 rounding (not promised exact, equal to ~1e-15 relative before the cast).
All reducers: no included row → zeros; one included row → that row; all included rows equal → that row
exactly (k·x and its division by k are exact in float64 for float32 x).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dilocod.aggregation._det import median_1d, row_sq_norms, sum_rows, vector_norm

Reducer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

REDUCER_NAMES = ("mean", "trimmed_mean", "median", "centered_clip")
# τ = AUTO_TAU_FACTOR × the median sender distance from the coordinate median (see the module docstring)
AUTO_TAU_FACTOR = 1.0


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class ReducerConfig:
    """The ``[averaging]`` reducer settings; field ``name`` is the TOML key ``averaging.reducer``."""

    name: str = "centered_clip"
    trim_fraction: float = 0.2  # fraction cut from EACH side; see trim_count for the rounding
    clip_tau: float | None = None  # CenteredClip radius; None = AUTO_TAU_FACTOR × median distance
    clip_iters: int = 20
    clip_tol: float = 1e-6  # stop once ‖step‖ ≤ clip_tol·‖v‖

    def validate(self) -> None:
        if self.name not in REDUCER_NAMES:
            raise ValueError(
                f"averaging.reducer must be one of {', '.join(REDUCER_NAMES)}, got '{self.name}'"
            )
        if not _is_number(self.trim_fraction) or not 0 <= self.trim_fraction < 0.5:
            raise ValueError(f"averaging.trim_fraction must be in [0, 0.5), got {self.trim_fraction!r}")
        if self.clip_tau is not None and (not _is_number(self.clip_tau) or self.clip_tau <= 0):
            raise ValueError(
                f"averaging.clip_tau must be a finite number > 0 (or unset), got {self.clip_tau!r}"
            )
        if not isinstance(self.clip_iters, int) or isinstance(self.clip_iters, bool) or self.clip_iters < 1:
            raise ValueError(f"averaging.clip_iters must be an integer >= 1, got {self.clip_iters!r}")
        if not _is_number(self.clip_tol) or self.clip_tol < 0:
            raise ValueError(f"averaging.clip_tol must be a finite number >= 0, got {self.clip_tol!r}")


def _included(stacked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The included rows (a copy), after checking shapes; boolean indexing never reads excluded rows' values."""
    if stacked.dim() != 2 or stacked.dtype != torch.float32:
        raise ValueError(f"stacked must be a 2-D float32 tensor, got {stacked.dtype} {tuple(stacked.shape)}")
    if weights.shape != (stacked.shape[0],):
        raise ValueError(f"weights must have shape ({stacked.shape[0]},), got {tuple(weights.shape)}")
    return stacked[weights > 0]


def _trivial(x: torch.Tensor) -> torch.Tensor | None:
    """The answer every reducer shares for k = 0 (zeros) and k = 1 (that row); None otherwise."""
    if x.shape[0] == 0:
        return torch.zeros(x.shape[1], dtype=torch.float32)
    if x.shape[0] == 1:
        return x[0]
    return None


def _sorted_median(s: torch.Tensor) -> torch.Tensor:
    """Median of each column of the column-sorted ``s`` in float64; +0.0 added to normalise −0.0."""
    k = s.shape[0]
    lo, hi = s[(k - 1) // 2].to(torch.float64), s[k // 2].to(torch.float64)
    return (lo + hi) / 2 + 0.0  # exact for odd k (x + x)/2 = x; no overflow in float64


def trim_count(k: int, trim_fraction: float) -> int:
    """Values cut from each side: ⌊f·k⌋, at least 1 when f > 0 and k ≥ 3, at most ⌊(k−1)/2⌋."""
    if trim_fraction <= 0 or k < 3:
        return 0
    # the epsilon keeps products like 0.3 × 10 = 2.9999… from rounding down a whole value
    return min(max(math.floor(trim_fraction * k + 1e-9), 1), (k - 1) // 2)


def mean(stacked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    x = _included(stacked, weights)
    if (done := _trivial(x)) is not None:
        return done
    return (sum_rows(x) / x.shape[0]).to(torch.float32)


def median(stacked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    x = _included(stacked, weights)
    if (done := _trivial(x)) is not None:
        return done
    return _sorted_median(torch.sort(x, dim=0).values).to(torch.float32)


def trimmed_mean(stacked: torch.Tensor, weights: torch.Tensor, *, trim_fraction: float = 0.2) -> torch.Tensor:
    x = _included(stacked, weights)
    if (done := _trivial(x)) is not None:
        return done
    k = x.shape[0]
    t = trim_count(k, trim_fraction)
    # sort even when t = 0: summing sorted values is what makes the result exactly permutation invariant
    kept = torch.sort(x, dim=0).values[t : k - t]
    return (sum_rows(kept) / (k - 2 * t) + 0.0).to(torch.float32)


def auto_tau(distances: torch.Tensor) -> float:
    """The default CenteredClip radius from the senders' distances ‖x_i − v₀‖ to the coordinate median."""
    return AUTO_TAU_FACTOR * median_1d(distances)


def centered_clip(
    stacked: torch.Tensor,
    weights: torch.Tensor,
    *,
    tau: float | None = None,
    iters: int = 20,
    tol: float = 1e-6,
) -> torch.Tensor:
    x = _included(stacked, weights)
    if (done := _trivial(x)) is not None:
        return done
    k = x.shape[0]
    v = _sorted_median(torch.sort(x, dim=0).values)
    radius = None if tau is None else float(tau)
    # float64 throughout: no overflow for any finite float32 input. One float64 copy of x up front is much
    # cheaper than promoting x element by element in every step's subtraction.
    xd = x.to(torch.float64)
    del x
    diff = torch.empty_like(xd)
    for _ in range(iters):
        torch.sub(xd, v, out=diff)
        dist = row_sq_norms(diff).sqrt()
        if radius is None:  # first step: the distances are from v₀, the median
            radius = auto_tau(dist)
        # dist > radius ≥ 0 implies dist > 0, so the division is only used where it is defined
        scales = torch.where(dist > radius, radius / dist, torch.ones_like(dist))
        step = sum_rows(diff, scales.tolist()) / k
        v += step
        if vector_norm(step) <= tol * vector_norm(v):
            break
    return v.to(torch.float32)


def make_reducer(cfg: ReducerConfig) -> Reducer:
    """The reducer named by ``cfg.name`` with its settings bound; raises ValueError for a bad config."""
    cfg.validate()
    if cfg.name == "mean":
        return mean
    if cfg.name == "median":
        return median
    if cfg.name == "trimmed_mean":
        return functools.partial(trimmed_mean, trim_fraction=cfg.trim_fraction)
    return functools.partial(centered_clip, tau=cfg.clip_tau, iters=cfg.clip_iters, tol=cfg.clip_tol)
