"""Meeting the peers that are about to finish their round.

Peers train H inner steps between rounds, but not at the same speed: one a little slower than the
rest reaches matchmaking a few seconds after the others have formed their group, finds nobody, sees the
run ahead and downloads the whole state, round after round. So a peer that has finished its H steps
looks at the records of the peers at its outer step: if one of them is still training and will finish
within `outer.late_peer_wait` of a round, it trains on until then instead of idling in matchmaking
(its round is longer, its pseudo-gradient covers those steps too), and both reach matchmaking together.

Estimates come from status records (advisory, a few seconds old): the peer's `round_steps`, moved on
at its throughput for the record's age. A peer far behind (a re-sync just started, a stall) is not
waited for: that is what re-syncing is for. Pure arithmetic, no I/O.
"""

from __future__ import annotations

import math
from typing import Any


def extra_steps_to_meet(
    records: list[dict[str, Any]],
    step: int,
    *,
    now: float,
    sync_every: int,
    tokens_per_step: int,
    my_steps_per_second: float,
    wait_fraction: float,
    window: float,
    max_age: float,
) -> tuple[int, int]:
    """(inner steps to train on, peers waited for).

    `records` are the other peers' status records. A peer counts if it is at `step`, its record is at
    most `max_age` old and it is expected to finish its round within `wait_fraction` of one of ours. We
    train until the last of them is due, less half the matchmaking `window` (a peer arriving within the
    window meets us anyway); nothing when that is not positive.
    """
    if wait_fraction <= 0 or my_steps_per_second <= 0 or tokens_per_step <= 0:
        return 0, 0
    limit = wait_fraction * sync_every / my_steps_per_second  # seconds
    due = []
    for record in records:
        if record.get("outer_step") != step or record.get("round_steps") is None:
            continue
        age = now - float(record["time"])
        rate = float(record["tokens_per_second"]) / tokens_per_step  # its inner steps per second
        if abs(age) > max_age or rate <= 0:  # stale (or a clock far off): it may be gone
            continue
        age = max(age, 0.0)  # clocks differ a little
        remaining = sync_every - (record["round_steps"] + age * rate)
        if remaining <= 0:
            continue  # in matchmaking now, or about to be
        seconds = remaining / rate
        if seconds <= limit:
            due.append(seconds)
    if not due:
        return 0, 0
    wait = max(due) - window / 2
    if wait <= 0:
        return 0, 0
    return math.ceil(wait * my_steps_per_second), len(due)
