"""A joiner's state download, driven through the daemon's own plan: donors from the run's records
(`dilocod.statesync.parts.pick_donors`), parts of `peers.state.share.part_size` (`split_parts`), and
`peers.state.parts.PartPlan` deciding which donor fetches which part. Modelled: each part's transfer time,
its bytes over the slower of the donor's uplink and the joiner's downlink shared by its parallel fetches."""

from __future__ import annotations

import heapq
import random
from collections.abc import Mapping, Sequence
from typing import Any

from dilocod.statesync.parts import pick_donors
from peers.state.parts import PartPlan, split_parts
from peers.state.share import part_size

SETUP_SECONDS = 1.0  # asking donors for their snapshot descriptions (a round trip or two each): a guess


def download_seconds(
    records: Sequence[Mapping[str, Any]],
    min_step: int,
    state_bytes: int,
    down: float,
    uplinks: Mapping[str, float],
    rng: random.Random,
) -> tuple[float, list[str]] | None:
    """Seconds to download the run's state from the public trainers at `min_step` or later, and the donors
    asked; None when no donor serves it (a private peer or the bootstrap serves no state)."""
    donors = [d for d in pick_donors(records, min_step, set(), rng) if d in uplinks]
    if not donors:
        return None
    parts = split_parts(state_bytes, part_size(state_bytes))
    plan = PartPlan(parts, [f"sha{p.index}" for p in parts], donors)
    now, fetching = SETUP_SECONDS, []
    while not plan.finished:
        for donor, part in plan.assign():
            rate = min(uplinks[donor], down / len(donors))
            heapq.heappush(fetching, (now + part.size / rate, donor, part.index))
        if not fetching:
            return None
        now, donor, index = heapq.heappop(fetching)
        plan.received(donor, index, f"sha{index}")
    return now, donors
