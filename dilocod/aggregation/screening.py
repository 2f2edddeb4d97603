"""Screening: drop a sender's copy of a part before reduction when it is obviously bad.

A row is zeroed (weight 0) when it holds NaN/±Inf, or when its L2 norm exceeds ``norm_ratio × M``, where
M is the median norm of the rows that are included and finite (the mean of the two middle norms for an
even count). Fewer than half lying senders cannot move M outside the honest rows' range of norms, so an
honest row is only dropped if it is itself ``norm_ratio`` times bigger than some honest row's norm.
Caveat: if more than half the included rows are exactly zero, M = 0 and every non-zero row is dropped —
right when the honest majority really sent zeros, harsh if zeros are a coincidence.

Wrong shape/dtype is checked by the caller before stacking. Norms are computed in float64 in a fixed order
(``_det``), so the decision is the same under any thread count and never overflows for finite float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dilocod.aggregation._det import median_1d, row_sq_norms


@dataclass(frozen=True)
class ScreeningConfig:
    norm_ratio: float = 10.0  # TOML key averaging.screen_norm_ratio

    def validate(self) -> None:
        ok = isinstance(self.norm_ratio, int | float) and not isinstance(self.norm_ratio, bool)
        if not ok or not math.isfinite(self.norm_ratio) or self.norm_ratio < 1:
            raise ValueError(
                f"averaging.screen_norm_ratio must be a finite number >= 1, got {self.norm_ratio!r}"
            )


def screen(stacked: torch.Tensor, weights: torch.Tensor, cfg: ScreeningConfig) -> torch.Tensor:
    """A new weights tensor: ``weights`` with non-finite and oversized included rows set to 0."""
    if stacked.dim() != 2 or weights.shape != (stacked.shape[0],):
        raise ValueError(
            f"need stacked [n, d] and weights [n], got {tuple(stacked.shape)} and {tuple(weights.shape)}"
        )
    # float64 norms of every row (no copy of the included ones); NaN/Inf exactly for rows holding NaN/Inf
    norms = row_sq_norms(stacked).sqrt()
    keep = (weights > 0) & torch.isfinite(norms)
    if bool(keep.any()):
        keep &= norms <= cfg.norm_ratio * median_1d(norms[keep])
    return torch.where(keep, weights, torch.zeros_like(weights))


def faulty(before: torch.Tensor, after: torch.Tensor) -> list[int]:
    """Indices of the rows that ``screen`` newly zeroed (included in ``before``, excluded in ``after``)."""
    if before.shape != after.shape:
        raise ValueError(f"weights shapes differ: {tuple(before.shape)} vs {tuple(after.shape)}")
    return [int(i) for i in ((before > 0) & ~(after > 0)).nonzero().flatten().tolist()]
