"""Robust reducers for one part of the butterfly all-reduce.

A reducer receives ``stacked`` ([n, d] float32, one row per sender, all copies of the same part) and
``weights`` ([n], any real dtype: the tokens behind each sender's contribution, e.g. 20480.0, 6826.0, 0.0)
and returns the reduced part ([d] float32). A row is *included* iff its weight is finite and > 0 (NaN and
+∞ exclude: a weight that is not a number of tokens says nothing). Excluded rows are dropped before any
arithmetic, so they cannot influence the output even when they hold NaN/Inf. Let x_1..x_k be the included
rows and ŵ_i = w_i / max_j w_j their weights normalised in float64 (equal weights become exactly 1.0),
W = Σ ŵ_i summed in row order in float64. Everything below works in float64 and casts to float32 once.

- ``mean``: Σ ŵ_i·x_i / W (rows summed in the given order).
- ``median``: coordinate-wise weighted median. Per coordinate, sort the values with their weights; lo = the
  smallest value whose cumulative weight reaches W/2, hi = the smallest whose cumulative weight passes
  W/2; the median is (lo + hi)/2. So hi = lo unless the cumulative weight at lo is exactly W/2, and then
  the median is the mean of lo and the next value (for equal weights and even k: the two middle values).
  Attackers holding less than half the total weight cannot move a coordinate outside the honest rows'
  range for it (every value below the honest minimum, or above the maximum, is theirs: < W/2 weight).
- ``trimmed_mean``: t = ``trim_count(k, trim_fraction)`` = min(max(⌊f·k⌋, 1), ⌊(k−1)/2⌋) for f > 0 and
  k ≥ 3, else 0, and T = t·W/k is the weight cut from each side (t rows for equal weights). Per
  coordinate, sort the values with their weights; each keeps the part of its weight that lies inside the
  cumulative-weight interval [T, W − T]; the result is Σ kept_i·x_i / (W − 2T). The "at least 1" makes
  small groups robust (4 peers × 0.2 = 0.8 would otherwise trim nothing); the cap keeps W − 2T ≥ W/k
  (k = 3 with equal weights gives the median). Attackers holding at most T weight cannot move a
  coordinate outside the honest rows' range: values below the honest minimum (or above the maximum) lie
  in [0, T] (or [W − T, W]) of cumulative weight and keep nothing. Unequal weights can make that weaker
  than "t attackers": a heavy attacker is only partly trimmed.
- ``centered_clip`` (Karimireddy et al. 2021; BTARD, Gorbunov et al. 2022): v₀ = the weighted median,
  then v ← v + Σ ŵ_i·c_i·(x_i − v) / W with c_i = min(1, τ/‖x_i − v‖), for at most ``iters`` steps,
  stopping early once ‖step‖ ≤ tol·‖v‖. Each step is a convex combination of v and the x_i
  (v' = (1 − Σ ŵ_i·c_i/W)·v + Σ ŵ_i·c_i·x_i/W with c_i ∈ [0, 1]), so the result stays in the hull of the
  median and the inputs, and one row moves v by at most ŵ_i·τ/W per step.
  τ = None picks ``AUTO_TAU_FACTOR`` × the weighted median (same rule) of the distances ‖x_i − v₀‖: the
  typical distance of a sender from the median. With attackers holding less than half the weight, that
  median distance is at most the largest honest distance, so they cannot inflate τ; honest rows farther
  out than the typical one are clipped only mildly. The price of robustness: attackers of weight A far
  away, always clipped, pull with A·τ/W in total, so at a fixed point where the honest rows (weight H)
  are unclipped v sits ≈ A·τ/H from the honest weighted mean (vs. unbounded for the mean);
  ``tests/test_aggregation.py`` asserts ‖v − honest mean‖ ≤ 2·D (D = the diagonal of the honest bounding
  box) for fewer than half the rows at equal weights and for up to 45 % of the weight. As the attackers'
  share nears one half the bound grows: clipped honest rows pull back with H·τ only once v is far enough
  for their pulls to point the same way, so in the worst geometry the fixed point lies
  ≈ (D/2)/√(1 − (A/H)²) away (e.g. 2.5·D after 200 steps at 49.9 %); every step moves v by at most τ.

Equal weights (any positive constant) give output bit-identical to the unweighted reducers (ŵ = 1.0, so
every scale is 1.0 or CenteredClip's c_i, W = k, the cut T = t, the kept fractions are exactly 0 or 1, and
a trimmed value adds exactly +0.0); ``tests/test_aggregation.py`` checks it against a frozen copy.

Preconditions: included rows are finite (run ``screening.screen`` first); a non-finite included row
yields NaN in ``mean``/``centered_clip`` (the sort-based reducers order NaN last, like +∞).

Determinism: the same inputs give bit-identical outputs whatever the thread count (see ``_det`` and
``weighted``): sums over rows, cumulative weights included, run in a fixed row order in float64.
Permutation invariance: exact (as values; −0.0 is normalised to +0.0) for ``median`` and ``trimmed_mean``:
they order the included rows by weight first (stable), so every column's sorted (value, weight) sequence
and every weight sum are the same whatever the senders' order. ``mean`` sums rows in the given order and
``centered_clip`` in that by-weight order (which keeps the given order among equal weights; its v₀, τ and
W are exact), so reordering senders may change the float64 rounding (not promised exact, equal to ~1e-15
relative before the cast). Ties are judged on float64 sums: where the cumulative weight is W/2 only up
to rounding (weight ratios that are not exact binary fractions), the median may come out as lo, hi or
(lo + hi)/2; all are weighted medians, and the robustness statements hold either way.
All reducers: no included row → zeros; one included row → that row; all included rows equal → that row
exactly, whatever the weights: ``median`` picks it, ``centered_clip`` starts there and never moves (every
difference is 0), and for ``mean``/``trimmed_mean`` the float64 result is within ~k²·2⁻⁵³ relative of it,
which the cast to float32 rounds back to that row for any realistic k (k² ≪ 2²⁸).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dilocod.aggregation._det import median_1d, ordered_sum, row_sq_norms, sum_rows, vector_norm
from dilocod.aggregation.weighted import column_median, column_trimmed_mean

Reducer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

REDUCER_NAMES = ("mean", "trimmed_mean", "median", "centered_clip")
# τ = AUTO_TAU_FACTOR × the weighted median sender distance from v₀ (see the module docstring)
AUTO_TAU_FACTOR = 1.0


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class ReducerSettings:
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


def _included(
    stacked: torch.Tensor, weights: torch.Tensor, *, by_weight: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The included rows (a copy) and their normalised weights ŵ (float64), after checking the inputs.

    Rows keep their given order, or with ``by_weight`` are ordered by weight (stable), which makes the
    sort-based reducers exactly permutation invariant. Indexing never reads excluded rows' values."""
    if stacked.dim() != 2 or stacked.dtype != torch.float32:
        raise ValueError(f"stacked must be a 2-D float32 tensor, got {stacked.dtype} {tuple(stacked.shape)}")
    if weights.shape != (stacked.shape[0],):
        raise ValueError(f"weights must have shape ({stacked.shape[0]},), got {tuple(weights.shape)}")
    if weights.dtype == torch.bool or weights.dtype.is_complex:
        raise ValueError(f"weights must be a real (float or integer) tensor, got {weights.dtype}")
    w = weights.to(torch.float64)
    rows = ((w > 0) & torch.isfinite(w)).nonzero().flatten()
    w = w[rows]
    if by_weight:
        order = torch.sort(w, stable=True).indices
        rows, w = rows[order], w[order]
    if w.numel() > 0:
        w = w / w.max()  # x/x = 1 exactly: equal weights become 1.0
    return stacked[rows], w


