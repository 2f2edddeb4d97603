"""What a simulation runs with: the daemon's own config (file and `section.key=value` overrides, read by
`dilocod.config.load_config`), plus what only a simulation has: replicas, a token budget, seeds, speeds,
identities.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from dilocod.config import Config, load_config

from .schedule import budget_steps

HORIZONS = ("budget", "config")


@dataclass(frozen=True)
class SimOptions:
    """Settings shared by every variant of one invocation."""

    config: Path | None  # the daemon's config file (None: the built-in defaults)
    sets: tuple[str, ...] = ()  # `section.key=value` overrides, as `dilocod join --set` takes them
    tokens: int = 200_000  # trained by all replicas together, per variant and seed
    seeds: int = 1
    first_seed: int | None = None  # None: the config's run.seed
    speeds: tuple[float, ...] | None = None
    identities: tuple[Path, ...] | None = None  # run dirs (or identity.key files) of real peers
    # budget: the cosine decay ends where the budget does (trainer.total_steps = the budget's steps);
    # config: the config's trainer.total_steps
    horizon: str = "budget"

    def validate(self) -> None:
        if self.tokens < 1:
            raise ValueError(f"--tokens must be >= 1, got {self.tokens}")
        if self.seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {self.seeds}")
        if self.horizon not in HORIZONS:
            raise ValueError(f"--horizon must be one of {', '.join(HORIZONS)}, got {self.horizon!r}")


def base_seed(options: SimOptions) -> int:
    if options.first_seed is not None:
        return options.first_seed
    return load_config(options.config, options.sets).run.seed


def variant_config(options: SimOptions, overrides: tuple[str, ...], seed: int, replicas: int) -> Config:
    """The config every replica (and the dp baseline) of a variant runs with, for `seed`."""
    cfg = load_config(options.config, (*options.sets, *overrides, f"run.seed={seed}"))
    if options.horizon == "config":
        return cfg
    steps = run_budget(cfg, options.tokens, replicas)
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, total_steps=steps))


def run_budget(cfg: Config, tokens: int, replicas: int) -> int:
    """Inner steps of an average-speed replica (and of the dp baseline) for `tokens` in all."""
    return budget_steps(tokens, replicas, cfg.trainer.batch_size * cfg.trainer.seq_len)
