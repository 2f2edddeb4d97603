"""The run's round clock: when the round every trainer is in closes, derived from what the peers publish.

A round belongs to the run, not to a peer. Every trainer publishes, in its status record, the round it
trains (`round`), the tokens it trained in that round so far (`round_tokens`), its throughput and the time
the round opened. Every peer (and every auxiliary reducer) computes the same estimate from the same records:

    expected tokens now = Σ over live trainers in the round of  tokens_i + tokens_per_second_i · age_i
                          (the age term only for a trainer whose record says it is taking inner steps)
    close = now + (target − expected) / Σ tokens_per_second_i,   at the latest  opened + max_seconds

which is how hivemind's collaborative optimizer schedules its global steps (its progress tracker), with
tokens for samples. `target` is `round.tokens`, or with 0 (auto) `trainer.inner_steps` × the tokens of one
inner step of a one-device peer (the median of what the trainers publish) × the live trainers: a peer of
average speed then takes H inner steps a round, whatever the others do. Every peer trains right up to the close and enters matchmaking then, so
the group meets at once: a faster peer takes more inner steps that round, a slower one fewer, and both
are weighted by their tokens (`peers/membership.py`).

A peer that downloads the run's state to join a round (it restarted, or the run closed a round without
it) says so in its record (`joining`: the round it will train, `joining_since`). The round then stays open
for it — the others train on — until it has the state, at most `join_wait` (a state download's timeout)
after it began: once in step it stays in step, whereas a run that closed without it would send it to
download again, and a download longer than a round would keep it out for good.

Pure functions of numbers: the driver feeds them records and our own live counters. A record older than
`stale_after` is left out (its peer stopped publishing: frozen, dead or cut off).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RoundConfig:
    """`[round]`: the run's clock. Every peer must use the same values (they are part of the settings hash)."""

    tokens: int = 0  # tokens the run trains per round; 0 = trainer.inner_steps × one step's tokens × trainers
    # a round closes at the latest this long after it opened; 0 = auto: from the model's size alone (the
    # same on every peer), at least 1800 s (peers/linkbudget.py)
    max_seconds: float = 0.0

    def validate(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 0:
            raise ValueError(f"round.tokens must be an integer >= 0 (0 = auto), got {self.tokens!r}")
        if not (math.isfinite(self.max_seconds) and self.max_seconds >= 0):
            raise ValueError(f"round.max_seconds must be >= 0 seconds (0 = auto), got {self.max_seconds}")


@dataclass(frozen=True)
class Progress:
    """One trainer's place in a round, from its status record (or our own counters)."""

    peer_id: str
    round: int
    tokens: int  # trained in this round so far
    tokens_per_second: float
    time: float  # unix time the numbers were taken
    opened: float | None  # unix time the round opened, as this peer knows it
    reference_tokens: int | None = None  # its H × batch × seq_len (for the auto target)
    # Taking inner steps when the numbers were taken. Only then do its tokens grow after `time`: a peer
    # evaluating, matchmaking or averaging trains nothing, and projecting its rate over those seconds
    # would close the run's rounds early (by its eval time × its rate, every round).
    training: bool = True


@dataclass(frozen=True)
class ClockSettings:
    target_tokens: int  # round.tokens; 0 = auto (the median reference_tokens × live trainers)
    reference_tokens: int  # ours: tokens of H inner steps of a one-device peer
    max_seconds: float  # round.max_seconds: the latest a round closes after it opened
    stale_after: float  # a record older than this is left out (seconds)
    join_wait: float = 0.0  # longest a round stays open for a peer downloading the state to join it

    def target(self, trainers: list[Progress]) -> int:
        """Tokens the run trains per round with these live trainers: `round.tokens`, or the median of their
        reference tokens (ours when none says) × their number."""
        if self.target_tokens > 0:
            return self.target_tokens
        stated = [p.reference_tokens for p in trainers if p.reference_tokens]
        reference = int(statistics.median(stated)) if stated else self.reference_tokens
        return reference * max(1, len(trainers))


@dataclass(frozen=True)
class Close:
    """When the round closes, and the numbers behind it (shown in logs and `/api/status`)."""

    at: float  # unix time
    opened: float
    target: int
    expected: float  # the run's tokens in this round now
    rate: float  # the run's tokens per second
    trainers: int
    by: str  # "tokens" (the target is reached at `at`), "joining" (held for a joiner) or "max_seconds"


@dataclass(frozen=True)
class Joiner:
    """A trainer downloading the run's state to train `round` (its record's `joining`) since `since`."""

    peer_id: str
    round: int
    since: float  # unix time its download began
    time: float  # unix time of its record


def progress_from_record(record: Mapping[str, Any]) -> Progress | None:
    """A trainer's progress from its (decoded) status record; None for records without a round (older
    peers, auxiliary reducers)."""
    if record.get("role") != "peer" or record.get("round") is None or record.get("round_tokens") is None:
        return None
    if record.get("joining") is not None:  # downloading the state: in no round until it has it
        return None
    return Progress(
        peer_id=str(record["peer_id"]),
        round=int(record["round"]),
        tokens=int(record["round_tokens"]),
        tokens_per_second=float(record.get("tokens_per_second") or 0.0),
        time=float(record["time"]),
        opened=record.get("round_opened"),
        reference_tokens=record.get("reference_tokens"),
        training=record.get("training") is not False,
    )


def joiner_from_record(record: Mapping[str, Any]) -> Joiner | None:
    """A trainer's download to join a round, from its status record; None when it is not joining."""
    if record.get("role") != "peer" or record.get("joining") is None:
        return None
    time = float(record["time"])
    since = record.get("joining_since")
    # A download cannot have begun after the record saying so was made.
    return Joiner(str(record["peer_id"]), int(record["joining"]), min(time, float(since or time)), time)


def joining(joiners: Iterable[Joiner], round_index: int, now: float, stale_after: float) -> list[Joiner]:
    """The peers joining `round_index`: fresh records only, one per peer. A joiner that named an earlier
    round counts too: a donor serves its newest state, so it arrives with ours (or, if it got an older one,
    downloads again and names ours). It read the run's step from records that lag the run, and publishes
    its own a moment later, so by the time we read that the run may have closed a round or two: a slow
    joiner that named the round two before, and was not waited for, arrived late at every attempt."""
    latest: dict[str, Joiner] = {}
    for j in joiners:
        fresh = j.round <= round_index and now - j.time <= stale_after
        if fresh and (j.peer_id not in latest or j.time > latest[j.peer_id].time):
            latest[j.peer_id] = j
    return sorted(latest.values(), key=lambda j: j.peer_id)


def joining_records(
    records: Iterable[Mapping[str, Any]], round_index: int, now: float, stale_after: float
) -> list[Joiner]:
    """The peers whose (decoded) records say they are downloading the state to join `round_index`."""
    found = [j for r in records if (j := joiner_from_record(r)) is not None]
    return joining(found, round_index, now, stale_after)


def in_round(
    progress: Iterable[Progress], round_index: int, now: float, stale_after: float
) -> list[Progress]:
    """The live trainers in `round_index`: one entry per peer, fresh records only."""
    latest: dict[str, Progress] = {}
    for p in progress:
        if p.round != round_index or now - p.time > stale_after:
            continue
        if p.peer_id not in latest or p.time > latest[p.peer_id].time:
            latest[p.peer_id] = p
    return sorted(latest.values(), key=lambda p: p.peer_id)


def round_opened(trainers: Iterable[Progress], fallback: float) -> float:
    """When the round opened: the median of what its trainers say (one peer's clock or lie cannot move
    it far); `fallback` when none says."""
    opened = [p.opened for p in trainers if p.opened is not None and math.isfinite(p.opened)]
    return float(statistics.median(opened)) if opened else fallback


def estimate_close(
    trainers: list[Progress],
    settings: ClockSettings,
    now: float,
    opened: float,
    arriving: Sequence[Progress] = (),
    joiners: Sequence[Joiner] = (),
) -> Close:
    """When the round of `trainers` (all in the same round, ours included, fresh) closes.

    `arriving` are live trainers whose records still show the round before (they are applying it, or
    evaluating, and will publish the new round in a moment): they count towards the round's size and
    its rate, not yet its tokens (hivemind's tracker likewise counts every peer's throughput).
    `joiners` (fresh, joining this round) hold it open until `join_wait` after each began its download."""
    everyone = [*trainers, *arriving]
    target = settings.target(everyone)
    expected = sum(
        p.tokens + (max(0.0, now - p.time) * p.tokens_per_second if p.training else 0.0) for p in trainers
    )
    rate = sum(p.tokens_per_second for p in everyone)
    latest = opened + settings.max_seconds
    if expected >= target:
        at = now
    elif rate > 0:
        at = now + (target - expected) / rate
    else:
        at = math.inf  # nobody has measured a step yet: only max_seconds bounds the round
    by = "tokens"
    held = max((j.since + settings.join_wait for j in joiners), default=-math.inf)
    if held > at:
        at, by = held, "joining"
    if at > latest:
        by = "max_seconds"
    return Close(min(at, latest), opened, target, expected, rate, len(everyone), by)


def in_flight_done_at(
    opened: float | None, window: float, request_timeout: float, allreduce_seconds: Sequence[float]
) -> float | None:
    """With overlap: when the run's round in flight, launched at `opened` (the close that opened the round
    the run trains now), has likely completed — its matchmaking window and the request slack every
    member allows, then an all-reduce as long as the longest of the recent ones we saw (1 s if none). A
    download started after it gets that round's average with the state; None when no trainer says when
    the run's round opened."""
    if opened is None or not math.isfinite(opened):
        return None
    exchange = max((s for s in allreduce_seconds if math.isfinite(s) and s > 0), default=1.0)
    return opened + window + 2 * request_timeout + exchange


def group_target(expected_trainers: int, helpers: int, last_group: int) -> int:
    """How many members the coming group waits for (a full group starts at once; one short waits out the
    matchmaking window): the trainers the records show in our round (fresh, arriving or joining, us
    included) and the auxiliary reducers — but no fewer than our last successful group held. On a loaded
    machine or a slow DHT, records go stale for seconds while their peers train on; a leader that counted
    only the fresh ones started with half the run, and the late half formed a second group (16 peers on 2
    cores: groups of 8 + 8, then re-syncs). A peer that really left costs one window: the group that forms
    without it is the new last group."""
    return max(expected_trainers + helpers, last_group)


def should_stop(close_at: float, now: float, seconds_per_step: float | None) -> bool:
    """Whether a trainer stops before its next inner step: when that step would end nearer the close
    than after it (so a slow peer overshoots by at most half a step, and reaches matchmaking with the
    others instead of a whole step late)."""
    step = seconds_per_step or 0.0
    return now + step / 2 >= close_at


UNMEASURED_REFRESH = 0.25  # seconds between reads while nobody's throughput is known yet


def refresh_interval(close: Close | float, now: float, status_interval: float, floor: float = 0.1) -> float:
    """How soon to read the records again: often near the close, at most every status interval; often too
    while no throughput is known (the first inner step's changes the estimate completely)."""
    if isinstance(close, Close) and (close.rate <= 0 or close.by == "joining"):
        # held for a joiner: it may arrive any moment, and then the round closes at once
        return min(status_interval, UNMEASURED_REFRESH)
    left = (close.at if isinstance(close, Close) else close) - now
    if not math.isfinite(left):
        return status_interval
    return min(status_interval, max(floor, left / 4))
