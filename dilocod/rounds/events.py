"""The vocabulary of the round machine: what can happen to a peer (events), what it does about it
(actions), what a round ends as (outcomes), and the facts each decision is made from.

Everything here is plain frozen data. `machine.transition` maps (state, event) to actions; the driver
performs them and turns what happened into the next event.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Outcome(StrEnum):
    """How one round (or an attempt to get back in step) ended, as its history entry records it."""

    OK = "ok"  # our group's average was applied: a new θ_global
    ALONE = "alone"  # no other trainer alive: our own pseudo-gradient was applied
    NO_GROUP = "no_group"  # no group formed (or only helpers met us): our progress waits for the next round
    FAILED = "failed"  # a group formed but the round did not complete: our progress waits
    DIVERGED = "diverged"  # our θ_global was not the group's (or most of the run's at our step): re-sync
    BANNED = "banned"  # most of our group bans us: our contribution did not count
    LATE = "late"  # the run closed our round without us: re-sync, keeping our progress
    RESYNCED = "resynced"  # adopted θ_global and the outer momentum from a peer
    # overlap: applied the round in flight that the donor handed us with its state (we were not in it)
    CAUGHT_UP = "caught_up"
    SYNC_FAILED = "sync_failed"  # wanted to re-sync, but no donor's state could be adopted
    STEPPED_BACK = "stepped_back"  # went back to our previous θ_global to meet peers behind us
    UNDONE = "undone"  # a round we applied and stepped back from (set on its history entry afterwards)


SUCCESS = frozenset({Outcome.OK, Outcome.ALONE})


@dataclass(frozen=True)
class RunFacts:
    """What the run's status records say, relative to us (`facts.run_facts` computes it)."""

    others: int = 0  # live trainers other than us
    best_step: int = -1  # the highest outer step they report (−1: none)
    diverged: bool = False  # most trainers at our step hold another θ_global than ours
    behind_on_previous: bool = False  # every other trainer is behind us, most at our previous step and θ
    seen_recently: bool = False  # another trainer was seen lately (a DHT or link hiccup is no departure)
    late_by: float | None = None  # seconds since the run opened a round after ours (when it is ahead)
    other_settings: str | None = None  # the manifest hash every other trainer reports, when not ours
    other_settings_keys: tuple[str, ...] = ()  # where that manifest differs from ours (() unknown)
    reducers: int = 1  # nodes that can reduce for a private peer (public peers and helpers)


@dataclass(frozen=True)
class Attempt:
    """What one averaging attempt gave (from `peers.group.RoundOutcome`)."""

    found_group: bool
    complete: bool = False
    in_majority: bool = False
    banned: bool = False
    has_average: bool = False  # an average we may apply arrived
    majority_size: int = 0  # trainers that held the group's θ_global (they all apply the result)
    contributors: int = 0  # contributions that counted (tokens > 0)
    group_size: int = 0
    seconds: float = 0.0
    error: str | None = None
    adopted: bool = False  # the average is a donor's round in flight, handed us with its state

    @property
    def succeeded(self) -> bool:
        return self.has_average and self.majority_size >= 2 and self.contributors >= 1


# ---- events ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Begin:
    """The peer started (fresh or from a checkpoint)."""


@dataclass(frozen=True)
class RunChecked:
    facts: RunFacts


@dataclass(frozen=True)
class Closed:
    """The run's clock closed the round we were training."""

    facts: RunFacts


@dataclass(frozen=True)
class Averaged:
    """An averaging attempt ended (awaited at once, or a round later with overlap)."""

    attempt: Attempt
    facts: RunFacts


@dataclass(frozen=True)
class Synced:
    """A re-sync ended: `adopted` a donor's state at `step`, or not."""

    adopted: bool
    step: int
    facts: RunFacts = RunFacts()
    # overlap: the donor's round in flight came with its state; it is applied at our next close
    caught_up: bool = False


@dataclass(frozen=True)
class Stopping:
    """SIGINT/SIGTERM."""


Event = Begin | RunChecked | Closed | Averaged | Synced | Stopping


# ---- actions: effects (performed in order) ----------------------------------------------------------------
@dataclass(frozen=True)
class Apply:
    """Take the outer step: with the group's average, or (alone) with our own pseudo-gradient."""

    alone: bool = False


@dataclass(frozen=True)
class Keep:
    """The round was not applied: our progress stays for the next one."""


@dataclass(frozen=True)
class StepBack:
    """Go back to the θ_global and momentum we held before our last outer step."""


@dataclass(frozen=True)
class Record:
    outcome: Outcome
    group_size: int = 0
    seconds: float = 0.0
    detail: str | None = None  # a reason worth a log line (a failed round's error)


@dataclass(frozen=True)
class Contributing:
    """Whether we count in the run's rounds, and if not, why (shown in /api/status)."""

    reason: str | None  # None: contributing


@dataclass(frozen=True)
class Warn:
    text: str


@dataclass(frozen=True)
class Publish:
    """Publish our status record now (our round changed: the others' clocks should know)."""


@dataclass(frozen=True)
class Evaluate:
    """Evaluate the new θ_global if this step is due (`trainer.eval_every`), into the round's record."""


@dataclass(frozen=True)
class Checkpoint:
    pass


@dataclass(frozen=True)
class Launch:
    """Start averaging this round's pseudo-gradient in the background (overlap) and train on."""


# ---- actions: commands (the last action of a transition; its result is the next event) ------------------
@dataclass(frozen=True)
class CheckRun:
    pass


@dataclass(frozen=True)
class Train:
    """Train until the run's clock closes the round (at least one inner step). With ``hold`` the round is
    not cut short when the run is past it: after a failed re-sync there is nothing better to do than
    train, and cutting at once would retry the download in a tight loop."""

    hold: bool = False


@dataclass(frozen=True)
class Average:
    """Average this round's pseudo-gradient with the group now and wait for the result."""


@dataclass(frozen=True)
class AwaitRound:
    """Wait for the round averaging in the background (overlap)."""


@dataclass(frozen=True)
class Download:
    """Re-sync: download θ_global and the outer momentum from a peer at `min_step` or later."""

    min_step: int
    force: bool = False  # also from our own step (we diverged)


@dataclass(frozen=True)
class Stop:
    """Let a round that is exchanging tensors finish our parts, then stop."""


Effect = Apply | Keep | StepBack | Record | Contributing | Warn | Publish | Evaluate | Checkpoint | Launch
Command = CheckRun | Train | Average | AwaitRound | Download | Stop
Action = Effect | Command
