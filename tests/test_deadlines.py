"""Adaptive matchmaking and all-reduce deadlines (`peers/deadlines.py`)."""

from __future__ import annotations

import pytest

from dilocod.config import ConfigError, load_config
from peers.deadlines import AdaptiveDeadlines, DeadlineBounds, allreduce_cancelled_reason

BOUNDS = DeadlineBounds(
    matchmaking_ceiling=15.0, matchmaking_floor=5.0, allreduce_ceiling=60.0, allreduce_floor=5.0, factor=3.0
)


def test_no_history_uses_the_configured_timeouts() -> None:
    deadlines = AdaptiveDeadlines(BOUNDS)
    assert (deadlines.matchmaking, deadlines.allreduce) == (15.0, 60.0)


def test_deadlines_follow_the_longest_recent_round_within_bounds() -> None:
    deadlines = AdaptiveDeadlines(BOUNDS)
    deadlines.observe(2.0, 4.0)
    deadlines.observe(3.0, 6.0)
    assert (deadlines.matchmaking, deadlines.allreduce) == (9.0, 18.0)
    deadlines.observe(0.1, 0.2)  # a fast round does not cut the deadline below the slowest recent one
    assert (deadlines.matchmaking, deadlines.allreduce) == (9.0, 18.0)
    fast = AdaptiveDeadlines(BOUNDS)
    fast.observe(0.1, 0.2)
    assert (fast.matchmaking, fast.allreduce) == (5.0, 5.0)  # floors
    slow = AdaptiveDeadlines(BOUNDS)
    slow.observe(100.0, 100.0)
    assert (slow.matchmaking, slow.allreduce) == (15.0, 60.0)  # ceilings


def test_old_rounds_leave_the_window() -> None:
    deadlines = AdaptiveDeadlines(BOUNDS)
    deadlines.observe(4.0, 15.0)  # one slow round...
    for _ in range(BOUNDS.window):
        deadlines.observe(2.0, 2.0)  # ...then a window's worth of fast ones
    assert (deadlines.matchmaking, deadlines.allreduce) == (6.0, 6.0)


def test_fixed_deadlines_when_adaptation_is_off() -> None:
    deadlines = AdaptiveDeadlines(
        DeadlineBounds(15.0, 5.0, 60.0, 5.0, adaptive=False),
    )
    deadlines.observe(1.0, 1.0)
    assert (deadlines.matchmaking, deadlines.allreduce) == (15.0, 60.0)


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="floor"):
        DeadlineBounds(5.0, 6.0, 60.0, 5.0)
    with pytest.raises(ValueError, match="factor"):
        DeadlineBounds(15.0, 5.0, 60.0, 5.0, factor=0.5)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("averaging.deadline_factor=0.5", "deadline_factor must be >= 1"),
        (
            "averaging.min_allreduce_timeout=120 averaging.allreduce_timeout=60",
            "min_allreduce_timeout must be > 0 and <=",
        ),
        ("averaging.allreduce_timeout=-1", "allreduce_timeout must be >= 0 seconds"),
        ("averaging.state_timeout=nan", "state_timeout must be >= 0 seconds"),
        ("round.max_seconds=-5", "max_seconds must be >= 0 seconds"),
        ("averaging.adaptive_deadlines=maybe", "adaptive_deadlines"),
    ],
)
def test_config_rejects_bad_deadline_settings(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, override.split())


@pytest.mark.parametrize(
    ("elapsed", "deadline", "says"),
    [
        (5.02, 5.0, "all-reduce timed out after 5.0 s (deadline 5.0 s)"),
        (4.9, 5.0, "timed out"),  # the deadline's timer and ours start a moment apart
        (1.2, 5.0, "all-reduce cancelled after 1.2 s (the round was stopped)"),
        (30.0, None, "cancelled after 30.0 s"),
    ],
)
def test_a_cancelled_allreduce_says_whether_its_deadline_passed(
    elapsed: float, deadline: float | None, says: str
) -> None:
    assert says in allreduce_cancelled_reason(elapsed, deadline)
