"""What a peer knows about its own progress: the numbers behind `/api/status` and its DHT record.

The state is made of parts, and each part has one writer: the component that owns it is handed the part
and is the only code that assigns its fields (`tests/test_state_owners.py` checks it):

| part (attribute)      | what it holds                                   | its writer                     |
|-----------------------|-------------------------------------------------|--------------------------------|
| `facts` NodeFacts     | identity, addresses, life cycle, state transfers| the daemon, `node/peer.py`     |
| `inner` InnerProgress | inner steps, loss, throughput, threads          | `node/training.py`             |
| `rounds` RoundProgress| outer steps, the round, its history, what it does| `rounds/effects.py`           |
| `dataset` DataProgress| the run's dataset download                      | `node/dataset.py`              |
| `shards` ShardProgress| training shards held (a partial copy)           | `node/shardfetch.py`           |
| `trust` TrustCounts   | contributions refused                           | `node/judge.py`                |
| `swarm` SwarmView     | peers and DHT records seen                      | `node/publishing.py`           |
| `tokens` TokenCounts  | tokens trained, contributed, in the round       | the token ledger's own methods |

The phase is no field: `phase_of` derives it from the daemon's life cycle and the round driver's activity.
Readers (the status API, the DHT record, the progress line, the round clock) get the whole `PeerState`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from dilocod import __version__

HISTORY = 100  # rounds kept for the status API and dashboard


class Phase(StrEnum):
    """What a peer is doing (`/api/status` `phase`)."""

    STARTING = "starting"
    FETCHING_DATA = "fetching data"
    TRAINING = "training"
    AVERAGING = "averaging"
    SYNCING = "syncing"
    STOPPING = "stopping"


def phase_of(life: Phase, activity: Phase | None) -> Phase:
    """The phase shown: the daemon's life cycle until it runs rounds (and once it stops), then the round
    driver's activity (training before its first command)."""
    if life is not Phase.TRAINING:
        return life
    return activity or Phase.TRAINING


@dataclass
class RoundRecord:
    outer_step: int  # the outer step this round produced (or would have)
    result: str  # a `rounds.events.Outcome` value: ok, alone, no_group, failed, late, resynced, …
    group_size: int
    seconds: float
    global_sha256: str
    loss: float | None = None  # mean train loss of the inner steps that fed this round
    eval_loss: float | None = None  # held-out loss of the θ_global this round produced
    bytes_sent: int = 0
    bytes_received: int = 0
    time: float = field(default_factory=time.time)
    tokens: int = 0  # tokens behind our contribution to this round
    tokens_counted: float = 0.0  # of those, what reached θ_global (the weight the group gave them)
    allreduce_seconds: float = 0.0  # of `seconds`, exchanging tensors (the rest: matchmaking)
    reason: str | None = None  # why a round failed, one line (`incomplete: …` when results came back partial)
    # Seconds per phase from the end of the inner steps before this round to the start of the next ones
    # (`dilocod/rounds/phases.py`); None until those inner steps start
    phases: dict[str, float] | None = None


@dataclass
class NodeFacts:
    """Who and where we are, and our life cycle; written by the daemon (`node/peer.py`) alone."""

    run_id: str = ""
    manifest_hash: str | None = None
    peer_id: str = ""
    role: str = "peer"
    reachability: str = "unknown"
    relayed: bool = False  # our pseudo-gradients travel through a relay or public reducer, not directly
    maddrs: list[str] = field(default_factory=list)
    reference_tokens: int = 0  # tokens of H inner steps of our one-device config
    devices: int = 1  # local devices training together as this one peer
    eval_tokens_per_byte: float = 1.0  # of the dataset's eval split: turns the eval loss into bits per byte
    life: Phase = Phase.STARTING  # starting, fetching data, training (rounds run), stopping
    state_fetch: dict[str, Any] | None = None  # our latest state download in parts: its progress and donors
    state_served: dict[str, Any] | None = None  # parts of our state we served to peers that re-synced
    download_bytes_sent: int = 0  # state downloads: requests we sent ...
    download_bytes_received: int = 0  # ... and the state we received
    started: float = field(default_factory=time.time)


