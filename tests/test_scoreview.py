"""What `/api/run` `scoring` says about each peer: the rating a trainer checked, or one folded from every
verdict as published (the bootstrap), whether it is gated, and its latest verdicts, newest first."""

from __future__ import annotations

from dilocod.observability.scoreview import LAST_SCORES, score_view
from dilocod.trust.scoring import Rating, RatingRule, Verdict

RULE = RatingRule()


def test_verdicts_as_published_fold_into_ratings_and_the_latest_come_first() -> None:
    verdicts: list[Verdict] = [(1, "s1", "bad", False), (2, "s2", "bad", False), (1, "s2", "good", True)]
    view = score_view(verdicts, RULE)
    assert view["verified"] is False and view["gate"] == RULE.gate
    bad, good = view["peers"]["bad"], view["peers"]["good"]
    assert bad["gated"] and bad["rating"] == 0.125 and bad["failures"] == 2
    assert [v["outer_step"] for v in bad["last_scores"]] == [2, 1]
    assert bad["last_scores"][0] == {"outer_step": 2, "scorer": "s2", "passed": False}
    assert not good["gated"] and good["rating"] == 0.75


def test_a_trainer_shows_the_ratings_it_checked_not_every_published_verdict() -> None:
    # A verdict the trainer could not check (a scorer not assigned that peer) is listed but does not rate.
    verdicts: list[Verdict] = [(3, "liar", "honest", False)]
    checked = {"honest": Rating(0.875, 0, 3)}
    view = score_view(verdicts, RULE, checked)
    assert view["verified"] is True
    assert view["peers"]["honest"]["rating"] == 0.875 and not view["peers"]["honest"]["gated"]
    assert view["peers"]["honest"]["last_scores"] == [{"outer_step": 3, "scorer": "liar", "passed": False}]


def test_only_the_latest_verdicts_are_listed_and_duplicates_once() -> None:
    verdicts: list[Verdict] = [(step, "s", "p", True) for step in range(20)] * 2
    view = score_view(verdicts, RULE)
    assert [v["outer_step"] for v in view["peers"]["p"]["last_scores"]] == list(
        range(19, 19 - LAST_SCORES, -1)
    )
    assert score_view([], RULE) == {"verified": False, "gate": RULE.gate, "peers": {}}
