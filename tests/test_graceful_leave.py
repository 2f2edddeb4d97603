"""A peer told to stop (SIGTERM) while its group exchanges tensors finishes serving its parts first.

Every member reduces a share of the parts; one that vanished mid-exchange would leave the others with
partial means (a failed round for all of them). Two peers: the stayer's round needs the leaver's
parts. The model is the `small` preset (≈21M values per pseudo-gradient), so that the exchange lasts
long enough on loopback to be interrupted reliably.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import pytest

from tests.harness import Proc, Swarm, wait_for

pytestmark = pytest.mark.integration

BIG = (
    "model.preset=small",
    "trainer.inner_steps=2",
    "trainer.batch_size=1",
    "trainer.seq_len=32",
    "trainer.eval_batches=1",
    "averaging.allreduce_timeout=60",
    "averaging.reducer=mean",
)


def test_sigterm_during_allreduce_finishes_serving_parts(swarm: Callable[..., Swarm]) -> None:
    s = swarm(2, *BIG)
    leaver, stayers = s.peers[1], s.peers[:1]
    s.wait_serving(leaver, timeout=240)
    # Both exchanging at once: a group of the leaver and the bootstrap's helper alone is no group at all.
    wait_for(
        "the leaver to be in an all-reduce with the stayer",
        lambda: bool(leaver.status().get("in_allreduce")) and bool(stayers[0].status().get("in_allreduce")),
        timeout=240,
        interval=0.02,
    )
    step = leaver.status()["outer_step"]
    leaver.signal(signal.SIGTERM)
    assert leaver.wait(timeout=60) == 0
    leaver_log = _log(leaver)
    assert "stopping after the all-reduce in progress" in leaver_log
    # It stayed for the round: its own outer step from that all-reduce landed before it stopped.
    assert f"outer step {step + 1}: ok" in leaver_log.split("stopping after the all-reduce")[1], leaver_log[
        -2000:
    ]

    # Whoever was in that group with it got a complete average: no stayer's round at that step failed,
    # nobody received partial results, and the round was applied by a stayer too.
    def after_round() -> list[dict[str, Any]] | None:
        statuses = [peer.status() for peer in stayers]
        return statuses if all(st["outer_step"] > step for st in statuses) else None

    statuses = wait_for(f"the others to pass outer step {step}", after_round, timeout=120)
    for status in statuses:
        failed = [e for e in status["rounds"] if e["outer_step"] == step and e["result"] == "failed"]
        assert not failed, status["rounds"][-4:]
    assert any(
        e["outer_step"] == step + 1 and e["result"] == "ok" and e["group_size"] >= 2
        for status in statuses
        for e in status["rounds"]
    ), [st["rounds"][-4:] for st in statuses]
    # (Earlier rounds may have been incomplete on a loaded machine; only the ones after the signal count.)
    signalled = next(line[:8] for line in leaver_log.splitlines() if "received SIGTERM" in line)
    for peer in stayers:
        late = [line for line in _log(peer).splitlines() if line[:8] >= signalled and "% results" in line]
        assert not late, late


def _log(proc: Proc) -> str:
    path = proc.run_dir / "dilocod.log" if proc.run_dir is not None else None
    return path.read_text(errors="replace") if path is not None and path.exists() else ""