@dataclass
class InnerProgress:
    """The inner steps as the trainer takes them; written by `node/training.py` alone."""

    inner_step: int = 0
    loss: float = math.nan
    tokens_per_second: float = 0.0
    mfu: float | None = None  # model FLOPs utilization; None when the devices' peak is unknown (CPU)
    threads: int = (
        0  # torch threads the trainer runs on (its share of the machine's cores, or trainer.threads)
    )
    train_seconds: float = 0.0  # wall time spent in finished stretches of inner steps
    training_since: float | None = None  # time.monotonic() when the first inner step began
    stretch_since: float | None = None  # ... when the stretch of inner steps now running began

    def training_began(self, now: float) -> None:
        """A stretch of inner steps starts (`now` from time.monotonic())."""
        if self.training_since is None:
            self.training_since = now
        self.stretch_since = now

    def training_ended(self, now: float) -> None:
        if self.stretch_since is not None:
            self.train_seconds += max(0.0, now - self.stretch_since)
            self.stretch_since = None

    def compute_utilization(self, now: float | None = None) -> float:
        """Time in inner steps ÷ wall time since the first inner step began, in [0, 1] (0 before that).

        Cumulative over the whole time this process has trained (not a sliding window); the stretch of
        steps running now counts up to `now`, so the value does not sag during a long stretch.
        """
        if self.training_since is None:
            return 0.0
        now = time.monotonic() if now is None else now
        busy = self.train_seconds + (
            max(0.0, now - self.stretch_since) if self.stretch_since is not None else 0.0
        )
        wall = now - self.training_since
        return min(1.0, busy / wall) if wall > 0 else 0.0


@dataclass
class RoundProgress:
    """The rounds and what came of them; written by the round driver's effects (`rounds/effects.py`) alone."""

    activity: Phase | None = None  # training, averaging or syncing, once the driver runs
    outer_step: int = 0
    global_sha256: str = "0" * 64
    round: int = 0  # the round we train (outer_step, + 1 while a launched round is in flight)
    round_opened: float = 0.0  # unix time the round opened
    round_closes_at: float | None = None  # unix time the run's clock closes it (estimate)
    joining: int | None = None  # while we download the run's state: the round we will train with it
    joining_since: float | None = None  # ... and when that download began
    contributing: bool = True
    not_contributing_reason: str | None = None
    eval_loss: float | None = None
    sample: str | None = None  # the latest greedy completion of the run's prompt from θ_global
    sample_step: int | None = None  # ... and the outer step of that θ_global
    group_size: int = 0
    alone: bool = False
    rounds_ok: int = 0
    rounds_failed: int = 0
    resyncs: int = 0
    last_round_seconds: float | None = None
    last_round_phases: dict[str, float] | None = None  # the last gap between stretches of inner steps
    bytes_sent: int = 0  # all-reduce payload bytes sent, since this process started
    bytes_received: int = 0
    history: deque[RoundRecord] = field(default_factory=lambda: deque(maxlen=HISTORY))


@dataclass
class DataProgress:
    """The run's dataset download (whole, or the shards a partial copy fetches); `node/dataset.py` alone."""

    fetch: dict[str, Any] | None = None


@dataclass
class ShardProgress:
    """The training shards a partial copy of the dataset holds; `node/shardfetch.py` alone."""

    local: int | None = None
    total: int | None = None


@dataclass
class TrustCounts:
    """What we refused; `node/judge.py` alone (the bans themselves are the ban list's)."""

    rejected_contributions: int = 0  # contributions we refused (screened senders, implausible reducers)


@dataclass
class SwarmView:
    """What our heartbeat saw of the run; `node/publishing.py` alone."""

    peers_known: int = 0
    dht_records: int | None = None  # records our DHT node holds (stored + cached), read every heartbeat


class TokenCounts(Protocol):
    """The token ledger's numbers (`rounds/tokens.py`): written by its own methods only."""

    trained: int
    contributed: float
    round: int
    round_steps: int


@dataclass
class NoTokens:
    """Before the ledger is restored."""

    trained: int = 0
    contributed: float = 0.0
    round: int = 0
    round_steps: int = 0


