"""What every round component shares, handed in as one bundle."""

from __future__ import annotations

from dataclasses import dataclass

from dilocod.diloco import OuterOptimizer
from dilocod.observability.metrics import Metrics
from dilocod.observability.peerstate import PeerState
from dilocod.rounds.pipeline import RoundPipeline
from dilocod.rounds.settings import RoundSettings
from dilocod.rounds.tokens import TokenLedger


@dataclass(frozen=True)
class RoundCore:
    """The settings the round components read, the peer's state (read; its round progress is written by
    `effects.py` alone), the metrics, θ_global's outer optimizer, the tensor pipeline and the token ledger."""

    settings: RoundSettings
    state: PeerState
    metrics: Metrics
    outer: OuterOptimizer
    pipeline: RoundPipeline
    tokens: TokenLedger
