"""CPU trainers on one machine share its cores (`dilocod/node/coreshare.py`): the rule, the registry
of live daemons, and peers of a real swarm that each report their share in `/api/status`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dilocod.node.coreshare import Claim, CoreShare, share_threads
from tests.harness import Swarm, wait_for

TWO = frozenset({0, 1})
EIGHT = frozenset(range(8))


@pytest.mark.parametrize(
    ("mine", "others", "threads"),
    [
        (Claim(TWO), [], 2),  # alone: every core
        (Claim(TWO), [Claim(TWO)], 1),  # two peers on 2 cores
        (Claim(TWO), [Claim(TWO), Claim(TWO)], 1),  # three on 2: never below one thread
        (Claim(EIGHT), [Claim(EIGHT)] * 3, 2),  # four on 8
        (Claim(EIGHT), [Claim(EIGHT, threads=4)], 4),  # a peer that fixed 4 threads leaves us the rest
        (Claim(EIGHT), [Claim(EIGHT, threads=2), Claim(EIGHT)], 3),  # (8 - 2) ÷ 2 share-takers
        (Claim(EIGHT), [Claim(frozenset({8, 9}))], 8),  # other CPUs (taskset): not ours to share
        (Claim(TWO, threads=3), [Claim(TWO)] * 3, 3),  # trainer.threads wins
    ],
)
def test_the_share_of_threads(mine: Claim, others: list[Claim], threads: int) -> None:
    assert share_threads(mine, [mine, *others]) == threads


# A daemon that registers and holds its claim until killed (the registry's dir comes as argv[1]).
HOLDER = """
import sys, time
from pathlib import Path
from dilocod.node.coreshare import Claim, CoreShare
share = CoreShare(Claim(frozenset({0, 1})), Path(sys.argv[1]))
share.register()
print("registered", flush=True)
time.sleep(300)
"""


def test_the_registry_counts_live_daemons_and_forgets_dead_ones(tmp_path: Path) -> None:
    mine = CoreShare(Claim(TWO), tmp_path)
    mine.register()
    assert mine.threads() == 2
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=Path.cwd()
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "registered"
        assert mine.threads() == 1
        assert len(list(tmp_path.glob("*.json"))) == 2
        holder.send_signal(signal.SIGKILL)  # no cleanup of its own: its lock goes with the process
        holder.wait(timeout=10)
        assert mine.threads() == 2
        assert [p.name for p in tmp_path.glob("*.json")] == [mine._name]  # the dead claim's file is gone
    finally:
        holder.kill()
        holder.wait(timeout=10)
    mine.close()
    assert not list(tmp_path.iterdir())


def test_a_registry_it_cannot_write_is_no_error(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    share = CoreShare(Claim(TWO), blocked / "registry")  # under a regular file: cannot exist
    share.register()
    assert share.threads() == 2
    share.close()


def test_garbage_in_the_registry_is_skipped(tmp_path: Path) -> None:
    (tmp_path / "1-dead.json").write_text("not json")
    share = CoreShare(Claim(TWO), tmp_path)
    share.register()
    assert share.threads() == 2
    assert not (tmp_path / "1-dead.json").exists()  # nobody held it: removed
    share.close()


@pytest.mark.integration
def test_peers_sharing_a_machine_take_their_share_and_grow_when_one_leaves(
    swarm: Callable[..., Swarm],
) -> None:
    """No peer of this swarm sets trainer.threads: each takes its share of the cores by itself."""
    cores = len(os.sched_getaffinity(0))
    s = swarm(2)
    for peer in s.peers:
        s.wait_serving(peer)
    share = [max(1, cores // 2)] * 2

    def threads() -> list[int] | None:
        found = [p.status()["threads"] for p in s.peers]
        return found if found == share else None

    wait_for("both peers at their share", threads, 60)
    s.peers[1].stop()
    started = time.monotonic()
    wait_for("the other peer back on every core", lambda: s.peers[0].status()["threads"] == cores or None, 60)
    assert time.monotonic() - started < 30
