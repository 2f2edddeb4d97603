"""The round protocol as one pure transition function: (state, event) → (state, actions).

A peer's life is a loop of rounds on the run's clock (`clock.py`):

    Begin ─▶ CheckRun ─▶ Train ─▶ Closed ─▶ Average ─▶ Averaged ─▶ Train ─▶ …
                  │                 │                      │
                  └─▶ Download ◀────┴──────────────────────┘ (the run is ahead of us, or we diverged)
                          └─▶ Synced ─▶ Train

With `outer.overlap` delayed or streaming a round averages while the next one trains: Closed launches it
(`Launch`, then `Train`) and the next Closed awaits it (`AwaitRound` → Averaged) before launching the
next. A peer that re-syncs then may get the run's round in flight with the donor's state (`Synced` with
`caught_up`): it holds that round as in flight and applies it at the next close (`caught_up`). Every decision below is made from the event's facts alone, so each row of the table in
`tests/test_round_machine.py` is one line of this file: which outcome a round ends as, and what the
peer does next. The driver (`driver.py`) performs the actions; nothing here does I/O or keeps time.

The rules that keep every member's θ_global bit-identical live elsewhere (tickets, exact all-reduce,
one code path for the outer step); the rules here decide *when* a peer applies, keeps, re-syncs or
steps back:
- a complete average that at least two trainers holding the group's θ_global share is applied;
- a peer whose θ_global is not the group's, or not most of the run's at its step, re-syncs;
- a peer the run left behind (at the close, or after a round that did not complete) re-syncs and keeps
  its progress not yet averaged (the download rebases it), so its tokens still count;
- a peer that found no group keeps its progress for the next round, unless no other trainer is alive:
  then it applies its own pseudo-gradient (alone), but a private peer only where it could step back;
- a private peer that is one step ahead of everyone, who all hold its previous θ_global, steps back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dilocod.rounds.events import (
    SUCCESS,
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
    Event,
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
from dilocod.rounds.reasons import no_reducer, not_contributing_reason

STRANDED_ROUNDS = 2  # rounds without a group, every other peer behind us, before stepping back
MISSES_BEFORE_WARNING = 3  # rounds in a row without a successful one while others are live


@dataclass(frozen=True)
class MachineSettings:
    overlapped: bool = False  # outer.overlap delayed/streaming: a round averages while the next trains
    can_step_back: bool = False  # a private peer (serves no state) without overlap
    private: bool = False
    checkpoint_every: int = 1  # rounds between checkpoints (outer.fragments with streaming)


@dataclass(frozen=True)
class RoundState:
    step: int  # our outer step (θ_global)
    in_flight: bool = False  # a round we launched is averaging in the background
    stranded: int = 0  # rounds in a row without a group while every other trainer was behind us
    misses: int = 0  # rounds in a row not in a successful round while other trainers were live
    warned: bool = False  # the not-contributing warning was given (once per stretch of misses)
    since_checkpoint: int = 0
    stopped: bool = False

    @property
    def round(self) -> int:
        """The round we train: our step, plus one while a launched round is in flight."""
        return self.step + int(self.in_flight)


def transition(state: RoundState, event: Event, settings: MachineSettings) -> tuple[RoundState, list[Action]]:
    """The next state, and the actions to perform in order; the last action is always a command."""
    if state.stopped:
        return state, [Stop()]
    if isinstance(event, Stopping):
        return replace(state, stopped=True), [Stop()]
    if isinstance(event, Begin):
        return state, [CheckRun()]
    if isinstance(event, RunChecked):
        return _on_checked(state, event.facts)
    if isinstance(event, Closed):
        return _on_closed(state, event.facts, settings)
    if isinstance(event, Averaged):
        return _on_averaged(state, event.attempt, event.facts, settings)
    if isinstance(event, Synced):
        return _on_synced(state, event, settings)
    raise TypeError(f"unknown event {event!r}")


def _on_checked(state: RoundState, facts: RunFacts) -> tuple[RoundState, list[Action]]:
    if facts.best_step > state.step:
        return state, [Download(state.step + 1)]
    if facts.diverged:
        return state, [Record(Outcome.DIVERGED), Download(state.step, force=True)]
    return state, [Train()]


def _on_closed(
    state: RoundState, facts: RunFacts, settings: MachineSettings
) -> tuple[RoundState, list[Action]]:
    if settings.overlapped:
        if state.in_flight:  # settle the round launched a round ago before launching this one
            return state, [AwaitRound()]
        return replace(state, in_flight=True), [Launch(), Train()]
    if facts.best_step > state.step:  # the run closed our round without us: no group would meet us
        state = _missed(state, Outcome.LATE, facts, settings)
        actions: list[Action] = [Record(Outcome.LATE), *_contributing(state, Outcome.LATE, facts, settings)]
        return _warned(state, actions), [*actions, Download(state.step + 1)]
    if facts.diverged:
        return _missed(state, Outcome.DIVERGED, facts, settings), [
            Record(Outcome.DIVERGED),
            Download(state.step, force=True),
        ]
    return state, [Average()]


def _on_averaged(
    state: RoundState, attempt: Attempt, facts: RunFacts, settings: MachineSettings
) -> tuple[RoundState, list[Action]]:
    state = replace(state, in_flight=False)
    outcome, effects = _settle(state, attempt, facts, settings)
    next_state = _after(state, outcome, facts, settings)
    actions: list[Action] = [*effects, *_contributing(next_state, outcome, facts, settings)]
    # The round's record comes right after the step it made (the API never shows a step without its
    # round), then the others' clocks learn of it; evaluating waits until both are done.
    if outcome in SUCCESS or outcome in (Outcome.STEPPED_BACK, Outcome.CAUGHT_UP):
        actions.append(Publish())
    if outcome in SUCCESS:
        actions.append(Evaluate())
    if outcome is not Outcome.CAUGHT_UP:
        # A joiner that caught up wrote a checkpoint at its re-sync a moment ago; here it must launch its
        # round before the run's group forms (a slow one that first waited for that write missed it).
        actions, next_state = _maybe_checkpoint(next_state, actions, settings)
    command = _next_command(next_state, outcome, facts, settings)
    if any(isinstance(a, Launch) for a in command):
        next_state = replace(next_state, in_flight=True)
    return _warned(next_state, actions), [*actions, *command]


def _settle(
    state: RoundState, attempt: Attempt, facts: RunFacts, settings: MachineSettings
) -> tuple[Outcome, list[Action]]:
    """The outcome of an averaging attempt and its effects (not yet the next command)."""
    size, seconds = attempt.group_size, attempt.seconds
    if attempt.adopted and attempt.has_average:  # the run's round in flight, from our donor
        return Outcome.CAUGHT_UP, [Apply(), Record(Outcome.CAUGHT_UP, attempt.majority_size, seconds)]
    if attempt.succeeded:
        return Outcome.OK, [Apply(), Record(Outcome.OK, attempt.majority_size, seconds)]
    if attempt.found_group and attempt.banned:
        return Outcome.BANNED, [Keep(), Record(Outcome.BANNED, size, seconds)]
    if attempt.found_group and not attempt.in_majority and attempt.error is None:
        return Outcome.DIVERGED, [Keep(), Record(Outcome.DIVERGED, size, seconds)]
    if attempt.found_group and not attempt.has_average:
        return Outcome.FAILED, [Keep(), Record(Outcome.FAILED, size, seconds, attempt.error)]
    # No group, or one in which no other trainer's θ_global was ours (only helpers met us).
    if facts.best_step > state.step:
        return Outcome.LATE, [Keep(), Record(Outcome.LATE, 0, seconds)]
    stranded_long = state.stranded + 1 >= STRANDED_ROUNDS
    if facts.others > 0 and settings.can_step_back and facts.behind_on_previous and stranded_long:
        return Outcome.STEPPED_BACK, [Keep(), StepBack(), Record(Outcome.STEPPED_BACK)]
    if facts.others > 0 or facts.seen_recently or not _may_go_alone(settings):
        return Outcome.NO_GROUP, [Keep(), Record(Outcome.NO_GROUP, 0, seconds)]
    return Outcome.ALONE, [Apply(alone=True), Record(Outcome.ALONE, 1, seconds)]


def _may_go_alone(settings: MachineSettings) -> bool:
    """Whether a peer that sees no other trainer may take an outer step on its own. A private peer serves no
    state, so a trainer that shows up after its lone step could never download it; without overlap the
    private peer steps back to meet it, with overlap it cannot, and the two would train apart for good. So a
    private peer with overlap keeps its progress until someone meets it."""
    return not settings.private or settings.can_step_back


def _after(state: RoundState, outcome: Outcome, facts: RunFacts, settings: MachineSettings) -> RoundState:
    """Our step and counters after a settled round."""
    applied = outcome in SUCCESS or outcome is Outcome.CAUGHT_UP
    step = state.step + 1 if applied else state.step - int(outcome is Outcome.STEPPED_BACK)
    stranded = 0
    if outcome is Outcome.NO_GROUP and settings.can_step_back and facts.behind_on_previous:
        stranded = state.stranded + 1
    state = replace(state, step=step, stranded=stranded)
    if outcome in SUCCESS:
        return replace(state, misses=0, warned=False)
    if outcome is Outcome.CAUGHT_UP:  # back in step, but not yet in a round: our next one says
        return state
    return _missed(state, outcome, facts, settings)


def _missed(state: RoundState, outcome: Outcome, facts: RunFacts, settings: MachineSettings) -> RoundState:
    """Count a round we were not in, if others were live (alone, nobody could be in it with us)."""
    if facts.others == 0 or outcome is Outcome.STEPPED_BACK:
        return state
    return replace(state, misses=state.misses + 1)


def _contributing(
    state: RoundState, outcome: Outcome, facts: RunFacts, settings: MachineSettings
) -> list[Action]:
    """Say whether we contribute (every round), and warn once when we have not for a while."""
    if outcome in SUCCESS:
        return [Contributing(None)]
    if outcome is Outcome.CAUGHT_UP:
        return []
    definite = no_reducer(facts, private=settings.private)  # no need to wait for more misses
    if (state.misses < MISSES_BEFORE_WARNING and not definite) or facts.others == 0:
        return []
    reason = not_contributing_reason(outcome, facts, private=settings.private)
    actions: list[Action] = [Contributing(reason)]
    if not state.warned:
        count = "" if definite else f" for {state.misses} rounds while others train"
        actions.append(Warn(f"not in a successful round{count}: {reason}"))
    return actions


def _warned(state: RoundState, actions: list[Action]) -> RoundState:
    return replace(state, warned=True) if any(isinstance(a, Warn) for a in actions) else state


def _maybe_checkpoint(
    state: RoundState, actions: list[Action], settings: MachineSettings
) -> tuple[list[Action], RoundState]:
    due = state.since_checkpoint + 1 >= settings.checkpoint_every
    if due:
        return [*actions, Checkpoint()], replace(state, since_checkpoint=0)
    return actions, replace(state, since_checkpoint=state.since_checkpoint + 1)


def _next_command(
    state: RoundState, outcome: Outcome, facts: RunFacts, settings: MachineSettings
) -> list[Action]:
    """After a settled round: re-sync if we must, else train on (launching this round first, with overlap)."""
    if outcome is Outcome.DIVERGED:
        return [Download(state.step, force=True)]
    if facts.best_step > state.step and outcome is not Outcome.STEPPED_BACK:
        return [Download(state.step + 1)]
    if settings.overlapped:
        return [Launch(), Train()]
    return [Train()]


def _on_synced(
    state: RoundState, event: Synced, settings: MachineSettings
) -> tuple[RoundState, list[Action]]:
    if not event.adopted:  # the round that sent us here was counted as missed already
        state = replace(state, in_flight=False)
        failed: list[Action] = [
            Record(Outcome.SYNC_FAILED),
            *_contributing(state, Outcome.SYNC_FAILED, event.facts, settings),
        ]
        return _warned(state, failed), [*failed, Train(hold=True)]
    state = replace(state, step=event.step, in_flight=False, stranded=0, since_checkpoint=0)
    adopted: list[Action] = [Record(Outcome.RESYNCED), Publish(), Checkpoint()]
    if settings.overlapped and event.caught_up:
        # The donor handed us the run's round in flight with its state: that round is ours to apply at the
        # next close, as every member does, and our progress goes out in the round launched then.
        return replace(state, in_flight=True), [*adopted, Train()]
    if settings.overlapped:
        # The run launched the round of the step we adopted at its last close, and it had not completed
        # when our donor served us: launch ours now (our rebased progress) to meet that group.
        return replace(state, in_flight=True), [*adopted, Launch(), Train()]
    return state, [*adopted, Train()]
