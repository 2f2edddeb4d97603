"""The dilocod side of the race: a bootstrap and one real peer per index, through the test harness's swarm.

Each peer runs with the identity made for its index (so its data shard is the hivemind worker's) and the
race's config and overrides; dilocod's own settings are otherwise its defaults. The clock starts once
every peer serves its API (each trains from the moment it is up, as a user's peer would) and the figures
are read from each peer's `/api/status` when it stops.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.harness import Swarm

from .settings import Race


def run_dilocod(race: Race, identities: list[Path], root: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """Every peer's status after `race.seconds` of the clock, and its inner steps when the clock started."""
    s = Swarm(root / "dilocod", overrides=race.overrides, config=race.config)
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
