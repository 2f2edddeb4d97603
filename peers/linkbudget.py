"""Deadlines from the model and the link: how long a round's phases and a state download may take.

A fixed deadline fits one model on one link. The code's old defaults (matchmaking 15 s, all-reduce
60 s, a state download 60 s, a round at most 1,800 s) suit the tiny preset on loopback; a 1B run over
100 Mbit/s moves ~0.5 GB per member per round with int4 and 8 GB per state download, and those
deadlines cut every round and every join. So when the operator leaves a deadline at 0 (auto), it is

    all-reduce  = SLACK × (2·(n−1)/n · |Δ| / rate  +  elements × CPU_SECONDS_PER_ELEMENT)
    matchmaking = window(n) + 2 × request_timeout + SLACK × elements × PREPARE_SECONDS_PER_ELEMENT
    state       = SLACK × state bytes / rate + STATE_SETUP_SECONDS
    round       = the state rule at the conservative default rate (a round must outlast a joiner's hold)

each never below the old default (a small model on a fast link keeps exactly the deadlines it had).
|Δ| = elements × the codec's bytes per value; 2·(n−1)/n·|Δ| is what a member of a butterfly all-reduce
of n members sends (and receives): its share of every other member's parts, then its averaged part to
each of them. The CPU term is the codec, the reduction and the copies, which on a loaded CPU take longer
than the bytes (a 124m all-reduce took 19 s on loopback with 3 processes on 2 cores). `rate` is this
node's measured goodput (`LinkEstimate`): before its first measurement the operator's `net.bandwidth`,
else a conservative 10 Mbit/s. A deadline too long costs only when a peer dies; one too short fails
every round, and a round that fails is never measured, so the guess errs long.

Pure arithmetic, no I/O: `tests/test_linkbudget.py` tables it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

MBIT = 1e6 / 8  # bytes per second in one Mbit/s
DEFAULT_RATE = 10 * MBIT  # before any measurement and without net.bandwidth: a slow home uplink
MIN_RATE = 0.5 * MBIT  # the slowest link a timed-out first round makes us assume
SLACK = 3.0  # a deadline is this many times the estimate (hivemind's advice: ≈ 2× the all-reduce time)
CPU_SECONDS_PER_ELEMENT = 1e-7  # codec + robust reduction + copies, per element, on a loaded CPU
PREPARE_SECONDS_PER_ELEMENT = 1e-8  # Δ, its codec and the copy to the averager before a peer can meet
STATE_SETUP_SECONDS = 10.0  # finding a donor, its snapshot, verifying the hash
REQUEST_WINDOW_PER_MEMBER = 0.25  # the leader admits followers one request at a time (peers/grouping.py)

# The old fixed defaults: the floors of every auto deadline.
MIN_MATCHMAKING = 15.0
MIN_ALLREDUCE = 60.0
MIN_STATE = 60.0
MIN_ROUND = 1800.0


@dataclass(frozen=True)
class ModelSize:
    """What a run moves: its parameter count and the codec's bytes per value on the wire."""

    elements: int  # parameters of the model (Δ, θ_global and the momentum each have this many)
    wire_bytes_per_element: float  # averaging.compression: 4 (none), 2 (fp16), ~1.008 (int8), ~0.53 (int4)
    state_tensors: int = 2  # θ_global and the outer momentum; 3 with a round in flight (overlap)

    @property
    def delta_bytes(self) -> float:
        return self.elements * self.wire_bytes_per_element

    @property
    def state_bytes(self) -> float:
        return self.elements * 4.0 * self.state_tensors  # fp32 on the wire


@dataclass(frozen=True)
class Deadlines:
    matchmaking: float
    allreduce: float
    state: float
    round_max: float


