"""The round machine (dilocod/rounds/machine.py) as a table: (state, event) → outcome and next command.

Every outcome must be reachable from some row and every row must say what happens next; the last test
checks that the table covers every outcome (none dead).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from dilocod.rounds.events import (
    Action,
    Apply,
    Attempt,
    Average,
    Averaged,
    AwaitRound,
    Begin,
    Checkpoint,
    CheckRun,
    Closed,
    Contributing,
    Download,
    Evaluate,
    Keep,
    Launch,
    Outcome,
    Publish,
    Record,
    RunChecked,
    RunFacts,
    StepBack,
    Stop,
    Stopping,
    Synced,
    Train,
    Warn,
)
from dilocod.rounds.machine import (
    MISSES_BEFORE_WARNING,
    STRANDED_ROUNDS,
    MachineSettings,
    RoundState,
    transition,
)

PLAIN = MachineSettings()
OVERLAP = MachineSettings(overlapped=True)
PRIVATE_OVERLAP = MachineSettings(overlapped=True, private=True)
PRIVATE = MachineSettings(can_step_back=True, private=True)

AT5 = RoundState(step=5)
QUIET = RunFacts()  # nobody else in sight, and nobody seen lately
PEERS = RunFacts(others=2, best_step=5, seen_recently=True)  # two others, at our step
AHEAD = RunFacts(others=2, best_step=6, seen_recently=True, late_by=3.0)
FORKED = RunFacts(others=2, best_step=5, diverged=True, seen_recently=True)
BEHIND = RunFacts(others=1, best_step=4, behind_on_previous=True, seen_recently=True)

OK = Attempt(
    True, complete=True, in_majority=True, has_average=True, majority_size=3, contributors=3, group_size=4
)
ONLY_HELPERS = Attempt(
    True, complete=True, in_majority=True, has_average=True, majority_size=1, contributors=1
)
NOBODY = Attempt(False, error="could not find a group")
CUT = Attempt(True, in_majority=True, group_size=3, error=None)  # formed, but averages went missing
MINORITY = Attempt(True, complete=True, in_majority=False, group_size=3)
BANNED = Attempt(True, complete=True, in_majority=False, banned=True, group_size=3)
# the round a donor had in flight, handed over with its state (we were not in its group)
ADOPTED = Attempt(True, complete=True, in_majority=True, has_average=True, adopted=True)


def outcome(actions: list[Action]) -> Outcome | None:
    records = [a.outcome for a in actions if isinstance(a, Record)]
    return records[0] if records else None


# (name, settings, state, event) → (outcome recorded, next command, step afterwards)
TABLE: list[tuple[str, MachineSettings, RoundState, object, Outcome | None, Action, int]] = [
    ("start: check the run first", PLAIN, AT5, Begin(), None, CheckRun(), 5),
    ("start behind the run: re-sync", PLAIN, AT5, RunChecked(AHEAD), None, Download(6), 5),
    ("start on another θ: re-sync", PLAIN, AT5, RunChecked(FORKED), Outcome.DIVERGED, Download(5, force=True), 5),
    ("start in step: train", PLAIN, AT5, RunChecked(PEERS), None, Train(), 5),
    ("close: average with the group", PLAIN, AT5, Closed(PEERS), None, Average(), 5),
    ("close, the run went on without us", PLAIN, AT5, Closed(AHEAD), Outcome.LATE, Download(6), 5),
    ("close on a forked θ", PLAIN, AT5, Closed(FORKED), Outcome.DIVERGED, Download(5, force=True), 5),
    ("a complete average", PLAIN, AT5, Averaged(OK, PEERS), Outcome.OK, Train(), 6),
    ("only helpers met us, others live", PLAIN, AT5, Averaged(ONLY_HELPERS, PEERS), Outcome.NO_GROUP, Train(), 5),
    ("no group, others at our step", PLAIN, AT5, Averaged(NOBODY, PEERS), Outcome.NO_GROUP, Train(), 5),
    ("no group, the run is ahead", PLAIN, AT5, Averaged(NOBODY, AHEAD), Outcome.LATE, Download(6), 5),
    ("no group, nobody alive: alone", PLAIN, AT5, Averaged(NOBODY, QUIET), Outcome.ALONE, Train(), 6),
    ("private, no group, nobody alive: alone (it can step back)", PRIVATE, AT5, Averaged(NOBODY, QUIET), Outcome.ALONE, Train(), 6),
    # nobody could download a private peer's lone step, and with overlap it cannot step back to meet them
    ("private with overlap, nobody alive: keep, wait", PRIVATE_OVERLAP, AT5, Averaged(NOBODY, QUIET), Outcome.NO_GROUP, Train(), 5),
    (
        "no group, nobody visible but seen lately",
        PLAIN, AT5, Averaged(NOBODY, RunFacts(seen_recently=True)), Outcome.NO_GROUP, Train(), 5,
    ),
    ("a round cut short", PLAIN, AT5, Averaged(CUT, PEERS), Outcome.FAILED, Train(), 5),
    ("a round cut short, run ahead", PLAIN, AT5, Averaged(CUT, AHEAD), Outcome.FAILED, Download(6), 5),
    ("our θ is the group's minority", PLAIN, AT5, Averaged(MINORITY, PEERS), Outcome.DIVERGED, Download(5, force=True), 5),
    ("most of the group bans us", PLAIN, AT5, Averaged(BANNED, PEERS), Outcome.BANNED, Train(), 5),
    ("a download adopted", PLAIN, AT5, Synced(True, 8), Outcome.RESYNCED, Train(), 8),
    ("a download failed: train on, held", PLAIN, AT5, Synced(False, 5, PEERS), Outcome.SYNC_FAILED, Train(hold=True), 5),
    (
        "private, ahead of everyone on our previous θ, long enough",
        PRIVATE, replace(AT5, stranded=STRANDED_ROUNDS - 1), Averaged(NOBODY, BEHIND), Outcome.STEPPED_BACK, Train(), 4,
    ),
    ("private, first stranded round: wait", PRIVATE, AT5, Averaged(NOBODY, BEHIND), Outcome.NO_GROUP, Train(), 5),
    (
        "public peers never step back",
        PLAIN, replace(AT5, stranded=5), Averaged(NOBODY, BEHIND), Outcome.NO_GROUP, Train(), 5,
    ),
    ("overlap: launch at the close", OVERLAP, AT5, Closed(PEERS), None, Train(), 5),
    ("overlap: settle the round in flight", OVERLAP, replace(AT5, in_flight=True), Closed(PEERS), None, AwaitRound(), 5),
    ("overlap: applied, launch the next", OVERLAP, AT5, Averaged(OK, PEERS), Outcome.OK, Train(), 6),
    ("overlap: re-synced, launch at once", OVERLAP, AT5, Synced(True, 8), Outcome.RESYNCED, Train(), 8),
    (
        "overlap: re-synced with the donor's round in flight: hold it, launch nothing",
        OVERLAP, AT5, Synced(True, 8, caught_up=True), Outcome.RESYNCED, Train(), 8,
    ),
    (
        "overlap: the donor's round applied at our close, as its members do",
        OVERLAP, replace(AT5, in_flight=True), Averaged(ADOPTED, PEERS), Outcome.CAUGHT_UP, Train(), 6,
    ),
    ("stop", PLAIN, AT5, Stopping(), None, Stop(), 5),
    ("stopped stays stopped", PLAIN, replace(AT5, stopped=True), Closed(PEERS), None, Stop(), 5),
]  # fmt: skip


@pytest.mark.parametrize(("name", "settings", "state", "event", "recorded", "command", "step"), TABLE)
def test_transition_table(
    name: str,
    settings: MachineSettings,
    state: RoundState,
    event: object,
    recorded: Outcome | None,
    command: Action,
    step: int,
) -> None:
    after, actions = transition(state, event, settings)  # type: ignore[arg-type]
    assert actions[-1] == command, name
    assert outcome(actions) == recorded, name
    assert after.step == step, name
    commands = (CheckRun, Train, Average, AwaitRound, Download, Stop)
    assert not any(isinstance(a, commands) for a in actions[:-1]), (
        f"{name}: only the last action is a command"
    )


def test_every_outcome_is_reachable() -> None:
    reached = {row[4] for row in TABLE if row[4] is not None}
    assert reached == set(Outcome) - {Outcome.UNDONE}  # UNDONE marks a past round when stepping back


def test_effects_of_an_applied_round() -> None:
    after, actions = transition(AT5, Averaged(OK, PEERS), PLAIN)
    assert actions == [
        Apply(),
        Record(Outcome.OK, 3, 0.0),
        Contributing(None),
        Publish(),
        Evaluate(),
        Checkpoint(),
        Train(),
    ]
    assert after.misses == 0


def test_a_round_not_applied_keeps_our_progress() -> None:
    for attempt in (NOBODY, CUT, MINORITY, BANNED):
        _, actions = transition(AT5, Averaged(attempt, PEERS), PLAIN)
        assert Keep() in actions and Apply() not in actions and Apply(alone=True) not in actions
    _, actions = transition(replace(AT5, stranded=1), Averaged(NOBODY, BEHIND), PRIVATE)
    assert actions[:2] == [Keep(), StepBack()]


def test_overlap_launches_the_next_round_after_settling() -> None:
    after, actions = transition(replace(AT5, in_flight=True), Closed(PEERS), OVERLAP)
    assert actions == [AwaitRound()] and after.in_flight
    after, actions = transition(after, Averaged(OK, PEERS), OVERLAP)
    assert actions[-2:] == [Launch(), Train()] and after.in_flight and after.round == 7
    after, actions = transition(AT5, Closed(PEERS), OVERLAP)
    assert actions == [Launch(), Train()] and after.in_flight and after.round == 6
    # After a re-sync the run's group at the adopted step is forming: meet it now, not a round late.
    after, actions = transition(AT5, Synced(True, 8), OVERLAP)
    assert actions[-2:] == [Launch(), Train()] and after.in_flight and after.round == 9


def test_a_joiner_with_overlap_applies_the_donors_round_in_flight_then_launches_with_the_run() -> None:
    # Re-synced mid-round: the run's group for the adopted step formed at the last close; the donor's
    # average of it came with the state. We train to the close, apply it there and launch with everyone.
    missed = replace(AT5, misses=2)
    after, actions = transition(missed, Synced(True, 8, PEERS, caught_up=True), OVERLAP)
    assert Launch() not in actions and after.in_flight and after.round == 9
    after, actions = transition(after, Closed(PEERS), OVERLAP)
    assert actions == [AwaitRound()]
    after, actions = transition(after, Averaged(ADOPTED, replace(PEERS, best_step=9)), OVERLAP)
    assert actions[:2] == [Apply(), Record(Outcome.CAUGHT_UP, 0, 0.0)]
    assert actions[-2:] == [Launch(), Train()] and after.step == 9 and after.round == 10
    assert Publish() in actions and Evaluate() not in actions
    assert Checkpoint() not in actions  # it wrote one at its re-sync: nothing may delay the launch
    # back in step, but its tokens are in no round yet: neither contributing nor another miss
    assert not any(isinstance(a, Contributing | Warn) for a in actions) and after.misses == 2
    # if the run moved on past even that round (a long download), it re-syncs again
    _, actions = transition(
        replace(AT5, in_flight=True), Averaged(ADOPTED, replace(PEERS, best_step=7)), OVERLAP
    )
    assert actions[-1] == Download(7)


def test_checkpoints_come_every_n_rounds_with_fragments() -> None:
    settings = MachineSettings(overlapped=True, checkpoint_every=3)
    state = AT5
    checkpoints = []
    for _ in range(6):
        state, actions = transition(replace(state, in_flight=True), Averaged(OK, PEERS), settings)
        checkpoints.append(Checkpoint() in actions)
    assert checkpoints == [False, False, True, False, False, True]


def test_a_peer_that_misses_rounds_says_why_once() -> None:
    state = AT5
    warnings: list[str] = []
    reasons: list[str | None] = []
    for _ in range(MISSES_BEFORE_WARNING + 2):
        state, actions = transition(state, Closed(AHEAD), PLAIN)
        warnings += [a.text for a in actions if isinstance(a, Warn)]
        reasons += [a.reason for a in actions if isinstance(a, Contributing)]
        state, _ = transition(state, Synced(False, 5, AHEAD), PLAIN)
    assert len(warnings) == 1 and "behind the run's clock by 3.0s" in warnings[0]
    assert reasons and all(r is not None and "behind the run's clock" in r for r in reasons)
    # A successful round says so, and a later stretch of misses warns again.
    state, actions = transition(state, Averaged(OK, PEERS), PLAIN)
    assert Contributing(None) in actions and state.misses == 0 and not state.warned


def test_not_contributing_reasons_name_the_cause() -> None:
    state = replace(AT5, misses=MISSES_BEFORE_WARNING)
    other = replace(PEERS, other_settings="0123456789abcdef")
    _, actions = transition(state, Averaged(NOBODY, other), PLAIN)
    assert any(isinstance(a, Warn) and "other settings than the run" in a.text for a in actions)
    _, actions = transition(state, Averaged(BANNED, PEERS), PLAIN)
    assert any(isinstance(a, Warn) and "banned" in a.text for a in actions)
    _, actions = transition(state, Averaged(NOBODY, replace(PEERS, reducers=0)), PRIVATE)
    assert any(
        isinstance(a, Warn) and "no peer of this run can reduce for a private peer" in a.text for a in actions
    )
    # That one is definite: said at the first round without a group, not after three.
    _, actions = transition(AT5, Averaged(NOBODY, replace(PEERS, reducers=0)), PRIVATE)
    assert any(isinstance(a, Warn) and "no public reducer in this run" in a.text for a in actions)
    # With reducers in the run that never meet us, a private peer is pointed at them, not at its peers.
    _, actions = transition(state, Averaged(NOBODY, replace(PEERS, reducers=2)), PRIVATE)
    warning = next(a.text for a in actions if isinstance(a, Warn))
    assert "2 node(s) of the run can reduce for a private peer" in warning, warning
    _, actions = transition(state, Averaged(NOBODY, PEERS), PLAIN)
    assert any(isinstance(a, Warn) and "are the other peers reachable?" in a.text for a in actions)
    # Alone in the run nobody could be in a round with us: no warning, however long.
    _, actions = transition(replace(AT5, misses=10), Averaged(NOBODY, QUIET), PLAIN)
    assert not any(isinstance(a, Warn) for a in actions)
