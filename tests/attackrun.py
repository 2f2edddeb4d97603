"""Attacked and clean runs of real peers, shared by `tests/test_attacks.py` and `bench/attacks.py`.

Honest peer i has the same identity (so the same data shard and order) in every run, clean or
attacked: the runs then differ by the attackers, not by which data each honest peer drew. The
attackers start first, so that they are in the run from the first round on.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hivemind.p2p import P2P

from tests.harness import FAST, Swarm

WINDOW = 5  # outer steps averaged: one step's small eval set is noisy
ATTACK = (
    *FAST,
    "averaging.min_matchmaking_time=3",
    "averaging.matchmaking_timeout=10",
    "trainer.eval_batches=8",
)
IDENTITIES = Path(tempfile.mkdtemp(prefix="dilocod-attack-ids-"))


def honest_identity(index: int) -> Path:
    key = IDENTITIES / f"honest-{index}.key"
    if not key.exists():
        P2P.generate_identity(str(key))
    return key


def start_run(
    root: Path, honest: int, attackers: int, mode: str | Sequence[str] | None, *extra: str
) -> Swarm:
    """A bootstrap, `attackers` peers in adversary `mode` (none if mode is None: a clean run; one mode per
    attacker if it is a sequence) and `honest` peers; the group size is the same either way. Honest peers
    are `swarm.peers[-honest:]`."""
    modes = [] if mode is None else [mode] * attackers if isinstance(mode, str) else list(mode)
    if mode is not None and len(modes) != attackers:
        raise ValueError(f"{attackers} attackers need {attackers} modes, got {modes}")
    s = Swarm(root, overrides=(*ATTACK, f"averaging.group_size={honest + attackers}", *extra))
    try:
        s.start_bootstrap()
        for attack in modes:
            # stale: 3 rounds old, so that it sends old pseudo-gradients (not zeros) in a short run
            s.add_peer(f"adversary.mode={attack}", "adversary.stale_rounds=3")
        for i in range(honest):
            s.add_peer(identity=honest_identity(i))
    except BaseException:
        s.close()  # the caller never sees a half-started swarm: reap it here
        raise
    return s


def eval_at(statuses: list[dict[str, Any]], step: int) -> float:
    """The honest peers' eval loss of θ_global after outer step `step` (the first who recorded it; a
    record read while its evaluation was still running holds None, and another peer's is taken)."""
    entries = [
        e
        for status in statuses
        for e in status["rounds"]
        if e["outer_step"] == step and e["result"] in ("ok", "alone")
    ]
    if not entries:
        raise AssertionError(f"no honest peer evaluated outer step {step}")
    values = [e["eval_loss"] for e in entries if e["eval_loss"] is not None]
    return float(values[0]) if values else math.inf


def mean_eval(statuses: list[dict[str, Any]], last: int) -> float:
    """Eval loss averaged over the WINDOW outer steps ending at `last` (∞ if any is non-finite)."""
    values = [eval_at(statuses, step) for step in range(last - WINDOW + 1, last + 1)]
    return sum(values) / WINDOW if all(math.isfinite(v) for v in values) else math.inf


def evaluated(statuses: list[dict[str, Any]]) -> set[int]:
    return {e["outer_step"] for s in statuses for e in s["rounds"] if e["result"] in ("ok", "alone")}


def common_step(
    attacked: list[dict[str, Any]],
    clean: list[dict[str, Any]],
    rounds: int,
    *more_clean: list[dict[str, Any]],
) -> int:
    """The latest step ≥ rounds − 2 evaluated by every run, with the WINDOW − 1 steps before it."""
    both = evaluated(attacked) & evaluated(clean)
    for other in more_clean:
        both &= evaluated(other)
    steps = [s for s in both if s >= rounds - 2 and set(range(s - WINDOW + 1, s)) <= both]
    assert steps, f"no common evaluated step: {sorted(evaluated(attacked))} vs {sorted(evaluated(clean))}"
    return max(steps)
