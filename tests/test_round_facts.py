"""What the run's records say relative to us (dilocod/rounds/facts.py): pure functions of records."""

from __future__ import annotations

from typing import Any

from dilocod.rounds.facts import Us, diverged, late_by, other_settings, past_round, run_facts, run_step

A, B = "a" * 64, "b" * 64


def rec(peer: str, step: int, sha: str = A, **extra: Any) -> dict[str, Any]:
    return {"role": "peer", "peer_id": peer, "outer_step": step, "global_sha256": sha, **extra}


def test_the_runs_step_is_what_most_others_reached_so_one_liar_cannot_move_it() -> None:
    assert run_step([]) == -1
    assert run_step([rec("a", 7)]) == 7  # in a run of two, the other peer is the run
    assert run_step([rec("a", 7), rec("b", 7), rec("c", 6)]) == 7
    assert run_step([rec("liar", 10**6), rec("b", 5), rec("c", 5)]) == 5
    assert run_step([rec("a", 6), rec("b", 6), rec("c", 5), rec("d", 5)]) == 5  # not more than half


def test_past_our_round_needs_more_than_half_of_the_others() -> None:
    assert past_round([rec("a", 6)], round_index=5, step=5)
    assert not past_round([rec("a", 6), rec("b", 5)], round_index=5, step=5)
    assert past_round([rec("a", 5, round=6), rec("b", 5, round=6), rec("c", 5, round=5)], 5, 5)
    assert not past_round([rec("liar", 10**6), rec("b", 5), rec("c", 5)], 5, 5)
    assert not past_round([], 5, 5)


def test_diverged_when_most_trainers_at_our_step_hold_another_theta() -> None:
    us = Us("me", 5, A)
    assert diverged([rec("a", 5, B), rec("b", 5, B)], us)
    assert not diverged([rec("a", 5, B)], us)  # one against one: a tie is no reason
    assert not diverged([rec("a", 5, B), rec("b", 4, B), rec("c", 4, B)], us)  # not at our step


def test_late_by_measures_how_long_ago_the_run_opened_a_round_after_ours() -> None:
    others = [
        rec("a", 6, round_opened=100.0),
        rec("b", 6, round_opened=101.0),
        rec("c", 5, round_opened=50.0),
    ]
    assert late_by(others, step=5, now=104.0) == 3.5
    assert late_by(others, step=6, now=104.0) is None


def test_other_settings_only_when_nobody_shares_ours() -> None:
    assert (
        other_settings([rec("a", 1, manifest_hash="1" * 64), rec("b", 1, manifest_hash="1" * 64)], "2" * 64)
        == "1" * 64
    )
    assert (
        other_settings([rec("a", 1, manifest_hash="1" * 64), rec("b", 1, manifest_hash="2" * 64)], "2" * 64)
        is None
    )
    assert other_settings([rec("a", 1)], "2" * 64) is None  # older peers do not say


def test_run_facts_ignore_helpers_and_ourselves() -> None:
    records = [rec("me", 9), {"role": "helper", "peer_id": "h", "outer_step": 99}, rec("a", 5), rec("b", 5)]
    facts = run_facts(records, Us("me", 5, A), now=0.0, seen_recently=False)
    assert (facts.others, facts.best_step, facts.seen_recently, facts.diverged) == (2, 5, True, False)
