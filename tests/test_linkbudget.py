"""Deadlines from the model and the link (`peers/linkbudget.py`, `dilocod/node/autodeadlines.py`)."""

from __future__ import annotations

import pytest
import torch

from dilocod.config import load_config
from dilocod.node.autodeadlines import auto_keys, model_size, resolve_deadlines
from peers.deadlines import AdaptiveDeadlines, DeadlineBounds
from peers.group import AveragingSettings, GroupAverager, RoundOutcome
from peers.linkbudget import (
    DEFAULT_RATE,
    MBIT,
    MIN_RATE,
    LinkEstimate,
    LinkRule,
    ModelSize,
    allreduce_bytes,
    allreduce_deadline,
    deadlines,
    prior_rate,
)

INT4 = 0.53125  # bytes a value (blockwise 4-bit with a scale a block)


@pytest.mark.parametrize(
    ("name", "elements", "per_value", "group", "mbit", "expected"),
    [
        # tiny on loopback: exactly the old fixed defaults (every term is under its floor)
        ("tiny/loopback", 918_656, INT4, 3, 10_000, (15.0, 60.0, 60.0, 1800.0)),
        # 124m over 100 Mbit/s, int4, 3 members: the all-reduce's bytes (87 MB) and CPU (12 s) fit 60 s x 3;
        # the state (2 x 492 MB fp32) needs 3 x 79 s + 10
        ("124m/100Mbit", 123_101_952, INT4, 3, 100, (15.0, 60.0, 246.4, 2373.6)),
        # the same in fp32: 4 x the bytes on the wire
        ("124m/100Mbit fp32", 123_101_952, 4.0, 3, 100, (15.0, 194.5, 246.4, 2373.6)),
        # 1B over 1 Gbit/s, int4, 9 members: CPU-bound (103 s) more than the link (7.7 s)
        ("1b/1Gbit", 1_028_737_024, INT4, 9, 1000, (41.9, 331.9, 207.5, 19761.8)),
        # 1B over 100 Mbit/s: the link dominates
        ("1b/100Mbit", 1_028_737_024, INT4, 9, 100, (41.9, 541.8, 1985.2, 19761.8)),
    ],
)
def test_the_rule_table(
    name: str, elements: int, per_value: float, group: int, mbit: float, expected: tuple[float, ...]
) -> None:
    got = deadlines(ModelSize(elements, per_value), group, mbit * MBIT, min_window=5.0, request_timeout=3.0)
    assert (got.matchmaking, got.allreduce, got.state, got.round_max) == pytest.approx(expected, abs=0.1), (
        name
    )


def test_a_butterfly_member_moves_twice_its_share_of_the_others_parts() -> None:
    assert allreduce_bytes(100.0, 2) == 100.0  # half out, half of the average back... each way
    assert allreduce_bytes(100.0, 4) == 150.0
    assert allreduce_bytes(100.0, 1) == 100.0  # never fewer than two members


@pytest.mark.parametrize(
    ("group", "reducers", "expected"),
    [
        (4, None, 150.0),  # everyone reduces: 2(n − 1)/n
        (4, 4, 150.0),
        (4, 8, 150.0),  # never more reducers than members
        (100, 8, 1325.0),  # (R + n − 2)/R: each of 8 reducers carries 99/8 of a Δ's results
        (100, 100, 198.0),
        (10, 1, 900.0),  # one reducer: n − 1 results out, and nothing of its own Δ to send
    ],
)
def test_capped_reducers_each_carry_more_of_the_group(
    group: int, reducers: int | None, expected: float
) -> None:
    assert allreduce_bytes(100.0, group, reducers) == pytest.approx(expected)


def test_round_max_is_the_same_on_every_link() -> None:
    """round.max_seconds is run-wide: every peer's clock must close a round at the same moment."""
    size = ModelSize(1_028_737_024, INT4)
    slow = deadlines(size, 9, 10 * MBIT, min_window=5.0, request_timeout=3.0)
    fast = deadlines(size, 9, 10_000 * MBIT, min_window=5.0, request_timeout=3.0)
    assert slow.round_max == fast.round_max and slow.state > fast.state


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="link budget"):
        deadlines(ModelSize(10, 4.0), 3, 0.0, min_window=5.0, request_timeout=3.0)


def test_the_estimate_is_the_slowest_recent_transfer_after_the_prior() -> None:
    link = LinkEstimate(prior_rate(None))
    assert link.rate == DEFAULT_RATE and not link.measured
    link.observe(1_000, 0.001)  # latency, not bandwidth: ignored
    assert not link.measured
    link.observe(100e6, 1.0)
    link.observe(100e6, 4.0)
    assert link.rate == 25e6
    for _ in range(LinkEstimate.WINDOW):
        link.observe(50e6, 1.0)
    assert link.rate == 50e6  # the slow one left the window
    assert prior_rate(100.0) == 100 * MBIT


def test_an_auto_ceiling_moves_with_the_link() -> None:
    deadlines_ = AdaptiveDeadlines(DeadlineBounds(15.0, 11.0, 300.0, 5.0))
    deadlines_.set_allreduce_ceiling(60.0)
    assert deadlines_.allreduce == 60.0
    deadlines_.set_allreduce_ceiling(2.0)  # a floor above the ceiling follows it down
    assert deadlines_.allreduce == 2.0


