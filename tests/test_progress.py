"""The peer console: a progress line on a terminal, log records above it, nothing of it elsewhere."""

from __future__ import annotations

import asyncio
import io
import logging
import math
import time

import pytest

from dilocod.observability import progress
from dilocod.observability.peerstate import NodeFacts, PeerState, Phase
from dilocod.observability.progress import (
    CLEAR,
    Console,
    ConsoleHandler,
    StepClock,
    progress_line,
    show_progress,
)


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


# where each field the progress line reads lives in the state's parts (observability/peerstate.py)
PART_OF = {
    "outer_step": ("rounds", "outer_step"), "eval_loss": ("rounds", "eval_loss"),
    "round_closes_at": ("rounds", "round_closes_at"), "loss": ("inner", "loss"),
    "tokens_per_second": ("inner", "tokens_per_second"), "peers_known": ("swarm", "peers_known"),
    "round_steps": ("tokens", "round_steps"), "tokens_trained": ("tokens", "trained"),
    "tokens_contributed": ("tokens", "contributed"),
}  # fmt: skip


def state(phase: str = "training", **fields: object) -> PeerState:
    s = PeerState(NodeFacts(peer_id="p", run_id="r"))
    s.facts.life = Phase.TRAINING if phase in ("training", "averaging", "syncing") else Phase(phase)
    s.rounds.activity = Phase(phase) if phase in ("averaging", "syncing") else None
    for k, v in fields.items():
        part, name = PART_OF[k]
        setattr(getattr(s, part), name, v)
    return s


def test_progress_line_says_where_the_peer_is() -> None:
    s = state(outer_step=12, round_steps=3, loss=3.21449, eval_loss=3.3, tokens_per_second=12345.6,
              peers_known=2, phase="training", round_closes_at=time.time() + 24.4,
              tokens_trained=1000, tokens_contributed=970.0)  # fmt: skip
    line = progress_line(s, 50, seconds_per_step=0.5)
    assert line == (
        "outer 12 │ inner 3 │ loss 3.214 │ eval 3.300 │ 12,346 tok/s │ round closes in ~24s │ share 0.97 │ "
        "2 peers │ training"
    )
    assert "averaging now" in progress_line(state(phase="averaging"), 50, 0.5)
    assert "downloading θ_global" in progress_line(state(phase="syncing"), 50, 0.5)
    fresh = progress_line(state(loss=math.nan, phase="starting", peers_known=1), 50, None)
    assert "loss –" in fresh and "closes in –" in fresh and "– tok/s" in fresh and "1 peer │" in fresh
    assert "share" not in fresh  # nothing trained yet
    # Before the run's clock is known: H inner steps at our own pace.
    assert "round closes in ~17m" in progress_line(state(round_steps=0), 1000, 1.0)


def test_step_clock_ignores_pauses() -> None:
    clock = StepClock()
    clock.observe(0, 0.0)
    clock.observe(10, 5.0)
    assert clock.seconds_per_step == pytest.approx(0.5)
    clock.observe(10, 60.0, training=False)  # a long round: not step time
    clock.observe(10, 61.0)
    clock.observe(12, 62.0)
    assert clock.seconds_per_step == pytest.approx(0.7 * 0.5 + 0.3 * 0.5)


def test_console_keeps_the_line_below_log_records() -> None:
    term = FakeTerminal()
    console = Console(term)
    handler = ConsoleHandler(console)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    console.show("outer 1")
    handler.emit(logging.LogRecord("dilocod.x", logging.WARNING, __file__, 1, "careful", None, None))
    console.clear()
    assert term.getvalue() == f"{CLEAR}outer 1{CLEAR}dilocod.x: careful\nouter 1{CLEAR}"


def test_show_progress_on_a_terminal_quiets_info_then_restores_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "REFRESH_SECONDS", 0.01)
    term = FakeTerminal()
    handler = progress.console_handler(term)
    handler.setLevel(logging.INFO)
    s = state(outer_step=3, round_steps=1, phase="training", tokens_per_second=10.0)

    async def scenario() -> None:
        task = asyncio.create_task(show_progress(s, 5, term))
        await asyncio.sleep(0.1)
        assert handler.level == logging.WARNING
        s.rounds.outer_step = 4
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    out = term.getvalue()
    assert f"{CLEAR}outer 3 │ inner 1" in out and f"{CLEAR}outer 4 │" in out
    assert out.endswith(CLEAR)  # the line is gone when the peer stops
    assert handler.level == logging.INFO


def test_no_progress_line_when_not_a_terminal() -> None:
    plain = io.StringIO()
    handler = progress.console_handler(plain)
    handler.setLevel(logging.INFO)
    asyncio.run(asyncio.wait_for(show_progress(state(), 5, plain), 1))  # returns at once
    assert plain.getvalue() == "" and handler.level == logging.INFO


def test_compute_utilization_counts_inner_steps_over_wall_time_since_training_began() -> None:
    s = PeerState(NodeFacts(peer_id="p", run_id="r"))
    assert s.compute_utilization(now=100.0) == 0.0  # nothing trained yet (startup does not count)
    s.inner.training_began(10.0)
    assert s.compute_utilization(now=10.0) == 0.0
    assert s.compute_utilization(now=14.0) == 1.0  # the running stretch counts up to now
    s.inner.training_ended(16.0)  # 6 s of inner steps
    assert s.compute_utilization(now=16.0) == 1.0
    assert s.compute_utilization(now=18.0) == pytest.approx(6 / 8)  # averaging: the ratio falls
    s.inner.training_began(19.0)
    assert s.compute_utilization(now=21.0) == pytest.approx(8 / 11)
    s.inner.training_ended(21.0)
    s.inner.training_ended(25.0)  # an unmatched end changes nothing
    assert s.compute_utilization(now=32.0) == pytest.approx(8 / 22)
    assert 0.0 < s.record()["compute_utilization"] <= 1.0  # monotonic clock: far past 32.0 here
    assert 0.0 <= s.status()["compute_utilization"] <= 1.0
