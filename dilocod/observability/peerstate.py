"""What a peer knows about its own progress: the numbers behind `/api/status` and its DHT record."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dilocod import __version__

HISTORY = 100  # rounds kept for the status API and dashboard


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
class PeerState:
    peer_id: str = ""
    run_id: str = ""
    role: str = "peer"
    reachability: str = "unknown"
    relayed: bool = False  # our pseudo-gradients travel through a relay or public reducer, not directly
    maddrs: list[str] = field(default_factory=list)
    outer_step: int = 0
    inner_step: int = 0
    round_steps: int = 0  # inner steps taken in the current round
    round: int = 0  # the round we train (outer_step, + 1 while a launched round is in flight)
    round_tokens: int = 0  # tokens trained in that round (the run's clock counts them)
    round_opened: float = 0.0  # unix time the round opened
    round_closes_at: float | None = None  # unix time the run's clock closes it (estimate)
    joining: int | None = None  # while we download the run's state: the round we will train with it
    joining_since: float | None = None  # ... and when that download began
    reference_tokens: int = 0  # tokens of H inner steps of our one-device config
    tokens_trained: int = 0
    tokens_contributed: float = 0.0  # of those, reached θ_global
    contributing: bool = True
    not_contributing_reason: str | None = None
    manifest_hash: str | None = None
    dht_records: int | None = None  # records our DHT node holds (stored + cached), read every heartbeat
    loss: float = math.nan
    eval_loss: float | None = None
    sample: str | None = None  # the latest greedy completion of the run's prompt from θ_global
    sample_step: int | None = None  # ... and the outer step of that θ_global
    eval_tokens_per_byte: float = 1.0  # of the dataset's eval split: turns the eval loss into bits per byte
    data_fetch: dict[str, Any] | None = None  # while (and after) we download the run's dataset: its progress
    state_fetch: dict[str, Any] | None = None  # our latest state download in parts: its progress and donors
    state_served: dict[str, Any] | None = None  # parts of our state we served to peers that re-synced
    tokens_per_second: float = 0.0
    mfu: float | None = None  # model FLOPs utilization; None when the devices' peak is unknown (CPU)
    devices: int = 1  # local devices training together as this one peer
    threads: int = (
        0  # torch threads the trainer runs on (its share of the machine's cores, or trainer.threads)
    )
    global_sha256: str = "0" * 64
    group_size: int = 0
    alone: bool = False
    peers_known: int = 0
    rounds_ok: int = 0
    rounds_failed: int = 0
    resyncs: int = 0
    rejected_contributions: int = 0  # contributions we refused (screened senders, implausible reducers)
    # the peers we ban now: the ban list's own view (`BanList.peer_ids`), read as a record is built
    banned_now: Callable[[], list[str]] = field(default=list, repr=False)
    bytes_sent: int = 0  # tensor payload bytes this peer sent (all-reduce), since it started
    bytes_received: int = 0  # ... and received (all-reduce and state downloads)
    last_round_seconds: float | None = None
    last_round_phases: dict[str, float] | None = (
        None  # the last gap between stretches of inner steps, by phase
    )
    phase: str = "starting"  # starting | fetching data | training | averaging | syncing | stopping
    started: float = field(default_factory=time.time)
    train_seconds: float = 0.0  # wall time spent in finished stretches of inner steps
    training_since: float | None = None  # time.monotonic() when the first inner step began
    stretch_since: float | None = None  # ... when the stretch of inner steps now running began
    history: deque[RoundRecord] = field(default_factory=lambda: deque(maxlen=HISTORY))

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

    def status(self) -> dict[str, Any]:
        """The `/api/status` object."""
        return {
            "peer_id": self.peer_id,
            "run_id": self.run_id,
            "role": self.role,
            "reachability": self.reachability,
            "relayed": self.relayed,
            "maddrs": list(self.maddrs),
            "phase": self.phase,
            "outer_step": self.outer_step,
            "inner_step": self.inner_step,
            "round_steps": self.round_steps,
            "round": self.round,
            "round_tokens": self.round_tokens,
            "round_closes_in": self.round_closes_in(),
            "tokens_trained": self.tokens_trained,
            "tokens_contributed": int(self.tokens_contributed),
            "contribution_share": self.contribution_share,
            "contributing": self.contributing,
            "not_contributing_reason": self.not_contributing_reason,
            "manifest_hash": self.manifest_hash,
            "loss": self.loss,
            "eval_loss": self.eval_loss,
            "eval_bits_per_byte": self.eval_bits_per_byte,
            "sample": self.sample,
            "sample_step": self.sample_step,
            "data_fetch": self.data_fetch,
            "state_fetch": self.state_fetch,
            "state_served": self.state_served,
            "tokens_per_second": self.tokens_per_second,
            "mfu": self.mfu,
            "devices": self.devices,
            "threads": self.threads,
            "global_sha256": self.global_sha256,
            "group_size": self.group_size,
            "alone": self.alone,
            "peers_known": self.peers_known,
            "dht_records": self.dht_records,
            "rounds_ok": self.rounds_ok,
            "rounds_failed": self.rounds_failed,
            "resyncs": self.resyncs,
            "rejected_contributions": self.rejected_contributions,
            "bans": len(banned := self.banned_now()),
            "banned": banned,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "last_round_seconds": self.last_round_seconds,
            "last_round_phases": self.last_round_phases,
            "compute_utilization": self.compute_utilization(),
            "train_seconds": round(self.train_seconds, 3),
            "uptime_seconds": time.time() - self.started,
            "version": __version__,
            "rounds": [vars(r) for r in self.history],
        }

    def record(self) -> dict[str, Any]:
        """This peer's DHT status record (schema `proto.STATUS`)."""
        return {
            "peer_id": self.peer_id,
            "run_id": self.run_id,
            "role": self.role,
            "reachability": self.reachability,
            "outer_step": self.outer_step,
            "inner_step": self.inner_step,
            "loss": None if self.loss is None else float(self.loss),
            "eval_loss": self.eval_loss,
            "tokens_per_second": max(0.0, float(self.tokens_per_second)),
            "global_sha256": self.global_sha256,
            "group_size": self.group_size,
            "alone": self.alone,
            "last_round_seconds": self.last_round_seconds,
            "rounds_ok": self.rounds_ok,
            "rounds_failed": self.rounds_failed,
            "time": time.time(),
            "version": __version__,
            "maddrs": self.maddrs[:16],
            "rejected_contributions": self.rejected_contributions,
            "bans": len(self.banned_now()),
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "compute_utilization": self.compute_utilization(),
            "relayed": self.relayed,
            "round_steps": self.round_steps,
            "round": self.round,
            "round_tokens": self.round_tokens,
            "round_opened": self.round_opened or None,
            "reference_tokens": self.reference_tokens,
            "tokens_trained": self.tokens_trained,
            "tokens_contributed": int(self.tokens_contributed),
            "contributing": self.contributing,
            "manifest_hash": self.manifest_hash,
            "training": self.stretch_since is not None,
            "joining": self.joining,
            "joining_since": self.joining_since,
            "eval_bits_per_byte": self.eval_bits_per_byte,
            "sample": self.sample,
            "sample_step": self.sample_step,
        }

    @property
    def eval_bits_per_byte(self) -> float | None:
        """The eval loss in bits per byte of text: comparable between tokenizers (a loss per token is not)."""
        if self.eval_loss is None or not math.isfinite(self.eval_loss):
            return None
        return self.eval_loss / math.log(2) * self.eval_tokens_per_byte

    @property
    def contribution_share(self) -> float | None:
        """Tokens that reached θ_global ÷ tokens trained (null before the first inner step)."""
        if self.tokens_trained <= 0:
            return None
        return min(1.0, self.tokens_contributed / self.tokens_trained)

    def round_closes_in(self, now: float | None = None) -> float | None:
        """Seconds until the run's clock closes our round (0 once due; null when unknown)."""
        if self.round_closes_at is None or not math.isfinite(self.round_closes_at):
            return None
        return max(0.0, self.round_closes_at - (time.time() if now is None else now))
