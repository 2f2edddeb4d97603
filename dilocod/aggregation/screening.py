"""Screening: drop a sender's copy of a part before reduction when it is obviously bad.

A row is zeroed (weight 0) when it holds NaN/±Inf, or when its L2 norm exceeds ``norm_ratio × M``, where
M is the median norm of the rows that are included and finite (the mean of the two middle norms for an
even count). Fewer than half lying senders cannot move M outside the honest rows' range of norms, so an
honest row is only dropped if it is itself ``norm_ratio`` times bigger than some honest row's norm.
Caveat: if more than half the included rows are exactly zero, M = 0 and every non-zero row is dropped —
right when the honest majority really sent zeros, harsh if zeros are a coincidence.

Dropping a row is not the same as calling its sender a liar. Contributions now differ in the tokens
behind them (a peer that carries rounds it missed, one that joined as a round closed), so an honest row
can sit an order of magnitude from the median. Only a row that holds NaN/±Inf, or whose norm exceeds
``LIAR_FACTOR`` × the screening bound (``LIAR_FACTOR × norm_ratio × M``, 50 × M by default, well
under the ×100 scale and ×1000 sign-flip attacks), makes its sender *faulty* (``faulty``): the caller
bans it.

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


# How far beyond the screening bound a row must be before its sender counts as lying (see the docstring).
LIAR_FACTOR = 5.0


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


def faulty(
    stacked: torch.Tensor, before: torch.Tensor, after: torch.Tensor, cfg: ScreeningConfig | None = None
) -> list[int]:
    """Indices of the rows ``screen`` zeroed that prove their sender lies: non-finite, or (with ``cfg``)
    beyond ``LIAR_FACTOR`` × the screening bound. Without ``cfg`` every newly zeroed row counts (the
    undefended baseline screens non-finite rows only, and those are all lies)."""
    if before.shape != after.shape:
        raise ValueError(f"weights shapes differ: {tuple(before.shape)} vs {tuple(after.shape)}")
    dropped = (before > 0) & ~(after > 0)
    if cfg is not None and bool(dropped.any()):
        norms = row_sq_norms(stacked).sqrt()
        kept = (before > 0) & torch.isfinite(norms)
        median = median_1d(norms[kept]) if bool(kept.any()) else 0.0
        dropped &= ~torch.isfinite(norms) | (norms > LIAR_FACTOR * cfg.norm_ratio * median)
    return [int(i) for i in dropped.nonzero().flatten().tolist()]
