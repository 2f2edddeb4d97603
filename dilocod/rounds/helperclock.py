"""When an auxiliary reducer (the bootstrap, a helper) enters a round's matchmaking, and under which key.

A group meets under the outer step its trainers send from (their tickets' `outer_step`). An auxiliary
reducer trains nothing, so it takes both the moment and the key from the trainers' status records:

- `outer.overlap = none`: a round's group forms at its close, under the step the round trains from (the
  record's `round`, which then equals its `outer_step`). The reducer enters at the close the run's clock
  gives (`clock.py`), once per instance of the round (a round that failed, or that the trainers stepped
  back to, opens again later and is a new instance).
- `delayed` / `streaming`: a round averages while the next one trains. At a close a trainer first settles
  the round in flight, then launches this round's averaging and opens the next round at once, publishing
  both. The key it launches is its outer step *after* settling: the round number it just closed when the
  round in flight was applied, one less when it was not (that round's progress goes out again). No record
  made before the close can say which, so the reducer follows the launch itself: once the trainers' records
  show a round opened, it enters that launch's matchmaking under the trainers' outer step, while the
  matchmaking window can still meet them. Following the close with the round number as key (as without
  overlap) stayed one step off after any round that was not applied, and never met the trainers again.

Pure functions of the decoded records and the time; `dilocod/node/helper.py` performs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dilocod.rounds import clock
from peers.vote import plurality

# How far the run's estimate of when a round opened may move as more trainers' records arrive (it is the
# median of what they say, and they open a round within a fraction of a second of each other). A launch
# reopened under the same key is at least one round of inner steps later.
OPENED_DRIFT_SECONDS = 1.0


@dataclass(frozen=True)
class DueRound:
    """The round most live trainers are in, as the records show it."""

    round: int  # the round they train
    key: int  # the outer step most of them are at (their tickets' step when they launch)
    opened: float | None  # when it opened (median of what they say); None when none says
    close: clock.Close
    trainers: int  # trainers in it or arriving in it


@dataclass(frozen=True)
class Joined:
    """The round instance we entered last."""

    round: int
    key: int
    at: float  # unix time we entered its matchmaking


def next_round(records: list[dict[str, Any]], settings: clock.ClockSettings, now: float) -> DueRound | None:
    """The round most live trainers train, its key, when it opened and closes, and how many train it."""
    progress = [p for r in records if (p := clock.progress_from_record(r)) is not None]
    fresh = [p for p in progress if now - p.time <= settings.stale_after]
    vote = plurality(-p.round for p in fresh)  # negated: a tie goes to the later round (the others catch up)
    if vote is None:
        return None
    round_index = -vote.winner
    trainers = clock.in_round(fresh, round_index, now, settings.stale_after)
    arriving = clock.in_round(fresh, round_index - 1, now, settings.stale_after)
    said = [p.opened for p in trainers if p.opened is not None]
    opened = clock.round_opened(trainers, fallback=now)
    joining = clock.joining_records(records, round_index, now, settings.stale_after)
    close = clock.estimate_close(trainers, settings, now, opened, arriving, joining)
    key = _key(records, {p.peer_id for p in trainers}, round_index)
    return DueRound(round_index, key, opened if said else None, close, len(trainers) + len(arriving))


def _key(records: list[dict[str, Any]], peers: set[str], round_index: int) -> int:
    """The outer step most of the round's trainers are at (a tie goes to the later step); the round number
    when no record says."""
    latest: dict[str, dict[str, Any]] = {}
    for r in records:
        peer = str(r.get("peer_id"))
        ours = peer in peers and r.get("round") == round_index and r.get("outer_step") is not None
        if ours and (peer not in latest or float(r["time"]) > float(latest[peer]["time"])):
            latest[peer] = r
    vote = plurality(-int(r["outer_step"]) for r in latest.values())
    return round_index if vote is None else -vote.winner


def due_at_close(last: Joined | None, due: DueRound, now: float) -> bool:
    """Without overlap: whether to enter the round's matchmaking now: its close has come, and we have not
    joined this instance of it. Trainers' reports of when a round opened drift as their records arrive, so
    an instance is told by time: one that opened after we joined is a new one. No report of when it opened
    is no sign of a new instance."""
    if last is not None and last.round == due.round and (due.opened is None or due.opened <= last.at):
        return False
    return due.close.at <= now


def due_at_launch(last: Joined | None, due: DueRound, now: float, window: float) -> bool:
    """With overlap: whether to enter the matchmaking the trainers launched when their current round opened:
    it opened no more than `window` (the matchmaking timeout) ago, and we have not joined this launch.

    A round opened by a launch is ahead of the trainers' outer step (the round they closed is in flight).
    One that is not (the run's first round, or a round after a re-sync) opened without a launch: its group
    forms at its close, so there is nothing to join yet. Joining it at once held a matchmaking open from the
    start of the run, and the first trainer to close its first round, a moment before the others, met us
    alone: a group of one trainer, and θ_global split two ways."""
    if due.key >= due.round or due.opened is None or now - due.opened > window:
        return False
    if last is None or (last.round, last.key) != (due.round, due.key):
        return True
    return due.opened > last.at + OPENED_DRIFT_SECONDS
