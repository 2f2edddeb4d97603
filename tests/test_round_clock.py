"""The run's round clock (dilocod/rounds/clock.py): the close every peer derives from the same records."""

from __future__ import annotations

import math
from typing import Any

from dilocod.rounds import clock
from dilocod.rounds.clock import ClockSettings, Progress, estimate_close, in_round, round_opened

AUTO = ClockSettings(target_tokens=0, reference_tokens=1000, max_seconds=600.0, stale_after=10.0)
FIXED = ClockSettings(target_tokens=6000, reference_tokens=1000, max_seconds=600.0, stale_after=10.0)


def p(peer: str, tokens: int, tps: float, time: float = 100.0, round_index: int = 3, opened: float = 90.0,
      reference: int | None = None) -> Progress:  # fmt: skip
    return Progress(peer, round_index, tokens, tps, time, opened, reference)


def test_the_round_closes_when_the_run_reaches_its_tokens() -> None:
    # 3 trainers, auto target 3 × 1000; 1500 trained now, 300 tokens/s together: 5 s to go.
    close = estimate_close([p("a", 500, 100), p("b", 500, 100), p("c", 500, 100)], AUTO, 100.0, 90.0)
    assert (close.target, close.expected, close.rate, close.trainers) == (3000, 1500, 300, 3)
    assert close.at == 105.0 and close.by == "tokens"


def test_a_faster_peer_brings_the_close_nearer_and_a_slower_one_later() -> None:
    fast = estimate_close([p("a", 500, 300), p("b", 500, 100)], AUTO, 100.0, 90.0)
    slow = estimate_close([p("a", 500, 100), p("b", 500, 33.3)], AUTO, 100.0, 90.0)
    assert fast.at == 100.0 + 1000 / 400 and slow.at > 107.0


def test_records_are_extrapolated_by_their_age_at_their_throughput() -> None:
    # b's record is 2 s old: it has trained 2 × 100 tokens more since.
    close = estimate_close([p("a", 500, 100, time=100.0), p("b", 300, 100, time=98.0)], FIXED, 100.0, 90.0)
    assert close.expected == 1000 and close.at == 100.0 + 5000 / 200


def test_every_peer_computes_the_same_close_from_the_same_records() -> None:
    records = [p("a", 700, 120, time=99.5), p("b", 300, 80, time=99.0), p("c", 1000, 200, time=99.8)]
    seen = [estimate_close(records, AUTO, 100.0, round_opened(records, 100.0)).at for _ in range(3)]
    assert len(set(seen)) == 1


def test_max_seconds_bounds_a_round_nobody_measures() -> None:
    close = estimate_close([p("a", 0, 0.0)], AUTO, 100.0, 90.0)
    assert close.at == 690.0 and close.by == "max_seconds"
    close = estimate_close([p("a", 10, 0.01)], AUTO, 100.0, 90.0)
    assert close.at == 690.0 and close.by == "max_seconds"


def test_a_reached_target_closes_now() -> None:
    close = estimate_close([p("a", 5000, 100)], AUTO, 100.0, 90.0)
    assert close.at == 100.0


def test_the_auto_target_follows_the_median_reference_of_the_trainers() -> None:
    # One peer with a 4× batch does not move the run's target: the median of the references does.
    trainers = [
        p("a", 0, 100, reference=1000),
        p("b", 0, 100, reference=1000),
        p("c", 0, 100, reference=4000),
    ]
    assert AUTO.target(trainers) == 3 * 1000
    assert AUTO.target([p("a", 0, 100)]) == 1000  # nobody says: ours
    assert FIXED.target(trainers) == 6000  # round.tokens set: that


def test_only_fresh_records_of_the_round_count_one_per_peer() -> None:
    records = [
        p("a", 100, 10, time=99.0),
        p("a", 200, 10, time=99.5),  # a newer record of the same peer wins
        p("b", 100, 10, time=80.0),  # stale: its peer stopped publishing
        p("c", 100, 10, round_index=4),  # another round
    ]
    assert [(x.peer_id, x.tokens) for x in in_round(records, 3, 100.0, 10.0)] == [("a", 200)]


