"""What a peer logs when a round formed a group but gave no result."""

from __future__ import annotations

from hivemind.averaging.partition import AllreduceException

from peers.allreduce import short_reason
from peers.group import incomplete_reason


def test_incomplete_round_names_each_reducer_and_why() -> None:
    errors = ("QmA: AllreduceException: QmA sent BAD_GROUP_ID", "QmB: TimeoutError")
    assert incomplete_reason(errors) == (
        "incomplete: QmA: AllreduceException: QmA sent BAD_GROUP_ID; QmB: TimeoutError"
    )


def test_incomplete_round_without_a_reducer_error_says_a_member_vanished() -> None:
    assert incomplete_reason(()) == "incomplete: a member or reducer vanished mid-round"


def test_reducer_error_reasons_are_one_short_line() -> None:
    assert short_reason(TimeoutError()) == "TimeoutError"
    assert short_reason(AllreduceException("peer X sent 1 parts, but we expected 2")) == (
        "AllreduceException: peer X sent 1 parts, but we expected 2"
    )
    long = short_reason(AllreduceException("x" * 500))
    assert len(long) == 160 and long.endswith("…")
