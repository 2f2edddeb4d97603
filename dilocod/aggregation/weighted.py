"""Per-coordinate weighted order statistics: the machinery behind ``median``, ``trimmed_mean`` and the
starting point of ``centered_clip`` (definitions in ``reducers``).

Each column of x ([k, d] float32) is sorted, and the weights are gathered by the sort indices into one
[k, d] float64 tensor, which becomes the cumulative weight C_i of each column's i-th smallest value:
summed in sorted order in float64, one explicit row at a time, so it never depends on the thread count.
With all weights exactly 1.0, C_i = i + 1 exactly, W = k and every formula below reduces to the
unweighted reducer's arithmetic, which is what keeps equal weights bit-identical.
"""

from __future__ import annotations

import torch

from dilocod.aggregation._det import ordered_sum


def _sorted(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each column sorted ascending and the row each value came from, as [k, d] tensors.

    With unequal weights the sort is stable, so equal values keep their row order: with the rows ordered
    by weight first (``reducers``), every column's (value, weight) sequence is then the same whatever the
    senders' order. A stable sort along dim 0 is slow on CPU (~3× the unstable one), so the columns are
    sorted as contiguous rows of the transpose (~1.3× faster). With equal weights (peers that trained
    the same number of tokens, the common case) the order of equal values changes nothing, and the
    unstable sort (deterministic too: one thread sorts a column) keeps the unweighted reducers' speed."""
    if bool((w == w[0]).all()):
        s, rows = torch.sort(x, dim=0)
        return s, rows
    s, rows = torch.sort(x.t().contiguous(), dim=1, stable=True)
    return s.t(), rows.t()


def _cumulative(w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[k, d] float64: the cumulative weight C_i of each column's i-th smallest value, in sorted order."""
    c = w[rows]  # each sorted value's weight: the one [k, d] float64 tensor of the weighted reducers
    for i in range(1, c.shape[0]):  # an explicit scan, row 0 first (see _det)
        c[i] += c[i - 1]
    return c


def column_median(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise weighted median of ``x`` ([k, d], k ≥ 1) with row weights ``w`` ([k] float64 ≥ 0).

    Per column: lo = the smallest value whose cumulative weight reaches W/2, hi = the smallest that
    passes it, result (lo + hi)/2 in float64 (hi = lo unless the cumulative weight hits W/2 exactly);
    +0.0 is added to normalise −0.0."""
    k = x.shape[0]
    s, rows = _sorted(x, w)
    c = _cumulative(w, rows)
    del rows
    half = ordered_sum(w.tolist()) / 2
    # C is non-decreasing down a column, so counting the values below W/2 finds lo's position (an
    # integer sum: exact in any order); rounding can leave the last C a hair under W: cap at the last row
    lo = s.gather(0, (c < half).sum(0, keepdim=True).clamp_(max=k - 1))[0].to(torch.float64)
    hi = s.gather(0, (c <= half).sum(0, keepdim=True).clamp_(max=k - 1))[0].to(torch.float64)
    return (lo + hi) / 2 + 0.0  # exact for lo = hi: (x + x)/2 = x; no overflow in float64


def column_trimmed_mean(x: torch.Tensor, w: torch.Tensor, t: int) -> torch.Tensor:
    """Coordinate-wise weighted trimmed mean of ``x`` ([k, d], k ≥ 1), cutting T = t·W/k weight per side.

    Per column, each sorted value keeps the part of its weight inside the cumulative-weight interval
    [T, W − T]; the result is Σ kept_i·x_i / (W − 2T) in float64, summed over the sorted rows in order."""
    k = x.shape[0]
    s, rows = _sorted(x, w)
    kept = _cumulative(w, rows)
    del rows
    total = ordered_sum(w.tolist())
    cut = t * total / k  # equal weights: t·k/k = t exactly
    # value i spans [C_{i−1}, C_i] of cumulative weight (C_{−1} = 0); its part inside [T, W − T] is
    # clamp(C_i) − clamp(C_{i−1}), differenced from the last row up so that it can be done in place
    kept.clamp_(min=cut, max=total - cut)
    for i in range(k - 1, 0, -1):
        kept[i] -= kept[i - 1]
    kept[0] -= cut
    # masked, not kept·x alone: a trimmed value contributes exactly +0.0 (never NaN from 0·∞, never −0.0),
    # and acc + 0.0 = acc because acc, a sum started at +0.0, is never −0.0
    trimmed = kept <= 0
    kept.mul_(s).masked_fill_(trimmed, 0.0)
    acc = torch.zeros(x.shape[1], dtype=torch.float64)
    for i in range(k):
        acc += kept[i]
    return acc / (total - 2 * cut) + 0.0  # +0.0 normalises −0.0
