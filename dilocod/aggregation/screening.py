"""Screening: drop a sender's copy of a part before reduction when it is obviously bad.

A row is zeroed (weight 0) when it holds NaN/±Inf, or when its L2 norm exceeds its bound
``norm_ratio × min(M, f_i × M_lo)``, over the rows that are included and finite: M is their median norm
(the mean of the two middle norms for an even count), M_lo the lower of the two middle norms (M itself
for an odd count), and f_i = the row's weight ÷ the weight of the row at M_lo, taken between 1 and
``WEIGHT_SLACK``. Fewer than half lying senders cannot move M outside the honest rows' range of norms, so
an honest row is only dropped if it is itself ``norm_ratio`` times bigger than some honest row's norm.

M_lo is for groups of two (and other even counts). There a liar holds half the rows, and M, the mean of
the two norms, follows it: a ×100 copy in a pair made M ≈ 50 × the honest norm, stayed under 10 × M, and
the pair's average was ~50 × an honest step (measured: a run's honest eval loss 51 against 2.9 clean). A
liar can pull M_lo only down, never up, so a copy more than ``norm_ratio`` × the other one's norm is
dropped. The weight factor keeps an honest pair of unequal work together: a peer that joined as the
round closed (one inner step, weight clamped to half the other's by the tickets' rule) holds a Δ ~13 ×
smaller than its partner's 20 steps, and its partner's copy still fits ``norm_ratio × 2 × M_lo``. The
bound is never above ``norm_ratio × M``, so the receiver-side check's derivation (verify.py) holds as is.
Caveat: if more than half the included rows are exactly zero, M = 0 and every non-zero row is dropped —
right when the honest majority really sent zeros, harsh if zeros are a coincidence (in a pair, one
zero row is enough: its sender's partner then gets no update, never a wrong one).

Dropping a row is not the same as calling its sender a liar. Contributions now differ in the tokens
behind them (a peer that carries rounds it missed, one that joined as a round closed), so an honest row
can sit an order of magnitude from the median. Only a row that holds NaN/±Inf, or whose norm exceeds
``LIAR_FACTOR`` × its screening bound (50 × M by default, well under the ×100 scale and ×1000
sign-flip attacks), makes its sender *faulty* (``faulty``): the caller bans it.

Wrong shape/dtype is checked by the caller before stacking. Norms are computed in float64 in a fixed order
(``_det``), so the decision is the same under any thread count and never overflows for finite float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dilocod.aggregation._det import row_sq_norms


@dataclass(frozen=True)
class ScreeningSettings:
    norm_ratio: float = 10.0  # TOML key averaging.screen_norm_ratio

    def validate(self) -> None:
        ok = isinstance(self.norm_ratio, int | float) and not isinstance(self.norm_ratio, bool)
        if not ok or not math.isfinite(self.norm_ratio) or self.norm_ratio < 1:
            raise ValueError(
                f"averaging.screen_norm_ratio must be a finite number >= 1, got {self.norm_ratio!r}"
            )


# How far beyond the screening bound a row must be before its sender counts as lying (see the docstring).
LIAR_FACTOR = 5.0
# The most a row's weight can widen its bound against the lower median's row: the tickets clamp a claim
# to 2 × the median of the others' (peers.membership.capped_tokens), so an honest pair differs by at most 2.
WEIGHT_SLACK = 2.0


def row_bounds(
    norms: torch.Tensor, weights: torch.Tensor, included: torch.Tensor, norm_ratio: float
) -> torch.Tensor:
    """Each row's screening bound (float64 [n]) against the `included` rows' norms (see the docstring)."""
    kept_norms, kept_weights = norms[included], weights[included].to(torch.float64)
    ordered, order = torch.sort(kept_norms, stable=True)
    lo, hi = (len(ordered) - 1) // 2, len(ordered) // 2
    median = (ordered[lo] + ordered[hi]) / 2
    factor = (weights.to(torch.float64) / kept_weights[order[lo]]).clamp(1.0, WEIGHT_SLACK)
    return norm_ratio * torch.minimum(median, factor * ordered[lo])


def screen(stacked: torch.Tensor, weights: torch.Tensor, cfg: ScreeningSettings) -> torch.Tensor:
    """A new weights tensor: ``weights`` with non-finite and oversized included rows set to 0."""
    if stacked.dim() != 2 or weights.shape != (stacked.shape[0],):
        raise ValueError(
            f"need stacked [n, d] and weights [n], got {tuple(stacked.shape)} and {tuple(weights.shape)}"
        )
    # float64 norms of every row (no copy of the included ones); NaN/Inf exactly for rows holding NaN/Inf
    norms = row_sq_norms(stacked).sqrt()
    keep = (weights > 0) & torch.isfinite(norms)
    if bool(keep.any()):
        keep &= norms <= row_bounds(norms, weights, keep, cfg.norm_ratio)
    return torch.where(keep, weights, torch.zeros_like(weights))


def faulty(
    stacked: torch.Tensor, before: torch.Tensor, after: torch.Tensor, cfg: ScreeningSettings | None = None
) -> list[int]:
    """Indices of the rows ``screen`` zeroed that prove their sender lies: non-finite, or (with ``cfg``)
    beyond ``LIAR_FACTOR`` × their screening bound. Without ``cfg`` every newly zeroed row counts (the
    undefended baseline screens non-finite rows only, and those are all lies)."""
    if before.shape != after.shape:
        raise ValueError(f"weights shapes differ: {tuple(before.shape)} vs {tuple(after.shape)}")
    dropped = (before > 0) & ~(after > 0)
    if cfg is not None and bool(dropped.any()):
        norms = row_sq_norms(stacked).sqrt()
        kept = (before > 0) & torch.isfinite(norms)
        if bool(kept.any()):
            beyond = norms > LIAR_FACTOR * row_bounds(norms, before, kept, cfg.norm_ratio)
        else:
            beyond = norms > 0.0
        dropped &= ~torch.isfinite(norms) | beyond
    return [int(i) for i in dropped.nonzero().flatten().tolist()]
