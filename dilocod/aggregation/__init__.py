"""Byzantine-robust aggregation of pseudo-gradient parts: pure tensor functions (torch + stdlib only).

``reducers`` reduce all senders' copies of one part, ``screening`` drops obviously bad copies before that,
``verify`` lets a receiver sanity-check an averaged part that another peer's reducer sent back; ``sparse`` is
the rule for top-k contributions, where coordinate-wise rules have one value a coordinate (clip each member
to the group's norm bound, divide by every member's weight, flag copied supports).
"""

from dilocod.aggregation.reducers import (
    AUTO_TAU_FACTOR,
    REDUCER_NAMES,
    Reducer,
    ReducerSettings,
    auto_tau,
    centered_clip,
    make_reducer,
    mean,
    median,
    trim_count,
    trimmed_mean,
)
from dilocod.aggregation.screening import ScreeningSettings, faulty, screen
from dilocod.aggregation.verify import REDUCER_NORM_FACTOR, average_bound, plausible_average

__all__ = [
    "AUTO_TAU_FACTOR",
    "REDUCER_NAMES",
    "REDUCER_NORM_FACTOR",
    "Reducer",
    "ReducerSettings",
    "ScreeningSettings",
    "auto_tau",
    "average_bound",
    "centered_clip",
    "faulty",
    "make_reducer",
    "mean",
    "median",
    "plausible_average",
    "screen",
    "trim_count",
    "trimmed_mean",
]
