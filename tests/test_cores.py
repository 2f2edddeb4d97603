"""Torch's OpenMP threads are the trainer's: side threads run their torch work on one core
(`dilocod.node.runtime.leave_cores_to_training`)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# A trainer thread runs 2000 parallel ops after the main thread ran one parallel op of its own. Without
# the fix the main thread's OpenMP team stays alive, the process holds more OpenMP threads than cores,
# and libgomp parks the trainer's idle team thread on a futex after every op: thousands of voluntary
# context switches (and ~7 % of a 2-core machine's training speed, docs/benchmarks.md).
PROBE = """
import asyncio, resource, sys, threading
import torch
from dilocod.node.runtime import leave_cores_to_training

async def side() -> int:
    leave_cores_to_training()
    return await asyncio.get_running_loop().run_in_executor(None, torch.get_num_threads)

side_threads = asyncio.run(side()) if sys.argv[1] == "fix" else None
(torch.randn(2_000_000) * 2).sum()  # the main thread's own parallel work (hashing, copies)
seen = {}

def train() -> None:
    a = torch.randn(1_000_000)
    for _ in range(200):  # the trainer's team exists and is warm
        a.mul_(1.0001)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    for _ in range(2000):
        a.mul_(1.0001)
    seen["switches"] = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before
    seen["threads"] = torch.get_num_threads()

trainer = threading.Thread(target=train)
trainer.start()
trainer.join()
print(seen["switches"], seen["threads"], torch.get_num_threads(), side_threads)
"""


def probe(mode: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_side_threads_leave_the_openmp_team_to_the_trainer() -> None:
    switches, trainer_threads, main_threads, side_threads = probe("fix")
    assert main_threads == "1" and side_threads == "1"  # the event loop's thread and its default executor
    if int(trainer_threads) < 2:
        # CI's 2 cores give torch 2 threads: there this runs. A 1-core machine has no team to keep.
        pytest.skip("torch runs one thread on this machine (CI's 2 cores run two): no OpenMP team to keep")
    assert int(switches) < 100, f"{switches} voluntary context switches in 2000 parallel ops"
    # Without it, the same work parks the trainer's team thread after nearly every op.
    switches_without, _, _, _ = probe("none")
    assert int(switches_without) > 1000, switches_without


def test_a_stop_waits_for_the_round_in_progress_not_for_the_grace() -> None:
    """The bootstrap's stop waits while its reducer is mid-round, and no longer than that (it waited out its
    whole 15 s grace whenever a stop came mid-round: 18 of 63 bootstrap stops in a full suite)."""
    from dilocod.node.runtime import wait_while

    async def scenario() -> tuple[bool, float, bool, float, bool]:
        loop = asyncio.get_running_loop()
        began = loop.time()
        ends = began + 0.3
        over = await wait_while(lambda: loop.time() < ends, grace=15)
        took = loop.time() - began
        began = loop.time()
        stuck = await wait_while(lambda: True, grace=0.3)
        stuck_took = loop.time() - began
        idle = await wait_while(lambda: False, grace=15)
        return over, took, stuck, stuck_took, idle

    over, took, stuck, stuck_took, idle = asyncio.run(scenario())
    assert over and 0.25 <= took < 2, took  # back once the round is over
    assert not stuck and 0.25 <= stuck_took < 2, stuck_took  # a round that never ends: the grace
    assert idle