def test_the_round_opened_when_most_trainers_say() -> None:
    trainers = [p("a", 0, 1, opened=90.0), p("b", 0, 1, opened=90.4), p("liar", 0, 1, opened=1.0)]
    assert round_opened(trainers, fallback=100.0) == 90.0
    assert round_opened([p("a", 0, 1, opened=None)], fallback=100.0) == 100.0  # type: ignore[arg-type]


def test_a_trainer_stops_before_a_step_that_would_end_past_the_close() -> None:
    assert not clock.should_stop(close_at=10.0, now=9.0, seconds_per_step=1.0)
    assert clock.should_stop(close_at=10.0, now=9.6, seconds_per_step=1.0)  # it would end 0.6 s late
    assert clock.should_stop(close_at=10.0, now=10.0, seconds_per_step=None)
    assert not clock.should_stop(close_at=math.inf, now=1e9, seconds_per_step=1.0)


def test_records_are_read_more_often_near_the_close() -> None:
    assert clock.refresh_interval(200.0, now=100.0, status_interval=5.0) == 5.0
    assert clock.refresh_interval(102.0, now=100.0, status_interval=5.0) == 0.5
    assert clock.refresh_interval(100.0, now=100.0, status_interval=5.0) == 0.1
    assert clock.refresh_interval(math.inf, now=100.0, status_interval=5.0) == 5.0
    # Nobody measured a step yet: the first one changes everything, so look again soon.
    unmeasured = estimate_close([p("a", 0, 0.0)], AUTO, 100.0, 90.0)
    assert clock.refresh_interval(unmeasured, now=100.0, status_interval=5.0) == clock.UNMEASURED_REFRESH


def test_progress_comes_from_trainers_records_only() -> None:
    record: dict[str, Any] = {
        "role": "peer", "peer_id": "a", "round": 3, "round_tokens": 10, "tokens_per_second": 5.0,
        "time": 100.0, "round_opened": 90.0, "reference_tokens": 1000,
    }  # fmt: skip
    assert clock.progress_from_record(record) == Progress("a", 3, 10, 5.0, 100.0, 90.0, 1000)
    assert clock.progress_from_record({**record, "role": "helper"}) is None
    assert clock.progress_from_record({**record, "round": None}) is None  # a peer of an older version
    assert clock.progress_from_record({**record, "training": False}).training is False  # type: ignore[union-attr]


def test_a_trainer_that_is_not_taking_steps_is_not_extrapolated() -> None:
    # b published 2 s ago, then began evaluating the step it applied (or matchmaking): its tokens have
    # not grown since. Projecting them would close the round 2 × 100 tokens early, every round.
    b_idle = Progress("b", 3, 300, 100, 98.0, 90.0, None, training=False)
    close = estimate_close([p("a", 500, 100, time=100.0), b_idle], FIXED, 100.0, 90.0)
    assert close.expected == 800 and close.rate == 200 and close.at == 100.0 + 5200 / 200


def test_trainers_still_showing_the_round_before_count_towards_the_size_not_the_tokens() -> None:
    # b applied the last round a moment ago and has not published the new one: the round is still sized
    # for three (and b's throughput counts), its tokens are only a's and ours.
    trainers = [p("a", 500, 100), p("me", 500, 100)]
    arriving = [p("b", 9999, 100, round_index=2)]
    close = estimate_close(trainers, AUTO, 100.0, 90.0, arriving)
    assert (close.target, close.expected, close.rate, close.trainers) == (3000, 1000, 300, 3)
    assert close.at == 100.0 + 2000 / 300


JOINING = ClockSettings(
    target_tokens=0, reference_tokens=1000, max_seconds=600.0, stale_after=10.0, join_wait=20.0
)


def joiner(peer: str = "j", round_index: int = 3, since: float = 95.0, time: float = 99.0) -> clock.Joiner:
    return clock.Joiner(peer, round_index, since, time)


