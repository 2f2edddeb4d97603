"""The reduction a reducer runs on one part, the check a member runs on an average it receives, and, for the
sparse codec whose parts are relayed, how a reducer weighs the rows every member combines.

These are the functions the networking layer is given (it knows nothing of robust statistics):
screening drops rows that are non-finite or far larger than the group's median norm, then the
configured reducer combines the rest. `mean` is the undefended baseline: it screens only non-finite
rows, so that the benchmark can show what the defenses buy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dilocod.aggregation.reducers import ReducerSettings, make_reducer
from dilocod.aggregation.screening import ScreeningSettings, faulty, screen
from dilocod.aggregation.sparse import clip_coefficients
from dilocod.aggregation.verify import average_bound, plausible_average

PartReduce = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, list[int]]]
PartCheck = Callable[[torch.Tensor, torch.Tensor, float], bool]
PartWeigh = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, list[int]]]

# A receiver knows only its own copy of a part; it assumes the group's median norm is at most this
# many times its own (see verify.py for what a too-small estimate costs).
OWN_NORM_SLACK = 10.0
# A member carrying a small share of the typical tokens (a late joiner) holds a small Δ: its estimate
# of the group's norm is scaled up by 1/share, but never past this (a weight-0 member checks finiteness).
MAX_SHARE_SCALE = 100.0


def make_part_reduce(reducer: ReducerSettings, screening: ScreeningSettings) -> PartReduce:
    reduce = make_reducer(reducer)
    defended = reducer.name != "mean"

    def reduce_part(stacked: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        if defended:
            kept = screen(stacked, weights, screening)
        else:
            finite = torch.isfinite(stacked).all(dim=1)
            kept = torch.where(finite, weights, torch.zeros_like(weights))
        return reduce(stacked, kept), faulty(stacked, weights, kept, screening if defended else None)

    return reduce_part


def make_part_weigh(screening: ScreeningSettings) -> PartWeigh:
    """How a reducer weighs a part of top-k payloads, which every member then combines: screening as for the
    dense reducers, then the sparse rule's coefficients (`sparse.py`: each row clipped to the group's norm
    bound, the mean over every member's weight). Copied supports are not judged: honest members' top-k
    supports overlap by 40 % or more in every round of the test swarm (their Δs start from one θ_global), so
    overlap is no evidence; a copy's values are clipped like any row's."""

    def weigh_part(stacked: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        kept = screen(stacked, weights, screening)
        return clip_coefficients(stacked, kept), faulty(stacked, weights, kept, screening)

    return weigh_part


def make_part_check(screening: ScreeningSettings) -> PartCheck:
    def check_part(averaged: torch.Tensor, own: torch.Tensor, own_share: float) -> bool:
        own_norm = float(torch.linalg.vector_norm(own.to(torch.float64)))
        if own_norm == 0.0 or own_share <= 0.0:  # nothing to compare with: only finiteness
            return bool(torch.isfinite(averaged).all())
        # Δ norms grow at most about linearly with the tokens behind them: scale our estimate to the typical member
        scale = min(MAX_SHARE_SCALE, max(1.0, 1.0 / own_share))
        reference = OWN_NORM_SLACK * own_norm * scale
        bound = average_bound(own_norm, reference, norm_ratio=screening.norm_ratio)
        return plausible_average(averaged, own, bound=bound)

    return check_part