def test_explicit_values_win_and_zero_is_auto() -> None:
    explicit = load_config(
        None,
        ["averaging.matchmaking_timeout=12", "averaging.allreduce_timeout=30", "averaging.state_timeout=20",
         "round.max_seconds=600"],
    )  # fmt: skip
    assert auto_keys(explicit) == []
    assert resolve_deadlines(explicit) == (explicit, None)
    auto = load_config(None, ["model.preset=124m", "net.bandwidth=100"])
    assert auto_keys(auto) == [
        "averaging.matchmaking_timeout", "averaging.allreduce_timeout", "averaging.state_timeout",
        "round.max_seconds",
    ]  # fmt: skip
    resolved, link = resolve_deadlines(auto)
    assert link is not None and link.allreduce and link.state and link.prior == 100 * MBIT
    assert link.size == model_size(auto) and link.size.elements == 123_101_952
    avg = resolved.averaging
    # group_size 8 + an auxiliary reducer: 2 x 8/9 x 65 MB at 12.5 MB/s and 12 s of CPU, x 3
    assert avg.matchmaking_timeout == 15.0 and avg.allreduce_timeout == pytest.approx(64.8, abs=0.1)
    assert avg.state_timeout == pytest.approx(246.4, abs=0.1) and resolved.round.max_seconds > 1800
    # FedAdam/FedYogi's second moment is one more model-sized set to download (and overlap's round another)
    assert model_size(auto).state_tensors == 2
    assert model_size(load_config(None, ["outer.optimizer=fedadam"])).state_tensors == 3
    adaptive = load_config(None, ["outer.optimizer=fedyogi", "outer.overlap=delayed"])
    assert model_size(adaptive).state_tensors == 4
    mixed, link = resolve_deadlines(load_config(None, ["averaging.allreduce_timeout=45"]))
    assert mixed.averaging.allreduce_timeout == 45.0 and link is not None and not link.allreduce


def test_a_first_round_cut_by_its_deadline_halves_the_assumed_link() -> None:
    link = LinkEstimate(prior_rate(None))
    link.timed_out()
    assert link.rate == DEFAULT_RATE / 2
    for _ in range(10):
        link.timed_out()
    assert link.rate == MIN_RATE  # never assumes less than half a Mbit/s


def _group(link: LinkRule | None) -> GroupAverager:
    options = AveragingSettings(target_group_size=3, allreduce_timeout=60.0, link=link)
    return GroupAverager(None, [torch.zeros(4)], options, None)  # type: ignore[arg-type]  # never started


def _round(averaged: bool, error: str | None = None, reducer_errors: tuple[str, ...] = ()) -> RoundOutcome:
    return RoundOutcome(
        found_group=True, group_size=3, contributors=3, in_majority=averaged, complete=averaged,
        averaged=[torch.zeros(4)] if averaged else None, seconds=30.0, error=error,
        reducer_errors=reducer_errors, bytes_sent=64 << 20, bytes_received=64 << 20, allreduce_seconds=8.0,
    )  # fmt: skip


def test_the_averager_learns_its_link_from_rounds() -> None:
    size = ModelSize(123_101_952, INT4)
    group = _group(LinkRule(size, prior_rate(None), allreduce=True, state=True))
    assert group.state_timeout(5.0) == pytest.approx(3 * size.state_bytes / DEFAULT_RATE + 10)
    group._learn(_round(False, reducer_errors=("peer: all-reduce timed out after 60.0 s (deadline 60.0 s)",)))
    assert group.link.rate == DEFAULT_RATE / 2  # before any measurement: the first guess was too fast
    assert group.deadlines.bounds.allreduce_ceiling > 60.0
    group._learn(_round(True))  # 64 MiB each way in 8 s: ~8.4 MB/s
    assert group.link.measured and group.link.rate == pytest.approx((64 << 20) / 8.0)
    group._learn(_round(False, error="timed out"))  # measured: a timeout is a dead peer, not the link
    assert group.link.rate == pytest.approx((64 << 20) / 8.0)
    fixed = _group(None)  # explicit deadlines: the averager keeps them
    fixed._learn(_round(True))
    assert fixed.deadlines.bounds.allreduce_ceiling == 60.0 and fixed.state_timeout(20.0) == 20.0


def test_the_capped_reducers_deadline_grows_with_the_group_the_plain_one_does_not() -> None:
    size = ModelSize(124_000_000, 0.53, 2)
    rate = 100e6 / 8
    plain = [allreduce_deadline(size, n, rate) for n in (10, 100, 320)]
    capped = [allreduce_deadline(size, n, rate, reducers=8) for n in (10, 100, 320)]
    assert plain[2] < 1.01 * plain[1]  # 2(n − 1)/n: flat in n
    assert capped[0] < capped[1] < capped[2] and capped[2] > 30 * plain[2] / 2  # ~n/8 times the work
    assert allreduce_deadline(size, 8, rate, reducers=8) == allreduce_deadline(size, 8, rate)
