"""Deterministic building blocks shared by the reducers, screening and verification.

"Deterministic" here means: the same input tensors give bit-identical results whatever
``torch.get_num_threads()`` is. Element-wise ops and sorts are deterministic by construction (every output
element is computed on its own, sort's output values don't depend on the algorithm). Sums are the risk:
ATen splits a reduction whose output has a single element across threads (a two-pass reduction whose
partial sums depend on the thread count) once the input has at least ``GRAIN_SIZE`` (32768) elements,
whereas a reduction with several outputs is split across outputs, so each output is summed by one thread
in a fixed order. The helpers below therefore
- sum over rows (``n`` senders) in an explicit Python loop, row 0 first, in float64;
- sum a long vector as a fixed tree: blocks of ``_BLOCK`` (< GRAIN_SIZE) elements at a time, every level
  a multi-output reduction (or a single small one, which ATen runs serially).
``tests/test_aggregation.py`` checks the claim by running every reducer under 1 and 4 threads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# below ATen's GRAIN_SIZE (32768), so a single-output reduction of one block is never split across threads
_BLOCK = 4096


def row_sq_norms(x: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm of each row of ``x`` ([k, d], any float dtype) as float64 [k], in a fixed order.

    Accumulated in float64, so finite float32 rows never overflow (3.4e38² · 2³¹ < 1.8e308), and a row
    holding NaN/±Inf gets a NaN/Inf norm: ``isfinite`` of the result is a full finiteness check."""
    k, d = x.shape
    whole = d - d % _BLOCK
    # per-block norms ([k, d/_BLOCK] outputs, each one summed serially), then the short tail by itself
    blocks = torch.linalg.vector_norm(x[:, :whole].unflatten(1, (-1, _BLOCK)), dim=2, dtype=torch.float64)
    tail = torch.linalg.vector_norm(x[:, whole:], dim=1, dtype=torch.float64)
    s = blocks.square()
    while s.shape[1] > _BLOCK:  # only for d > _BLOCK² (16.7 M): sum the block sums block-wise again
        # pad with zeros to whole blocks: adding +0.0 never changes a sum of squares
        s = F.pad(s, (0, -s.shape[1] % _BLOCK)).unflatten(1, (-1, _BLOCK)).sum(dim=2)
    return s.sum(dim=1) + tail.square()


def vector_norm(v: torch.Tensor) -> float:
    """L2 norm of a 1-D tensor, computed in float64 in a fixed order."""
    return float(row_sq_norms(v.reshape(1, -1)).sqrt().item())


def sum_rows(x: torch.Tensor, scales: list[float] | None = None) -> torch.Tensor:
    """Σ_i scales[i]·x[i] over the rows of ``x`` in float64, row 0 first (an explicit, fixed order)."""
    acc = torch.zeros(x.shape[1], dtype=torch.float64)
    for i in range(x.shape[0]):
        acc.add_(x[i], alpha=1.0 if scales is None else scales[i])
    return acc


def ordered_sum(values: list[float]) -> float:
    """Σ values in list order in float64: the plain, fixed-order sum (from 3.12 Python's ``sum`` of floats
    is compensated, so it would not match a row-by-row tensor sum)."""
    total = 0.0
    for v in values:
        total += v
    return total


def _median_positions(sorted_weights: list[float], half: float) -> tuple[int, int]:
    """(lo, hi): the first positions whose cumulative weight is ≥ ``half`` and > ``half``.

    ``sorted_weights`` are the weights of ascending values; the cumulative weight is summed in that order
    in float64. Both positions are capped at the last one (rounding can leave the total a hair under
    2·half)."""
    lo = hi = 0
    cumulative = 0.0
    for g in sorted_weights:
        cumulative += g
        lo += int(cumulative < half)
        hi += int(cumulative <= half)
    last = len(sorted_weights) - 1
    return min(lo, last), min(hi, last)


def median_1d(values: torch.Tensor, weights: torch.Tensor | None = None) -> float:
    """Median of a non-empty 1-D tensor in float64: the mean of the two middle values for an even count.

    With ``weights`` (≥ 0, one per value, not all 0) the weighted median of ``reducers``: normalise the
    weights by their maximum, sort the values, lo = the first whose cumulative weight reaches W/2
    (W = Σ weights in the given order), hi = the first that passes it; (lo + hi)/2. Equal weights become
    exactly 1.0, so lo and hi are the two middle positions and the result is the unweighted one bit for
    bit (unnormalised, k·c/2 need not be a cumulative sum of c's: their rounding differs)."""
    s, order = torch.sort(values.to(torch.float64), stable=True)
    k = s.shape[0]
    if weights is None:
        lo, hi = (k - 1) // 2, k // 2
    else:
        if weights.shape != values.shape:
            raise ValueError(f"weights must have shape {tuple(values.shape)}, got {tuple(weights.shape)}")
        w = weights.to(torch.float64)
        w = w / w.max()
        lo, hi = _median_positions(w[order].tolist(), ordered_sum(w.tolist()) / 2)
    return float((s[lo] + s[hi]).item() / 2)