def _trivial(x: torch.Tensor) -> torch.Tensor | None:
    """The answer every reducer shares for k = 0 (zeros) and k = 1 (that row); None otherwise."""
    if x.shape[0] == 0:
        return torch.zeros(x.shape[1], dtype=torch.float32)
    if x.shape[0] == 1:
        return x[0]
    return None


def trim_count(k: int, trim_fraction: float) -> int:
    """Values cut from each side: ⌊f·k⌋, at least 1 when f > 0 and k ≥ 3, at most ⌊(k−1)/2⌋."""
    if trim_fraction <= 0 or k < 3:
        return 0
    # the epsilon keeps products like 0.3 × 10 = 2.9999… from rounding down a whole value
    return min(max(math.floor(trim_fraction * k + 1e-9), 1), (k - 1) // 2)


def mean(stacked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    x, w = _included(stacked, weights)
    if (done := _trivial(x)) is not None:
        return done
    scales = w.tolist()
    return (sum_rows(x, scales) / ordered_sum(scales)).to(torch.float32)


def median(stacked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    x, w = _included(stacked, weights, by_weight=True)
    if (done := _trivial(x)) is not None:
        return done
    return column_median(x, w).to(torch.float32)


def trimmed_mean(stacked: torch.Tensor, weights: torch.Tensor, *, trim_fraction: float = 0.2) -> torch.Tensor:
    x, w = _included(stacked, weights, by_weight=True)
    if (done := _trivial(x)) is not None:
        return done
    # sorted even when t = 0: summing sorted values is what makes the result exactly permutation invariant
    return column_trimmed_mean(x, w, trim_count(x.shape[0], trim_fraction)).to(torch.float32)


def auto_tau(distances: torch.Tensor, weights: torch.Tensor | None = None) -> float:
    """The default CenteredClip radius from the senders' distances ‖x_i − v₀‖ to the (weighted) median."""
    return AUTO_TAU_FACTOR * median_1d(distances, weights)


def centered_clip(
    stacked: torch.Tensor,
    weights: torch.Tensor,
    *,
    tau: float | None = None,
    iters: int = 20,
    tol: float = 1e-6,
) -> torch.Tensor:
    # by weight: v₀, τ and W are then exactly permutation invariant (equal weights: the given order)
    x, w = _included(stacked, weights, by_weight=True)
    if (done := _trivial(x)) is not None:
        return done
    total = ordered_sum(w.tolist())
    v = column_median(x, w)
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
            radius = auto_tau(dist, w)
        # dist > radius ≥ 0 implies dist > 0, so the division is only used where it is defined
        clip = torch.where(dist > radius, radius / dist, torch.ones_like(dist))
        step = sum_rows(diff, (w * clip).tolist()) / total  # equal weights: 1.0·c_i = c_i, total = k
        v += step
        if vector_norm(step) <= tol * vector_norm(v):
            break
    return v.to(torch.float32)


def make_reducer(cfg: ReducerSettings) -> Reducer:
    """The reducer named by ``cfg.name`` with its settings bound; raises ValueError for a bad config."""
    cfg.validate()
    if cfg.name == "mean":
        return mean
    if cfg.name == "median":
        return median
    if cfg.name == "trimmed_mean":
        return functools.partial(trimmed_mean, trim_fraction=cfg.trim_fraction)
    return functools.partial(centered_clip, tau=cfg.clip_tau, iters=cfg.clip_iters, tol=cfg.clip_tol)
