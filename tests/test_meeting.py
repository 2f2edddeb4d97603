"""Training on past H to meet peers about to finish their round (dilocod/meeting.py)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from dilocod.config import load_config
from dilocod.meeting import extra_steps_to_meet
from dilocod.trainer import StepStats

NOW = 1_000.0
H = 40
TOKENS = 512  # tokens per inner step


def record(step: int, round_steps: int | None, steps_per_second: float, age: float = 0.0) -> dict[str, Any]:
    return {
        "outer_step": step,
        "round_steps": round_steps,
        "tokens_per_second": steps_per_second * TOKENS,
        "time": NOW - age,
    }


def meet(records: list[dict[str, Any]], *, mine: float = 10.0, fraction: float = 0.5) -> tuple[int, int]:
    return extra_steps_to_meet(
        records,
        7,
        now=NOW,
        sync_every=H,
        tokens_per_step=TOKENS,
        my_steps_per_second=mine,
        wait_fraction=fraction,
        window=1.0,
        max_age=5.0,
    )


def test_a_slightly_slower_peer_is_met_by_training_until_it_is_due() -> None:
    # 10 steps to go at 5 steps/s: due in 2 s; we train 2 − 1/2 s more at 10 steps/s
    assert meet([record(7, 30, 5.0)]) == (15, 1)


def test_the_record_age_moves_the_peer_on_at_its_speed() -> None:
    # the same peer, its record 1 s old: 5 steps further, due in 1 s
    assert meet([record(7, 30, 5.0, age=1.0)]) == (5, 1)


def test_the_last_peer_due_sets_the_wait_and_all_due_are_counted() -> None:
    assert meet([record(7, 30, 5.0), record(7, 35, 5.0)]) == (15, 2)


def test_peers_in_matchmaking_or_due_within_the_window_need_no_wait() -> None:
    assert meet([record(7, 40, 5.0)]) == (0, 0)  # at H: in matchmaking now
    assert meet([record(7, 38, 5.0)]) == (0, 0)  # due in 0.4 s: within half the window
    assert meet([record(7, 52, 5.0)]) == (0, 0)  # training past H itself (it waits for someone)


def test_peers_far_behind_at_other_steps_stale_or_silent_are_not_waited_for() -> None:
    # due in 6 s, beyond half a round of ours (H / 10 steps/s × 0.5 = 2 s)
    assert meet([record(7, 10, 5.0)]) == (0, 0)
    assert meet([record(6, 30, 5.0), record(8, 30, 5.0)]) == (0, 0)  # another outer step
    assert meet([record(7, 30, 5.0, age=6.0)]) == (0, 0)  # older than max_age: it may be gone
    assert meet([record(7, 30, 5.0, age=-6.0)]) == (0, 0)  # a clock far ahead
    assert meet([record(7, None, 5.0)]) == (0, 0)  # a v4 record: no place in its round
    assert meet([record(7, 30, 0.0)]) == (0, 0)  # not training


def test_off_or_unknown_speed_means_no_wait() -> None:
    assert meet([record(7, 30, 5.0)], fraction=0.0) == (0, 0)
    assert meet([record(7, 30, 5.0)], mine=0.0) == (0, 0)
    # a larger fraction reaches further back: due in 4 s, within a whole round of ours (4 s)
    assert meet([record(7, 20, 5.0)], fraction=1.0) == (35, 1)


def test_late_peer_wait_is_validated() -> None:
    assert load_config(None, []).outer.late_peer_wait == 0.5
    assert load_config(None, ["outer.late_peer_wait=0"]).outer.late_peer_wait == 0.0
    for bad in ("-0.1", "1.5", "nan"):
        with pytest.raises(ValueError, match="late_peer_wait"):
            load_config(None, [f"outer.late_peer_wait={bad}"])


def test_step_stats_of_two_stretches_are_one_stretch() -> None:
    joined = StepStats(40, 2.0, 20_480, 4.0).then(StepStats(10, 1.0, 5_120, 1.5))
    assert joined == StepStats(50, 1.8, 25_600, 5.5)
    assert StepStats(40, 2.0, 20_480, 4.0).then(StepStats(0, math.nan, 0, 0.0)).mean_loss == 2.0
    assert math.isnan(StepStats(0, math.nan, 0, 0.0).then(StepStats(0, math.nan, 0, 0.0)).mean_loss)
