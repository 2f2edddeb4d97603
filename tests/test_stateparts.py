"""The part plan of a multi-donor state download (`peers/state/parts.py`): pure bookkeeping, every case."""

from __future__ import annotations

import pytest

from peers.state.parts import Part, PartPlan, agreed_digests, resumed_parts, split_parts

DIGESTS = ("d0", "d1", "d2", "d3")


def plan(donors: list[str], max_failures: int = 3) -> PartPlan:
    return PartPlan(split_parts(400, 100), DIGESTS, donors, max_failures=max_failures)


def test_parts_cover_the_state_once() -> None:
    parts = split_parts(250, 100)
    assert parts == [Part(0, 0, 100), Part(1, 100, 200), Part(2, 200, 250)]
    assert split_parts(0, 100) == []
    with pytest.raises(ValueError, match="bad part plan"):
        split_parts(100, 0)


def test_the_digests_most_donors_declare_and_who_declared_them() -> None:
    digests, donors = agreed_digests({"a": DIGESTS, "b": DIGESTS, "c": ("x", "d1", "d2", "d3")})
    assert digests == DIGESTS and donors == ["a", "b"]
    assert agreed_digests({"a": DIGESTS, "c": ("x",)}) == (None, [])  # a tie: nothing to hold anyone to
    assert agreed_digests({}) == (None, [])


OTHER = ("y", "e1", "e2", "e3")


@pytest.mark.parametrize(
    ("declared", "newness", "expected"),
    [
        # a donor a round ahead of another: both honest, the newer state is the one the run moves to
        ({"a": DIGESTS, "b": OTHER}, {"a": (5, 0), "b": (6, 0)}, (OTHER, ["b"])),
        ({"a": DIGESTS, "b": OTHER}, {"a": (6, 0), "b": (5, 0)}, (DIGESTS, ["a"])),
        # the same step, one holding the round in flight (delayed overlap): that one is newer
        ({"a": DIGESTS, "b": OTHER}, {"a": (6, 3), "b": (6, 0)}, (DIGESTS, ["a"])),
        # two donors agreeing outvote a newer one (it may lie about its step; the records judge it)
        (
            {"a": DIGESTS, "b": DIGESTS, "c": OTHER},
            {"a": (5, 0), "b": (5, 0), "c": (9, 0)},
            (DIGESTS, ["a", "b"]),
        ),
        # the same step and the same newness, other bytes: nothing to hold anyone to
        ({"a": DIGESTS, "b": OTHER}, {"a": (6, 0), "b": (6, 0)}, (None, [])),
        ({"a": DIGESTS, "b": OTHER}, None, (None, [])),
    ],
)
def test_a_tie_goes_to_the_newest_state(
    declared: dict[str, tuple[str, ...]],
    newness: dict[str, tuple[int, ...]] | None,
    expected: tuple[tuple[str, ...] | None, list[str]],
) -> None:
    assert agreed_digests(declared, newness) == expected


def test_every_donor_fetches_its_own_part_at_once() -> None:
    p = plan(["a", "b", "c"])
    assert [(d, part.index) for d, part in p.assign()] == [("a", 0), ("b", 1), ("c", 2)]
    assert p.assign() == []  # one part per donor at a time
    assert p.received("b", 1, "d1")
    assert [(d, part.index) for d, part in p.assign()] == [("b", 3)]
    for donor, index in (("a", 0), ("c", 2), ("b", 3)):
        assert p.received(donor, index, DIGESTS[index])
    assert p.finished and p.progress() == (400, 400) and not p.stuck


def test_a_lying_donor_is_banned_and_its_part_comes_from_another() -> None:
    p = plan(["liar", "b"])
    p.assign()
    assert not p.received("liar", 0, "forged")
    assert p.banned == {"liar"}
    assert p.progress() == (0, 400)
    assert p.received("b", 1, "d1")
    assert [(d, part.index) for d, part in p.assign()] == [("b", 0)]  # the forged part, from the honest one
    assert p.assign() == []  # the banned donor is never asked again


def test_a_part_that_does_not_arrive_goes_to_another_donor_first() -> None:
    p = plan(["slow", "b"])
    p.assign()  # slow: 0, b: 1
    p.failed("slow", 0)
    assert [(d, part.index) for d, part in p.assign()] == [("slow", 2)]  # not the part it failed
    p.received("b", 1, "d1")
    assert [(d, part.index) for d, part in p.assign()] == [("b", 0)]


def test_a_lone_donor_is_retried_until_its_failures_run_out() -> None:
    p = plan(["only"], max_failures=2)
    assert [part.index for _, part in p.assign()] == [0]
    p.failed("only", 0)
    assert [part.index for _, part in p.assign()] == [0]  # nobody else to ask: the same part again
    p.failed("only", 0)
    assert p.assign() == [] and p.stuck  # out of tries: start over with other donors


def test_donors_that_leave_give_their_parts_back() -> None:
    p = plan(["a", "b"])
    p.assign()
    p.lost(["a"])
    assert p.pending() == [0, 2, 3] and not p.usable("a")
    p.received("b", 1, "d1")
    assert [part.index for _, part in p.assign()] == [0]


def test_a_late_answer_for_a_part_given_to_another_is_not_double_counted() -> None:
    p = plan(["a", "b"])
    p.assign()
    p.failed("a", 0)  # a's part timed out and went back to the queue...
    p.received("b", 1, "d1")
    p.assign()  # ...and b fetches it (a takes part 2)
    assert p.received("a", 0, "d0")  # a's late answer is still the right bytes: kept
    assert p.received("b", 0, "d0")  # b's copy changes nothing
    assert p.done == {0, 1} and p.in_flight == {"a": 2}  # a went on to the next part meanwhile


def test_a_cut_download_keeps_the_parts_whose_bytes_still_match() -> None:
    stored = {0: "d0", 1: "corrupted", 2: "d2", 9: "d9"}
    assert resumed_parts(stored, DIGESTS) == {0, 2}
    p = PartPlan(split_parts(400, 100), DIGESTS, ["a"], done=resumed_parts(stored, DIGESTS))
    assert p.progress() == (200, 400)
    assert [part.index for _, part in p.assign()] == [1]


def test_digests_must_match_the_parts() -> None:
    with pytest.raises(ValueError, match="4 parts but 3 digests"):
        PartPlan(split_parts(400, 100), DIGESTS[:3], ["a"])
