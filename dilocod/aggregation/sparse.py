"""The robust rule for sparse contributions (each member sent the top-k of its Δ: `dilocod/codecs/topk.py`).

Coordinate-wise rules (median, trimmed mean, centered clip) need several values of each coordinate. With
top-k payloads a coordinate of the union of supports has on average n·d/u contributors (about one at
n = 16, d = 1.56 %), so the median of the present values is one peer's value, and counting the absent as
zeros makes it zero almost everywhere. Robustness moves to the member:

- **Norm clipping.** Each contribution (per tensor) is scaled down to at most its bound against the
  group's norms, the same bound the dense screen uses (`screening.row_bounds` with ratio 1): the median
  norm M, and for an even count the lower middle norm M_lo times the weight factor. More than half the
  group would have to lie to lift the bound; in a pair a liar can only pull it down (an honest partner of
  a peer that sent ~0 gets ~0 from it: no update that round, never a wrong one).
- **The mean divides by every member's weight**, present or not at a coordinate: an attacker that puts all
  of its k values on a few coordinates moves each by at most its (clipped) norm × its weight share, while
  dividing by the contributors there would give it the coordinate alone.
- **Copied supports.** Random vectors' top-k indices overlap at about the density, but honest members'
  do not: their Δs start from one θ_global and see the same language, and their supports overlapped by 40 %
  or more in every round of the test swarm. So overlap (`copied_pairs`, templar's 40 %) is reported by
  `aggregate` for analysis and never judged in a round: a copied support's values are clipped like any.

Deterministic: norms in float64 in a fixed order (`_det.row_sq_norms`), each member's coefficient computed
in float64 and rounded once to fp32, then added member by member in the given order into zeros with no
repeated index within one addition, so every member holding the same payloads gets the same bits.
Pure tensor code: torch only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dilocod.aggregation._det import row_sq_norms
from dilocod.aggregation.screening import row_bounds

COPY_OVERLAP = 0.4  # the share of a support found in another's that flags the pair as a copy


@dataclass(frozen=True)
class SparseRow:
    """One member's contribution to one tensor: strictly increasing positions and their values."""

    positions: torch.Tensor  # int64 [K]
    values: torch.Tensor  # float32 [K]


@dataclass(frozen=True)
class SparseAggregate:
    dense: torch.Tensor  # float32 [numel]: Σ_i w_i·c_i·x_i / Σ_i w_i
    clipped: torch.Tensor  # float64 [n]: each member's factor c_i ≤ 1 (1: not clipped)
    copies: list[tuple[int, int]]  # member pairs whose supports overlap ≥ the copy threshold


def check_row(row: SparseRow, numel: int) -> str | None:
    """Why `row` cannot be one of a tensor of `numel` values (None: it can)."""
    pos, val = row.positions, row.values
    if pos.dtype != torch.int64 or val.dtype != torch.float32 or pos.dim() != 1 or pos.shape != val.shape:
        return f"positions int64 and values float32 of one length, got {pos.dtype} {tuple(pos.shape)}, {val.dtype} {tuple(val.shape)}"
    if pos.numel() and (int(pos[0]) < 0 or int(pos[-1]) >= numel):
        return f"a position outside 0..{numel - 1}"
    if pos.numel() > 1 and bool((pos[1:] <= pos[:-1]).any()):
        return "positions that do not strictly increase"
    if not bool(torch.isfinite(val).all()):
        return "a value that is not finite"
    return None


def overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a ∩ b| / min(|a|, |b|) of two strictly increasing position tensors (0 when either is empty)."""
    if not a.numel() or not b.numel():
        return 0.0
    return int(torch.isin(a, b, assume_unique=True).sum()) / min(a.numel(), b.numel())


def copied_pairs(rows: Sequence[SparseRow], threshold: float = COPY_OVERLAP) -> list[tuple[int, int]]:
    """Pairs (i < j) of members whose supports overlap by `threshold` or more."""
    return [
        (i, j)
        for i in range(len(rows))
        for j in range(i + 1, len(rows))
        if overlap(rows[i].positions, rows[j].positions) >= threshold
    ]


def clip_factors(norms: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each member's factor (float64 [n], ≤ 1) that brings its norm to at most its bound (see the module
    docstring); members with weight 0 are left out of the bound and get 0."""
    included = weights > 0
    factors = torch.zeros_like(norms)
    if not bool(included.any()):
        return factors
    bounds = row_bounds(norms, weights, included, 1.0)
    scale = torch.where(norms > bounds, bounds / norms.clamp(min=torch.finfo(torch.float64).tiny), 1.0)
    return torch.where(included, scale, factors)


def aggregate(rows: Sequence[SparseRow], weights: torch.Tensor, numel: int) -> SparseAggregate:
    """The group's aggregate of one tensor from every member's sparse row, identical on every member that
    holds the same rows in the same order. Rows must pass `check_row` (the caller gives a failing one
    weight 0 and an empty row)."""
    if weights.shape != (len(rows),) or not bool((weights >= 0).all()):
        raise ValueError(f"need {len(rows)} non-negative weights, got {tuple(weights.shape)}")
    for i, row in enumerate(rows):
        why = check_row(row, numel)
        if why is not None:
            raise ValueError(f"member {i}'s row: {why}")
    w = weights.to(torch.float64)
    norms = torch.stack([row_sq_norms(r.values.view(1, -1))[0] for r in rows]).sqrt() if rows else w
    factors = clip_factors(norms, w)
    total = float(w.sum())
    dense = torch.zeros(numel, dtype=torch.float32)
    if total > 0:
        for row, coef in zip(rows, (w * factors / total).tolist(), strict=True):
            if coef > 0 and row.positions.numel():
                dense.index_add_(
                    0, row.positions, torch.mul(row.values, torch.tensor(coef, dtype=torch.float32))
                )
    return SparseAggregate(dense, factors, copied_pairs(rows))


def clip_coefficients(stacked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The rule above on one part of decoded payloads, as each row's coefficient (float64 [n]): wᵢ·cᵢ / Σ w over
    the rows with weight > 0 (0 for the others). `stacked` [n, d] holds each member's values, zeros off its
    support; every member combines the rows with these (`peers/partrelay.py`)."""
    w = weights.to(torch.float64)
    total = float(w.sum())
    if total <= 0:
        return torch.zeros_like(w)
    included = w > 0  # a screened row (weight 0) may hold NaN: its norm is never taken
    norms = torch.zeros_like(w)
    norms[included] = row_sq_norms(stacked[included]).sqrt()
    return w * clip_factors(norms, w) / total