@dataclass
class PeerState:
    """The parts, put together by the daemon; `status()` and `record()` read them."""

    facts: NodeFacts = field(default_factory=NodeFacts)
    inner: InnerProgress = field(default_factory=InnerProgress)
    rounds: RoundProgress = field(default_factory=RoundProgress)
    dataset: DataProgress = field(default_factory=DataProgress)
    shards: ShardProgress = field(default_factory=ShardProgress)
    trust: TrustCounts = field(default_factory=TrustCounts)
    swarm: SwarmView = field(default_factory=SwarmView)
    tokens: TokenCounts = field(default_factory=NoTokens)
    # the peers we ban now: the ban list's own view (`BanList.peer_ids`), read as a record is built
    banned_now: Callable[[], list[str]] = field(default=list, repr=False)

    @property
    def phase(self) -> Phase:
        return phase_of(self.facts.life, self.rounds.activity)

    @property
    def peer_id(self) -> str:
        return self.facts.peer_id

    @property
    def data_fetch(self) -> dict[str, Any] | None:
        """The dataset download's progress, with the shards a partial copy holds."""
        shown = dict(self.dataset.fetch or {})
        if self.shards.total is not None:
            shown.update(train_shards_local=self.shards.local, train_shards_total=self.shards.total)
        return shown or None

    @property
    def bytes_sent(self) -> int:
        """Tensor payload bytes this peer sent (all-reduce and state downloads), since it started."""
        return self.rounds.bytes_sent + self.facts.download_bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.rounds.bytes_received + self.facts.download_bytes_received

    def compute_utilization(self, now: float | None = None) -> float:
        return self.inner.compute_utilization(now)

    def status(self) -> dict[str, Any]:
        """The `/api/status` object."""
        f, i, r, t = self.facts, self.inner, self.rounds, self.tokens
        return {
            "peer_id": f.peer_id,
            "run_id": f.run_id,
            "role": f.role,
            "reachability": f.reachability,
            "relayed": f.relayed,
            "maddrs": list(f.maddrs),
            "phase": self.phase.value,
            "outer_step": r.outer_step,
            "inner_step": i.inner_step,
            "round_steps": t.round_steps,
            "round": r.round,
            "round_tokens": t.round,
            "round_closes_in": self.round_closes_in(),
            "tokens_trained": t.trained,
            "tokens_contributed": int(t.contributed),
            "contribution_share": self.contribution_share,
            "contributing": r.contributing,
            "not_contributing_reason": r.not_contributing_reason,
            "manifest_hash": f.manifest_hash,
            "loss": i.loss,
            "eval_loss": r.eval_loss,
            "eval_bits_per_byte": self.eval_bits_per_byte,
            "sample": r.sample,
            "sample_step": r.sample_step,
            "data_fetch": self.data_fetch,
            "state_fetch": f.state_fetch,
            "state_served": f.state_served,
            "tokens_per_second": i.tokens_per_second,
            "mfu": i.mfu,
            "devices": f.devices,
            "threads": i.threads,
            "global_sha256": r.global_sha256,
            "group_size": r.group_size,
            "alone": r.alone,
            "peers_known": self.swarm.peers_known,
            "dht_records": self.swarm.dht_records,
            "rounds_ok": r.rounds_ok,
            "rounds_failed": r.rounds_failed,
            "resyncs": r.resyncs,
            "rejected_contributions": self.trust.rejected_contributions,
            "bans": len(banned := self.banned_now()),
            "banned": banned,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "last_round_seconds": r.last_round_seconds,
            "last_round_phases": r.last_round_phases,
            "compute_utilization": self.compute_utilization(),
            "train_seconds": round(i.train_seconds, 3),
            "uptime_seconds": time.time() - f.started,
            "version": __version__,
            "rounds": [vars(e) for e in r.history],
        }

    def record(self) -> dict[str, Any]:
        """This peer's DHT status record (schema `proto.STATUS`)."""
        f, i, r, t = self.facts, self.inner, self.rounds, self.tokens
        return {
            "peer_id": f.peer_id,
            "run_id": f.run_id,
            "role": f.role,
            "reachability": f.reachability,
            "outer_step": r.outer_step,
            "inner_step": i.inner_step,
            "loss": None if i.loss is None else float(i.loss),
            "eval_loss": r.eval_loss,
            "tokens_per_second": max(0.0, float(i.tokens_per_second)),
            "global_sha256": r.global_sha256,
            "group_size": r.group_size,
            "alone": r.alone,
            "last_round_seconds": r.last_round_seconds,
            "rounds_ok": r.rounds_ok,
            "rounds_failed": r.rounds_failed,
            "time": time.time(),
            "version": __version__,
            "maddrs": f.maddrs[:16],
            "rejected_contributions": self.trust.rejected_contributions,
            "bans": len(self.banned_now()),
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "compute_utilization": self.compute_utilization(),
            "relayed": f.relayed,
            "round_steps": t.round_steps,
            "round": r.round,
            "round_tokens": t.round,
            "round_opened": r.round_opened or None,
            "reference_tokens": f.reference_tokens,
            "tokens_trained": t.trained,
            "tokens_contributed": int(t.contributed),
            "contributing": r.contributing,
            "manifest_hash": f.manifest_hash,
            "training": i.stretch_since is not None,
            "joining": r.joining,
            "joining_since": r.joining_since,
            "eval_bits_per_byte": self.eval_bits_per_byte,
            "sample": r.sample,
            "sample_step": r.sample_step,
        }

    @property
    def eval_bits_per_byte(self) -> float | None:
        """The eval loss in bits per byte of text: comparable between tokenizers (a loss per token is not)."""
        loss = self.rounds.eval_loss
        if loss is None or not math.isfinite(loss):
            return None
        return loss / math.log(2) * self.facts.eval_tokens_per_byte

    @property
    def contribution_share(self) -> float | None:
        """Tokens that reached θ_global ÷ tokens trained (null before the first inner step)."""
        if self.tokens.trained <= 0:
            return None
        return min(1.0, self.tokens.contributed / self.tokens.trained)

    def round_closes_in(self, now: float | None = None) -> float | None:
        """Seconds until the run's clock closes our round (0 once due; null when unknown)."""
        closes_at = self.rounds.round_closes_at
        if closes_at is None or not math.isfinite(closes_at):
            return None
        return max(0.0, closes_at - (time.time() if now is None else now))
