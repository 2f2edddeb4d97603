"""The variants of one invocation and how one of them runs for one seed.

A variant is a handful of config overrides on top of the invocation's config: DiLoCo with M replicas and
its H, outer lr, momentum, inner optimizer, codec and overlap, or the data-parallel baseline with M× the
batch. Each (M, inner optimizer) has its own baseline: that is what the DiLoCo variants of that M and
optimizer are compared with.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from dilocod.config import Config
from dilocod.trainer import Corpus, DataConfig, load_corpus

from .diloco import DilocoRun, RunResult
from .dp import run_dp
from .replica import identity_keys, synthetic_keys
from .schedule import plan_rounds, relative_speeds
from .settings import SimOptions, run_budget, variant_config


@dataclass(frozen=True)
class Variant:
    dp: bool  # the data-parallel baseline
    replicas: int
    optimizer: str | None = None  # None: the config's (so for every field below)
    inner_steps: int | None = None
    outer_lr: float | None = None
    momentum: float | None = None
    compression: str | None = None
    overlap: str | None = None
    fragments: int | None = None

    @property
    def baseline(self) -> Variant:
        return Variant(dp=True, replicas=self.replicas, optimizer=self.optimizer)

    def overrides(self) -> tuple[str, ...]:
        keys = (
            ("trainer.optimizer", self.optimizer),
            ("trainer.inner_steps", self.inner_steps),
            ("outer.lr", self.outer_lr),
            ("outer.momentum", self.momentum),
            ("averaging.compression", self.compression),
            ("outer.overlap", self.overlap),
            ("outer.fragments", self.fragments),
        )
        return tuple(f"{key}={value}" for key, value in keys if value is not None)


@dataclass(frozen=True)
class Choices:
    """What the command line asks for; a list means one variant per value (every combination)."""

    replicas: Sequence[int]
    inner_steps: Sequence[int | None] = (None,)
    outer_lr: Sequence[float | None] = (None,)
    compression: Sequence[str | None] = (None,)
    overlap: Sequence[str | None] = (None,)
    optimizer: Sequence[str | None] = (None,)
    momentum: float | None = None
    fragments: int | None = None
    dp_only: bool = False


def expand(choices: Choices) -> list[Variant]:
    """Every variant asked for, each (M, optimizer)'s dp baseline first."""
    variants: list[Variant] = []
    for replicas, optimizer in itertools.product(choices.replicas, choices.optimizer):
        variants.append(Variant(dp=True, replicas=replicas, optimizer=optimizer))
        if choices.dp_only:
            continue
        for h, lr, codec, overlap in itertools.product(
            choices.inner_steps, choices.outer_lr, choices.compression, choices.overlap
        ):
            variants.append(
                Variant(
                    False, replicas, optimizer, h, lr, choices.momentum, codec, overlap, choices.fragments
                )
            )
    return variants


def name(variant: Variant, cfg: Config, speeds: Sequence[float] | None) -> str:
    """What the variant is, from the config it actually runs with (defaults included)."""
    if variant.dp:
        return f"dp {cfg.trainer.optimizer}"
    outer = cfg.outer_settings()
    overlap = f"streaming/{outer.fragments}" if outer.overlap == "streaming" else outer.overlap
    step = "" if outer.optimizer == "sgd" else f"{outer.optimizer} "
    text = (
        f"diloco H={cfg.trainer.inner_steps} {step}lr={outer.step_lr:g} mom={outer.momentum:g} "
        f"{cfg.trainer.optimizer} {cfg.averaging.compression} {overlap} {cfg.averaging.reducer}"
    )
    return text if speeds is None else f"{text} speeds={','.join(f'{s:g}' for s in speeds)}"


class Runner:
    """Runs variants for seeds; the corpus is read once per data config."""

    def __init__(self, options: SimOptions) -> None:
        options.validate()
        self.options = options
        self._corpora: dict[DataConfig, Corpus] = {}

    def config(self, variant: Variant, seed: int) -> Config:
        return variant_config(self.options, variant.overrides(), seed, variant.replicas)

    def keys(self, replicas: int) -> list[str]:
        identities = self.options.identities
        if identities is None:
            return synthetic_keys(replicas)
        if len(identities) < replicas:
            raise ValueError(f"--identities gives {len(identities)} identities for {replicas} replicas")
        return identity_keys(identities[:replicas])

    def corpus(self, data: DataConfig) -> Corpus:
        if data not in self._corpora:
            self._corpora[data] = load_corpus(data)
        return self._corpora[data]

    def check(self, variant: Variant, seed: int) -> None:
        """Raise ValueError (or ConfigError) for a variant that cannot run, before anything trains."""
        self.config(variant, seed)
        self.keys(variant.replicas)
        relative_speeds(self.options.speeds, variant.replicas)

    def run(self, variant: Variant, seed: int) -> RunResult:
        cfg = self.config(variant, seed)
        keys, corpus = self.keys(variant.replicas), self.corpus(cfg.data)
        steps = run_budget(cfg, self.options.tokens, variant.replicas)
        if variant.dp:
            return run_dp(cfg, keys, steps, corpus)
        speeds = relative_speeds(self.options.speeds, variant.replicas)
        fragments = cfg.outer.fragments if cfg.outer.overlap == "streaming" else 1
        plans = plan_rounds(steps, cfg.trainer.inner_steps, speeds, fragments)
        return DilocoRun(cfg, keys, corpus).run(plans)