def allreduce_bytes(delta_bytes: float, group: int, reducers: int | None = None) -> float:
    """Bytes the busiest member of a butterfly all-reduce of `group` members sends (and as many it receives),
    when `reducers` of them (None: all) each reduce an equal share of the parts: a reducer sends the rest of
    its own Δ, (1 − 1/R)·|Δ|, and the results of its share to the n − 1 others, (n − 1)/R·|Δ|. With every
    member reducing that is 2(n − 1)/n·|Δ|; a group of every live trainer with at most `group_size` of them
    reducing loads each reducer with about n/R times more (counted as 2(n − 1)/n, the deadline fell short
    of a 320-member round in the scale simulation, bench/netsim)."""
    n = max(2, group)
    r = n if reducers is None else min(n, max(1, reducers))
    return (r + n - 2) / r * delta_bytes


def allreduce_deadline(size: ModelSize, group: int, rate: float, reducers: int | None = None) -> float:
    transfer = allreduce_bytes(size.delta_bytes, group, reducers) / rate
    # a capped reducer also decodes, screens and reduces n/R times the elements of an all-reducing member
    load = allreduce_bytes(1.0, group, reducers) / allreduce_bytes(1.0, group)
    compute = size.elements * CPU_SECONDS_PER_ELEMENT * load
    return max(MIN_ALLREDUCE, SLACK * (transfer + compute))


def matchmaking_deadline(size: ModelSize, group: int, min_window: float, request_timeout: float) -> float:
    window = max(min_window, REQUEST_WINDOW_PER_MEMBER * group)
    prepare = SLACK * size.elements * PREPARE_SECONDS_PER_ELEMENT
    return max(MIN_MATCHMAKING, window + 2 * request_timeout + prepare)


def state_deadline(size: ModelSize, rate: float) -> float:
    return max(MIN_STATE, SLACK * size.state_bytes / rate + STATE_SETUP_SECONDS)


def round_deadline(size: ModelSize) -> float:
    """`round.max_seconds` is run-wide: every peer's clock must close a round at the same moment, so it
    follows the model alone (a state download at the conservative default rate), never a node's link."""
    return max(MIN_ROUND, state_deadline(size, DEFAULT_RATE))


def deadlines(
    size: ModelSize, group: int, rate: float, *, min_window: float, request_timeout: float
) -> Deadlines:
    """Every auto deadline for this model, a group of `group` members and a link of `rate` bytes/s."""
    if rate <= 0 or group < 1 or size.elements < 0:
        raise ValueError(f"bad link budget inputs: rate {rate}, group {group}, elements {size.elements}")
    return Deadlines(
        matchmaking=matchmaking_deadline(size, group, min_window, request_timeout),
        allreduce=allreduce_deadline(size, group, rate),
        state=state_deadline(size, rate),
        round_max=round_deadline(size),
    )


class LinkEstimate:
    """This node's goodput in bytes/s: the slowest of its recent transfers (all-reduces and state
    downloads), or `prior` before the first. Small transfers are latency, not bandwidth, and are left out."""

    MIN_BYTES = 4 << 20  # a transfer smaller than this says little about the link
    WINDOW = 8

    def __init__(self, prior: float) -> None:
        self.prior = prior
        self._recent: deque[float] = deque(maxlen=self.WINDOW)

    def observe(self, nbytes: float, seconds: float) -> None:
        """One completed transfer: `nbytes` in one direction over `seconds`."""
        if nbytes >= self.MIN_BYTES and seconds > 0:
            self._recent.append(nbytes / seconds)

    def timed_out(self) -> None:
        """An all-reduce was cut by its deadline before any measurement: assume half the rate (down to
        MIN_RATE), so the next deadline is longer and a first round can complete to be measured."""
        self.prior = max(MIN_RATE, self.prior / 2)

    @property
    def measured(self) -> bool:
        return bool(self._recent)

    @property
    def rate(self) -> float:
        return min(self._recent) if self._recent else self.prior


def prior_rate(bandwidth_mbit: float | None) -> float:
    """The rate before any measurement: the operator's stated Mbit/s, else the conservative default."""
    return DEFAULT_RATE if bandwidth_mbit is None else bandwidth_mbit * MBIT


@dataclass(frozen=True)
class LinkRule:
    """What a node's averager needs to keep its auto deadlines following its measured link."""

    size: ModelSize
    prior: float  # bytes/s before the first measurement
    allreduce: bool  # the all-reduce deadline's ceiling is auto
    state: bool  # the state download's deadline is auto
