"""When the reducing bootstrap (or a helper) enters a round's matchmaking, and under which key: the rules of
`dilocod/rounds/helperclock.py` as tables."""

from __future__ import annotations

from typing import Any

import pytest

from dilocod.rounds import clock
from dilocod.rounds.helperclock import DueRound, Joined, due_at_close, due_at_launch, next_round

SETTINGS = clock.ClockSettings(target_tokens=1000, reference_tokens=1000, max_seconds=600, stale_after=10)


def trainer(
    peer: str, round_index: int, opened: float, tokens: int = 0, step: int | None = None
) -> dict[str, Any]:
    return {"role": "peer", "peer_id": peer, "round": round_index, "round_tokens": tokens,
            "outer_step": round_index if step is None else step,
            "tokens_per_second": 100.0, "time": 100.0, "round_opened": opened}  # fmt: skip


def due(round_index: int, key: int, opened: float | None, close_at: float = 100.0) -> DueRound:
    close = clock.Close(close_at, opened or 0.0, 1000, 0.0, 100.0, 2, "tokens")
    return DueRound(round_index, key, opened, close, 2)


def test_the_round_most_trainers_train_and_the_step_they_average() -> None:
    found = next_round([trainer("a", 2, 90.0, 400), trainer("b", 2, 90.5, 400)], SETTINGS, now=100.0)
    assert found is not None
    assert (found.round, found.key, found.opened, found.trainers) == (2, 2, 90.25, 2)
    assert found.close.at == 101.0  # 200 tokens left at 200 tokens/s
    # After a step back the trainers train round 2 again, opened anew: the helper sees a new round.
    again = next_round([trainer("a", 2, 99.0), trainer("b", 2, 99.2)], SETTINGS, now=100.0)
    assert again is not None and again.round == 2 and again.opened is not None and again.opened > 91
    # A tie between rounds goes to the later one (the others are about to catch up); helpers don't vote.
    tie = next_round([trainer("a", 3, 95.0), trainer("b", 4, 96.0), {"role": "helper"}], SETTINGS, now=100.0)
    assert tie is not None and tie.round == 4
    assert next_round([], SETTINGS, now=100.0) is None


@pytest.mark.parametrize(
    ("steps", "key"),
    [
        ((4, 4), 4),  # the round in flight was applied: they launched round 4's progress under step 4
        ((3, 3), 3),  # it was not: round 4 opened again with their progress under step 3
        ((3, 4), 4),  # one of each: a tie goes to the later step
        ((3, 3, 4), 3),  # most of them
    ],
)
def test_with_overlap_the_key_is_the_trainers_outer_step_not_their_round(
    steps: tuple[int, ...], key: int
) -> None:
    records = [trainer(f"p{i}", 5, 99.0, step=s) for i, s in enumerate(steps)]
    found = next_round(records, SETTINGS, now=100.0)
    assert found is not None and (found.round, found.key) == (5, key)


@pytest.mark.parametrize(
    ("last", "now_due", "now", "expected"),
    [
        (None, due(3, 3, 90.0, close_at=100.0), 100.0, True),  # the close has come
        (None, due(3, 3, 90.0, close_at=101.0), 100.0, False),  # not closing yet
        # reports of when round 3 opened drift as records arrive: still the instance we joined
        (Joined(3, 3, 100.0), due(3, 3, 90.6, close_at=100.5), 101.0, False),
        # round 3 reopened after we joined (it failed, or the trainers stepped back to it): join again
        (Joined(3, 3, 100.0), due(3, 3, 103.0, close_at=105.0), 105.0, True),
        (Joined(3, 3, 100.0), due(4, 4, 100.2, close_at=104.0), 104.0, True),
        # nobody says when the round opened (peers of an older version): no sign of a new instance
        (Joined(3, 3, 100.0), due(3, 3, None, close_at=100.0), 101.0, False),
    ],
)
def test_without_overlap_the_reducer_enters_each_instance_at_its_close(
    last: Joined | None, now_due: DueRound, now: float, expected: bool
) -> None:
    assert due_at_close(last, now_due, now) is expected


WINDOW = 8.0


@pytest.mark.parametrize(
    ("last", "now_due", "now", "expected"),
    [
        (None, due(1, 0, 99.5), 100.0, True),  # the trainers just launched step 0 and opened round 1
        (None, due(0, 0, 99.5), 100.0, False),  # the run's first round opened: nothing launched yet
        (Joined(1, 0, 100.0), due(3, 3, 108.0), 108.2, False),  # they re-synced: no round in flight
        (
            None,
            due(1, 0, 80.0),
            100.0,
            False,
        ),  # launched longer ago than a matchmaking lasts: wait for the next
        (None, due(1, 0, None), 100.0, False),  # nobody says when it opened
        # after an applied round: the next launch has the next key
        (Joined(1, 0, 100.0), due(2, 1, 108.0), 108.2, True),
        # the same launch, its opening estimate moved by a later record: not again
        (Joined(1, 0, 100.0), due(1, 0, 99.9), 101.0, False),
        (Joined(1, 0, 100.0), due(1, 0, 100.6), 101.0, False),
        # the round in flight was not applied: the trainers opened round 1 again and relaunched step 0
        (Joined(1, 0, 100.0), due(1, 0, 108.0), 108.3, True),
        # a round that was not applied changes the key, not the round number we saw last
        (Joined(2, 2, 100.0), due(2, 1, 100.5), 100.6, True),
    ],
)
def test_with_overlap_the_reducer_enters_each_launch_once(
    last: Joined | None, now_due: DueRound, now: float, expected: bool
) -> None:
    assert due_at_launch(last, now_due, now, WINDOW) is expected
