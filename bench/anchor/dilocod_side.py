"""The dilocod side of the race: a bootstrap and one real peer per index, through the test harness's swarm.

Each peer runs with the identity made for its index (so its data shard is the hivemind worker's) and the
race's config and overrides; dilocod's own settings are otherwise its defaults. The clock starts once
every peer serves its API (each trains from the moment it is up, as a user's peer would) and the figures
are read from each peer's `/api/status` when it stops.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.harness import Proc, Swarm

from .settings import REPO, Race


@dataclass
class ConfiguredSwarm(Swarm):
    """The harness's swarm, with the race's config file instead of configs/tiny.toml for every process."""

    config: Path = REPO / "configs" / "tiny.toml"

    def _proc(
        self, name: str, args: list[str], log: Path, http_port: int, run_dir: Path | None, where: str | None
    ) -> Proc:
        args = [str(self.config) if i and args[i - 1] == "--config" else a for i, a in enumerate(args)]
        return super()._proc(name, args, log, http_port, run_dir, where)


def run_dilocod(race: Race, identities: list[Path], root: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """Every peer's status after `race.seconds` of the clock, and its inner steps when the clock started."""
    s = ConfiguredSwarm(root / "dilocod", overrides=race.overrides, config=race.config)
    try:
        s.start_bootstrap()
        for identity in identities:
            s.add_peer(identity=identity)
        for peer in s.peers:
            s.wait_serving(peer, timeout=300)
        before = [int(peer.status()["inner_step"]) for peer in s.peers]
        time.sleep(race.seconds)
        statuses = [peer.status() for peer in s.peers]
    finally:
        s.close()
    return statuses, before
