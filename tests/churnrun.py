"""Churn runs shared by `tests/test_churn.py` (5 kills) and `bench/churn.py` (20 and more).

Each kill picks a random peer and a random moment — mid-all-reduce, or (every `checkpoint_every`-th kill)
while the peer writes its checkpoint — SIGKILLs its whole process group (the daemon, its DHT and
averager children and p2pd, as when a machine dies) and restarts it with the same run directory. What a
run must hold is in `tests/test_churn.py`'s docstring; `check` asserts it and `ChurnReport` counts it.
"""

from __future__ import annotations

import math
import os
import random
import signal
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from dilocod.statesync.checkpoint import TEMP_PREFIX
from tests.harness import Proc, Swarm, round_hashes, round_results, wait_for

MATCHMAKING_TIMEOUT = 8.0  # FAST's averaging.matchmaking_timeout
ALLREDUCE_TIMEOUT = 20.0  # FAST's averaging.allreduce_timeout
ROUND_LIMIT = MATCHMAKING_TIMEOUT + ALLREDUCE_TIMEOUT + 5.0  # what `GroupAverager.average` may take


@dataclass
class ChurnReport:
    kills: int = 0
    at_checkpoint: int = 0  # kills aimed at a checkpoint write
    cut_writes: int = 0  # of those, restarts that found the write cut (its temporary file left)
    resumed: int = 0  # restarts that loaded a checkpoint (every one must)
    back_seconds: list[float] = field(default_factory=list)  # restart → at the run's outer step again
    splits: list[int] = field(default_factory=list)  # outer steps after which peers held different θ
    max_round_seconds: float = 0.0


def kill_group(proc: Proc) -> None:
    assert proc.popen is not None
    os.killpg(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait(timeout=10)


def await_allreduce(proc: Proc, timeout: float) -> None:
    """Return as soon as `proc` is exchanging tensors with its group (`in_allreduce` in its status)."""

    def probe() -> bool:
        return bool(proc.status().get("in_allreduce"))

    wait_for(f"{proc.name} to be in an all-reduce", probe, timeout, interval=0.02)


def await_checkpoint_write(proc: Proc, timeout: float) -> bool:
    """Return once `proc` is writing its checkpoint (its temporary file exists); False if none was seen
    within `timeout` (a write of the tiny model takes milliseconds: the poll can miss one)."""
    assert proc.run_dir is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(proc.run_dir.glob(f"{TEMP_PREFIX}*")):
            return True
        time.sleep(0.0005)
    return False


def churn(s: Swarm, kills: int, rng: random.Random, checkpoint_every: int = 3) -> ChurnReport:
    report = ChurnReport()
    for kill in range(kills):
        victim = rng.choice(s.peers)
        survivors = [p for p in s.peers if p is not victim]
        before = victim.output().count("resumed from checkpoint")
        cut_before = victim.output().count("a checkpoint write that was cut short")
        if kill % checkpoint_every == checkpoint_every - 1:
            report.at_checkpoint += 1
            await_checkpoint_write(victim, timeout=3 * ROUND_LIMIT)
        else:
            await_allreduce(victim, timeout=120)
            time.sleep(rng.uniform(0.0, 0.1))  # a random moment of the exchange
        kill_group(victim)
        report.kills += 1
        killed_at = max(p.status()["outer_step"] for p in survivors)
        victim.start()  # a restart takes seconds: the survivors' rounds go on meanwhile

        # The survivors carry on without it: at least one more outer step, all of them.
        s.wait_all_at(killed_at + 1, timeout=3 * ROUND_LIMIT, peers=survivors)
        s.wait_serving(victim, timeout=120)
        serving = time.monotonic()
        report.resumed += victim.output().count("resumed from checkpoint") > before
        report.cut_writes += victim.output().count("a checkpoint write that was cut short") > cut_before
        run_step = max(p.status()["outer_step"] for p in survivors)
        # Back in step within one round: at the step the run was at when it came back (or later).
        wait_for(
            f"restarted {victim.name} (kill {kill + 1}) to reach outer step {run_step}",
            partial(_at_step, victim, run_step),
            timeout=ROUND_LIMIT + 30,
        )
        report.back_seconds.append(time.monotonic() - serving)
    return report


def _at_step(proc: Proc, step: int) -> bool:
    return bool(proc.status()["outer_step"] >= step)


def all_met(s: Swarm, start: int) -> list[dict[str, Any]] | None:
    """The peers' statuses once they all applied one round (from outer step `start`) in one group of all."""
    statuses = [p.status() for p in s.peers]
    met = [
        {
            e["outer_step"]: e["global_sha256"]
            for e in st["rounds"]
            if e["result"] == "ok" and e["group_size"] >= len(s.peers)
        }
        for st in statuses
    ]
    steps = set.intersection(*(set(m) for m in met))
    return statuses if any(step >= start and len({m[step] for m in met}) == 1 for step in steps) else None


def check(s: Swarm, report: ChurnReport) -> None:
    """After the kills: deadlines kept, no NaN, at most one split healed at once, and the whole run meets."""
    assert report.resumed == report.kills, f"{report.kills - report.resumed} restarts did not resume"
    statuses = [p.status() for p in s.peers]
    for status in statuses:
        for entry in status["rounds"]:
            report.max_round_seconds = max(report.max_round_seconds, entry["seconds"])
            assert entry["seconds"] <= ROUND_LIMIT, (status["peer_id"], entry)
            for key in ("loss", "eval_loss"):
                assert entry[key] is None or math.isfinite(entry[key]), (status["peer_id"], entry)
        assert status["loss"] is None or math.isfinite(status["loss"])
    hashes = round_hashes(statuses)
    report.splits = sorted(step for step, found in hashes.items() if len(found) > 1)
    assert len(report.splits) <= 1, (
        f"peers held different θ_global after outer steps {report.splits}: {hashes}"
    )
    for step in report.splits:  # healed by the next round: everybody on one θ_global again
        assert len(hashes.get(step + 1, set())) == 1, f"the split at outer step {step} lasted: {hashes}"
    # After all of it the peers still meet: a round with the whole run in one group, all applying the same
    # θ_global. (Not "no split at the step we happen to read": matchmaking can still pair peers off in a
    # round right after re-syncs, which the next round heals, as checked above.)
    start = max(st["outer_step"] for st in statuses) + 1
    try:
        final = wait_for(
            "a round after the kills with every peer in one group",
            partial(all_met, s, start),
            6 * ROUND_LIMIT,
        )
    except AssertionError as e:  # say what each peer's rounds were, for whoever reads a CI log
        raise AssertionError(f"{e}\n{round_results([p.status() for p in s.peers])}") from None
    # Loopback rounds take about a second: once a peer has had a good round since it (re)started, its
    # deadlines have come down from the configured ceilings.
    settled = [st for st in final if any(e["result"] == "ok" for e in st["rounds"])]
    assert len(settled) >= len(s.peers) - 1, final
    for st in settled:
        assert st["allreduce_deadline"] < ALLREDUCE_TIMEOUT, st
        assert st["matchmaking_deadline"] <= MATCHMAKING_TIMEOUT, st
