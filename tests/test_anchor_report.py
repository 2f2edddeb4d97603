"""The race's equal-tokens point taken the other way (bench/anchor/report.py): when hivemind's peers never
reach dilocod's step count, dilocod's θ_global is read at the last outer step within hivemind's."""

from __future__ import annotations

from typing import Any

from bench.anchor.report import dilocod_at_steps, spread, table

STEP_TOKENS = 100  # tokens of one inner step


def rounds(*entries: tuple[int, str, int, float | None]) -> dict[str, Any]:
    return {"rounds": [{"outer_step": s, "result": r, "tokens": t, "eval_loss": e} for s, r, t, e in entries]}


def test_the_last_outer_step_within_the_other_sides_steps_is_compared() -> None:
    # two peers, 10 inner steps per round; outer step 3 is at 30 steps each
    a = rounds((1, "ok", 1000, 2.5), (2, "ok", 1000, 2.2), (3, "ok", 1000, 2.0), (4, "ok", 1000, 1.9))
    b = rounds((1, "ok", 1000, 2.5), (2, "ok", 1000, 2.2), (3, "ok", 1000, 2.0), (4, "ok", 1000, 1.9))
    assert dilocod_at_steps([a, b], 35.0, STEP_TOKENS) == {"outer_step": 3, "steps": 30, "eval_loss": 2.0}
    assert dilocod_at_steps([a, b], 40.0, STEP_TOKENS) == {"outer_step": 4, "steps": 40, "eval_loss": 1.9}
    assert dilocod_at_steps([a, b], 5.0, STEP_TOKENS) is None  # not one round within


def test_tokens_of_failed_rounds_count_and_a_step_some_peer_missed_is_skipped() -> None:
    # peer b's round 2 failed: its tokens went into round 3 (kept progress); step 2 lacks b's record
    a = rounds((1, "ok", 1000, 2.5), (2, "ok", 1000, 2.2), (3, "ok", 1000, 2.0))
    b = rounds((1, "ok", 1000, 2.5), (2, "failed", 0, None), (3, "ok", 2000, 2.0))
    assert dilocod_at_steps([a, b], 25.0, STEP_TOKENS) == {"outer_step": 1, "steps": 10, "eval_loss": 2.5}
    assert dilocod_at_steps([a, b], 30.0, STEP_TOKENS) == {"outer_step": 3, "steps": 30, "eval_loss": 2.0}


def test_the_table_says_which_inner_optimizer_each_side_ran() -> None:
    side = {
        "steps_per_peer": 100.0,
        "rounds": 5,
        "rounds_full": 5,
        "eval_equal_time": spread([1.7]),
        "eval_equal_tokens": spread([1.8]),
        "equal_tokens_steps": 90,
    }
    result = {
        "peers": 3,
        "hivemind": {**side, "optimizer": "adamw"},
        "dilocod": {**side, "optimizer": "muon"},
    }
    assert "| inner optimizer | adamw | muon |" in table(result).splitlines()
