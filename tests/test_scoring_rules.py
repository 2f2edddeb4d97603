"""The rules of contribution scoring (dilocod/trust/scoring.py) as tables."""

from __future__ import annotations

import pytest

from dilocod.trust.scoring import (
    Losses,
    RatingRule,
    assign_scorers,
    gated,
    new_rating,
    rated,
    score,
    scores_round,
    to_ban,
)

H1, H2 = "11" * 32, "22" * 32


@pytest.mark.parametrize(("step", "scored"), [(0, False), (1, True), (2, True), (500, True)])
def test_every_round_but_the_runs_first_is_scored(step: int, scored: bool) -> None:
    # from the initial weights every Δ learns what all text shares: a verdict there is noise
    assert scores_round(step) is scored


@pytest.mark.parametrize(
    ("scorers", "contributors"),
    [
        (["a", "b"], ["a", "b"]),
        (["a", "b", "c", "d"], ["a", "b", "c", "d"]),
        (["a", "b"], ["a", "b", "c", "d", "e", "f", "g"]),  # few scorers, many contributors
        (["boot"], ["a", "b", "c"]),  # a scorer that trains nothing
        ([f"p{i}" for i in range(20)], [f"p{i}" for i in range(20)]),
    ],
)
def test_every_contributor_is_scored_by_someone_else(scorers: list[str], contributors: list[str]) -> None:
    table = assign_scorers(H1, scorers, contributors)
    scored = [t for targets in table.values() for t in targets]
    assert sorted(scored) == sorted(contributors)  # each once
    assert all(scorer not in targets for scorer, targets in table.items())
    assert table == assign_scorers(H1, list(reversed(scorers)), list(reversed(contributors)))  # order-free


def test_the_assignment_changes_with_the_round_and_a_lone_scorer_cannot_score_itself() -> None:
    peers = [f"p{i}" for i in range(8)]
    assert assign_scorers(H1, peers, peers) != assign_scorers(H2, peers, peers)
    assert assign_scorers(H1, ["a"], ["a"]) == {"a": []}
    assert assign_scorers(H1, [], ["a"]) == {}


@pytest.mark.parametrize(
    ("losses", "passed"),
    [
        (Losses(3.0, 2.7, 3.0, 2.9), True),  # real work: the claimed data gains, more than random text
        (Losses(3.0, 3.0, 3.0, 3.0), False),  # a zero Δ
        (Losses(3.0, 2.9, 3.0, 2.9), False),  # the run's last update, copied: both gain alike
        (Losses(3.0, 2.95, 3.0, 2.8), False),  # trained on other data: random text gains more
        (Losses(3.0, 3.2, 3.0, 3.3), False),  # Δ hurts
        (Losses(float("nan"), 2.0, 3.0, 2.9), False),
        (Losses(0.0, 0.0, 3.0, 2.9), False),
    ],
)
def test_a_score_passes_only_real_work_on_the_claimed_data(losses: Losses, passed: bool) -> None:
    assert score(losses).passed is passed


@pytest.mark.parametrize(
    ("losses", "passed", "margin"),
    [
        # trained on the claimed data: it gains there more than the reference (work on other chunks)
        (Losses(3.0, 2.4, 3.0, 2.9, reference_after=2.8), True, 0.1333),
        # trained on other data: it gains on the claimed data as much as the reference, or less
        (Losses(3.0, 2.8, 3.0, 2.9, reference_after=2.8), False, 0.0),
        (Losses(3.0, 2.9, 3.0, 2.5, reference_after=2.7), False, -0.0667),
        # an easy chunk: random text gains less than the claimed data for every Δ; only the reference tells
        (Losses(3.0, 2.4, 3.0, 2.95, reference_after=2.4), False, 0.0),
        # a hard chunk: random text gains more, but the work is on the claimed data (beyond random < 0)
        (Losses(3.0, 2.85, 3.0, 2.7, reference_after=2.95), True, 0.0333),
        # a zero Δ beside a reference that hurts the claimed data: still no work
        (Losses(3.0, 3.0, 3.0, 3.0, reference_after=3.3), False, 0.1),
        (Losses(3.0, 2.4, 3.0, 2.9, reference_after=float("nan")), False, None),
        # a scorer with a reference measures no random text (it is not needed): the verdict is the same
        (Losses(3.0, 2.4, reference_after=2.8), True, 0.1333),
        (Losses(3.0, 2.8, reference_after=2.8), False, 0.0),
        (Losses(3.0, 2.4), False, None),  # nothing to compare the claimed data's gain with
    ],
)
def test_with_a_reference_the_claimed_data_must_gain_more_than_from_work_on_other_data(
    losses: Losses, passed: bool, margin: float | None
) -> None:
    verdict = score(losses)
    assert verdict.passed is passed
    if margin is None:
        assert verdict.reference_margin is None
    else:
        assert verdict.reference_margin == pytest.approx(margin, abs=1e-4)


def test_ratings_gate_a_failing_peer_then_ban_it_and_let_a_recovered_one_back() -> None:
    rule = RatingRule()
    good, bad = score(Losses(3.0, 2.7, 3.0, 2.9)), score(Losses(3.0, 3.0, 3.0, 3.0))
    rating = new_rating(rule)
    assert rating.provisional and not gated(rating, rule)
    steps = []
    for verdict in (bad, bad, good, good, bad, bad, bad, bad):
        rating = rated(rating, verdict, rule)
        steps.append((round(rating.value, 4), gated(rating, rule), to_ban(rating, rule)))
    assert steps == [
        (0.25, True, False),
        (0.125, True, False),
        (0.5625, False, False),  # passes bring it back
        (0.7812, False, False),
        (0.3906, False, False),  # one failure after good rounds does not gate
        (0.1953, True, False),
        (0.0977, True, False),
        (0.0488, True, True),  # four failures in a row: banned
    ]


# ---- ratings from published verdicts (dilocod/node/scorer.py folds them) ----------------------------


def test_ratings_fold_verdicts_in_step_order_whatever_order_they_were_read() -> None:
    from dilocod.trust.scoring import ratings

    rule = RatingRule()
    verdicts = [
        (3, "s1", "bad", False),
        (1, "s2", "bad", False),
        (2, "s1", "good", True),
        (1, "s1", "good", True),
    ]
    a = ratings(verdicts, rule)
    b = ratings(list(reversed(verdicts)), rule)
    assert a == b
    assert gated(a["bad"], rule) and a["bad"].failures == 2
    assert not gated(a["good"], rule) and a["good"].scored == 2


def test_one_of_three_scorers_cannot_fail_a_peer_alone() -> None:
    from dilocod.trust.scoring import ratings

    rule = RatingRule()
    verdicts = [(5, "liar", "p", False), (5, "s1", "p", True), (5, "s2", "p", True)]
    assert ratings(verdicts, rule)["p"].failures == 0
