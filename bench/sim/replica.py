"""One simulated peer, built from the daemon's own parts as `dilocod.node.resume.build_trainer` builds
them: the trainer on the data shard of its identity, θ_global and the outer momentum, the round pipeline of
the run's overlap mode, error feedback for the codecs that use it, and the token ledger that says how many
tokens stand behind each contribution.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch

from dilocod.config import Config
from dilocod.diloco import OuterOptimizer
from dilocod.rounds.pipeline import Contribution, PipelineSettings, RoundPipeline
from dilocod.rounds.tokens import TokenLedger
from dilocod.trainer import Corpus, InnerTrainer
from dilocod.trust.adversary import Adversary
from peers.membership import Claim


class Replica:
    def __init__(self, cfg: Config, peer_key: str, corpus: Corpus) -> None:
        self.trainer = InnerTrainer(
            cfg.model, cfg.data, cfg.trainer, seed=cfg.run.seed, peer_key=peer_key, corpus=corpus
        )
        self.outer = OuterOptimizer(self.trainer.working_params_fp32(), cfg.outer_settings())
        feedback = cfg.averaging.error_feedback([p.shape for p in self.outer.params])
        # Public peers, no adversary: `keep_previous` is only for private peers without overlap.
        settings = PipelineSettings(cfg.outer.overlap, cfg.outer.fragments, cfg.outer.mix_alpha)
        adversary = Adversary(cfg.adversary, cfg.run.seed)
        self.pipeline = RoundPipeline(
            settings, self.trainer, self.outer, feedback, adversary, cfg.averaging.wire_codec()
        )
        self.ledger = TokenLedger(fragments=self.pipeline.fragment_count)

    def train(self, steps: int, seconds: float) -> None:
        """`steps` inner steps, taking `seconds` of the run's time (what its claims will say it trained)."""
        if steps > 0:
            self.trainer.train_steps(steps)
        self.ledger.stepped(steps * self.trainer.tokens_per_step, seconds)

    def contribute(self) -> tuple[Contribution, Claim]:
        """This round's pseudo-gradient, and what its ticket claims about the tokens behind it."""
        contribution = self.pipeline.contribution()
        tokens, seconds = self.ledger.send(contribution.fragment)
        return contribution, Claim(tokens, tokens / seconds if seconds > 0 else 0.0, seconds)

    def apply(self, contribution: Contribution, averaged: list[torch.Tensor], weight: float) -> None:
        self.pipeline.apply(contribution, averaged)
        self.ledger.applied(weight)

    def keep(self, contribution: Contribution) -> None:
        """The round was not applied (no member had tokens to weigh): its progress goes out next round."""
        self.pipeline.keep(contribution)
        self.ledger.kept()

    def evaluate_global(self) -> float:
        """Eval loss of θ_global on the run's eval batches (its working copy is overwritten)."""
        self.trainer.load_params(self.outer.params)
        return self.trainer.evaluate()


def synthetic_keys(count: int) -> list[str]:
    """Data-sharding keys for replicas without an identity: fixed, shaped like a real peer's key."""
    return [hashlib.sha256(f"dilocod-sim replica {i}".encode()).hexdigest()[:32] for i in range(count)]


def identity_keys(paths: Sequence[Path]) -> list[str]:
    """The data-sharding key of each identity: a peer's run dir or its `identity.key` file."""
    from dilocod.node.netstart import peer_key

    keys = []
    for path in paths:
        run_dir = path if path.is_dir() else path.parent
        if not (run_dir / "identity.key").is_file():  # peer_key would create one: a typo must not
            raise ValueError(f"no identity.key at {path}")
        keys.append(peer_key(run_dir))
    return keys
