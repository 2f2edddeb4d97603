"""What both sides of the race share: the run's config, the peers' data-sharding keys, the round size."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dilocod.config import Config, load_config
from dilocod.node.netstart import peer_key

REPO = Path(__file__).resolve().parent.parent.parent
# hivemind's state averager wraps only a `torch.optim.Optimizer` (it asserts so), which dilocod's Muon pair
# is not: the hivemind side trains with AdamW whatever the config says, as hivemind's users do.
HIVEMIND_OPTIMIZER = "adamw"


@dataclass(frozen=True)
class Race:
    """One race's settings, as given on the command line."""

    peers: int
    seconds: float
    threads: int
    config: Path
    sets: tuple[str, ...]  # the user's `--set k=v`, after ours (the last value of a key wins)

    @property
    def overrides(self) -> tuple[str, ...]:
        # One torch thread each (or --threads) on both sides: equal machines, none oversubscribed.
        return (f"trainer.threads={self.threads}", *self.sets)

    def load(self) -> Config:
        return load_config(self.config, self.overrides)


def round_samples(cfg: Config, peers: int) -> int:
    """Sequences the run trains per dilocod round: hivemind's `target_batch_size` for the same round.

    `round.tokens` = 0 means H inner steps of an average peer, i.e. H × batch × peers sequences in all.
    """
    if cfg.round.tokens > 0:
        return max(1, cfg.round.tokens // cfg.trainer.seq_len)
    return cfg.trainer.inner_steps * cfg.trainer.batch_size * peers


def identities(root: Path, peers: int) -> tuple[list[Path], list[str]]:
    """One identity per peer index, made up front: the dilocod peer of index i runs with it and the hivemind
    worker of index i takes its key, so both train on the same data shard."""
    paths, keys = [], []
    for index in range(peers):
        run_dir = root / "identities" / f"peer-{index}"
        run_dir.mkdir(parents=True, exist_ok=True)
        keys.append(peer_key(run_dir))  # creates identity.key
        paths.append(run_dir / "identity.key")
    return paths, keys
