"""M replicas of DiLoCo in one process, round by round, as the daemon's round machine orders the work.

Without overlap a round is: every replica trains its steps, sends its contribution, the group averages,
every replica applies. With `delayed` or `streaming` overlap (`dilocod/rounds/machine.py`) a round's
average lands one round late: after the next round's training, the round in flight is applied first and
the next one is launched from there. The run ends after the last round's training; with overlap the
round in flight is then applied, so θ_global holds every token trained.

Every replica holds its own θ_global and applies the same average, as peers do; after each outer step
their hashes must agree, or the run stops with an error.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from dilocod.aggregation.partrules import make_part_reduce, make_part_weigh
from dilocod.config import Config
from dilocod.rounds.pipeline import Contribution
from dilocod.trainer import Corpus
from peers.partrelay import combine

from .allreduce import agreed_weights, group_average, payload_bytes
from .replica import Replica
from .schedule import RoundPlan


@dataclass(frozen=True)
class RoundTrace:
    """What one averaged round was made of, and the θ_global it produced."""

    outer_step: int  # the outer step it produced
    fragment: int
    tokens: tuple[int, ...]  # behind each replica's contribution
    weights: tuple[float, ...]  # the group's agreed weights (tokens, capped)
    global_sha256: str


@dataclass
class RunResult:
    eval_loss: float  # θ_global at the end, on the run's eval batches
    tokens: int  # trained by all replicas together
    bytes_sent: int  # payload bytes all replicas sent (dp: one fp32 gradient per worker and step)
    train_seconds: float  # training and rounds; not the setup, not the final evaluation
    round_seconds: float = 0.0  # of those, the rounds: contributions, all-reduce, outer steps
    rounds: list[RoundTrace] = field(default_factory=list)


@dataclass
class _Launched:
    """A round whose contributions are out: the average is known at once, applied when the round lands."""

    contributions: list[Contribution]
    tokens: list[int]  # behind each contribution
    weights: list[float]
    averaged: list[torch.Tensor] | None  # None: nobody had tokens to weigh, the round is not applied


class DilocoRun:
    def __init__(self, cfg: Config, keys: Sequence[str], corpus: Corpus) -> None:
        self.replicas = [Replica(cfg, key, corpus) for key in keys]
        self.reduce_part = make_part_reduce(
            cfg.averaging.reducer_settings(), cfg.averaging.screening_settings()
        )
        if (
            cfg.averaging.compression == "topk"
        ):  # relayed: weighed by the sparse rule, combined by every member
            weigh = make_part_weigh(cfg.averaging.screening_settings())
            self.reduce_part = lambda stacked, weights: (
                combine(stacked, weigh(stacked, weights)[0].tolist()),
                [],
            )
        self.codec = cfg.averaging.wire_codec()
        self.overlapped = cfg.outer.overlap != "none"
        self.bytes_sent = 0
        self.round_seconds = 0.0
        self.rounds: list[RoundTrace] = []

    def run(self, plans: Sequence[RoundPlan]) -> RunResult:
        started = time.perf_counter()
        in_flight: _Launched | None = None
        for plan in plans:
            for replica, steps in zip(self.replicas, plan.steps, strict=True):
                replica.train(steps, float(plan.seconds))
            with self._counted():
                in_flight = self._after_training(plan, in_flight)
        if in_flight is not None:
            with self._counted():
                self._settle(in_flight)
        seconds = time.perf_counter() - started
        tokens = sum(r.ledger.trained for r in self.replicas)
        loss = self.replicas[0].evaluate_global()
        return RunResult(loss, tokens, self.bytes_sent, seconds, self.round_seconds, self.rounds)

    def _after_training(self, plan: RoundPlan, in_flight: _Launched | None) -> _Launched | None:
        """A round's work once its training is done; returns the round now in flight (None without overlap)."""
        if not self.overlapped:
            self._settle(self._launch(plan.weights))
            return None
        if in_flight is not None:  # the round launched a round ago lands before this one goes out
            self._settle(in_flight)
        return self._launch(plan.weights)

    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        """Time spent in rounds (everything but inner steps), for the simulator's overhead."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.round_seconds += time.perf_counter() - started

    def _launch(self, known_weights: Sequence[float] | None) -> _Launched:
        sent = [replica.contribute() for replica in self.replicas]
        contributions = [contribution for contribution, _ in sent]
        claims = [claim for _, claim in sent]
        weights = list(known_weights) if known_weights is not None else agreed_weights(claims)
        tokens = [claim.tokens for claim in claims]
        self.bytes_sent += sum(payload_bytes(c.sent, self.codec) for c in contributions)
        if not any(w > 0 for w in weights):  # the all-reduce refuses a group without tokens
            return _Launched(contributions, tokens, weights, None)
        averaged = group_average([c.sent for c in contributions], weights, self.reduce_part, self.codec)
        return _Launched(contributions, tokens, weights, averaged)

    def _settle(self, launched: _Launched) -> None:
        pairs = zip(self.replicas, launched.contributions, launched.weights, strict=True)
        if launched.averaged is None:
            for replica, contribution, _ in pairs:
                replica.keep(contribution)
            return
        for replica, contribution, weight in pairs:
            replica.apply(contribution, launched.averaged, weight)
        self._trace(launched)

    def _trace(self, launched: _Launched) -> None:
        outer = self.replicas[0].outer
        hashes = {replica.outer.sha256 for replica in self.replicas}
        if len(hashes) != 1:
            raise RuntimeError(
                f"replicas disagree on θ_global after outer step {outer.step}: {sorted(hashes)}"
            )
        fragment = launched.contributions[0].fragment
        trace = RoundTrace(
            outer.step, fragment, tuple(launched.tokens), tuple(launched.weights), outer.sha256
        )
        self.rounds.append(trace)