def test_a_round_stays_open_for_a_peer_downloading_the_state_to_join_it() -> None:
    # The tokens say 105; a peer began downloading at 95 to join: the others train on until it has the
    # state (its record stops saying so), at most join_wait after the download began.
    trainers = [p("a", 500, 100), p("b", 500, 100), p("c", 500, 100)]
    held = estimate_close(trainers, JOINING, 100.0, 90.0, joiners=[joiner()])
    assert held.at == 115.0 and held.by == "joining"
    assert estimate_close(trainers, JOINING, 100.0, 90.0).at == 105.0  # arrived: back to the tokens
    # The latest of several joiners holds it; one whose download began long ago no longer does.
    later = estimate_close(trainers, JOINING, 100.0, 90.0, joiners=[joiner("j"), joiner("k", since=99.0)])
    assert later.at == 119.0
    assert estimate_close(trainers, JOINING, 100.0, 90.0, joiners=[joiner(since=80.0)]).by == "tokens"
    # max_seconds still bounds the round.
    short = ClockSettings(0, 1000, max_seconds=20.0, stale_after=10.0, join_wait=20.0)
    assert estimate_close(trainers, short, 100.0, 90.0, joiners=[joiner()]).at == 110.0


def test_a_held_round_re_reads_the_records_often() -> None:
    trainers = [p("a", 500, 100)]
    held = estimate_close(trainers, JOINING, 100.0, 90.0, joiners=[joiner()])
    assert clock.refresh_interval(held, 100.0, 5.0) == clock.UNMEASURED_REFRESH


def test_joiners_come_from_fresh_records_that_name_the_round() -> None:
    record: dict[str, Any] = {"role": "peer", "peer_id": "j", "round": 1, "round_tokens": 0, "time": 99.0,
                              "tokens_per_second": 50.0, "joining": 3, "joining_since": 120.0}  # fmt: skip
    found = clock.joiner_from_record(record)
    # A download cannot have begun after the record saying so: a `since` in the future reads as its time.
    assert found == clock.Joiner("j", 3, 99.0, 99.0)
    assert clock.progress_from_record(record) is None  # in no round (not even as arriving) meanwhile
    assert clock.joiner_from_record({**record, "joining": None}) is None
    assert clock.joiner_from_record({**record, "role": "helper"}) is None
    assert clock.progress_from_record({**record, "joining": None}) is not None
    js = [joiner("j", time=99.0), joiner("j", since=96.0, time=99.5), joiner("k", round_index=4),
          joiner("s", time=80.0), joiner("b", round_index=2), joiner("o", round_index=1)]  # fmt: skip
    # One per peer (its latest record); a joiner that named an earlier round (it read lagging records) is
    # on its way to ours; one that names a later round, or whose record went stale, is not.
    assert clock.joining(js, 3, 100.0, 10.0) == [
        joiner("b", round_index=2),
        joiner("j", since=96.0, time=99.5),
        joiner("o", round_index=1),
    ]


def test_the_round_in_flight_is_done_after_its_window_and_the_longest_recent_exchange() -> None:
    # opened at 100: window 2 s, twice the 1 s request slack, then the longest recent all-reduce
    assert clock.in_flight_done_at(100.0, 2.0, 1.0, [0.3, 0.8, 0.5]) == 104.8
    assert clock.in_flight_done_at(100.0, 2.0, 1.0, []) == 105.0  # none measured: 1 s
    assert clock.in_flight_done_at(100.0, 2.0, 1.0, [math.nan, 0.0]) == 105.0
    assert clock.in_flight_done_at(None, 2.0, 1.0, [0.3]) is None  # nobody says when the round opened
    assert clock.in_flight_done_at(math.inf, 2.0, 1.0, [0.3]) is None


def test_the_group_waits_for_the_last_groups_members_when_records_go_stale() -> None:
    # (trainers the records show, auxiliary reducers, members of our last successful group) → target
    table = [
        ((4, 1, 0), 5),  # no successful round yet: the records decide
        ((4, 1, 5), 5),  # the same run as last round
        ((8, 1, 17), 17),  # half the records stale on a loaded machine: still wait for all 16 + 1
        ((17, 1, 17), 18),  # a peer joined
        ((3, 0, 4), 4),  # a peer left: this round waits the window once, and forms with 3
    ]
    for args, target in table:
        assert clock.group_target(*args) == target, args
