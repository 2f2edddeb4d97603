"""The round driver (dilocod/rounds/driver.py) on fake ports: whole rounds, re-syncs and stops, without a
network or processes. The tensors are real (a real outer optimizer and pipeline on a tiny working copy)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

import pytest
import torch

from dilocod.config import load_config
from dilocod.diloco import OuterOptimizer
from dilocod.node.autodeadlines import resolve_deadlines
from dilocod.node.roundconfig import round_settings
from dilocod.observability.metrics import Metrics
from dilocod.observability.peerstate import NodeFacts, PeerState
from dilocod.rounds.clock import ClockSettings
from dilocod.rounds.core import RoundCore
from dilocod.rounds.driver import RoundDriver
from dilocod.rounds.machine import MachineSettings
from dilocod.rounds.phases import PHASES
from dilocod.rounds.pipeline import Contribution, PipelineSettings, RoundPipeline
from dilocod.rounds.ports import Parts
from dilocod.rounds.tokens import TokenLedger
from dilocod.statesync.catchup import SyncResult
from dilocod.trainer import StepStats
from dilocod.trust.adversary import Adversary
from dilocod.trust.bans import BanList
from peers.group import RoundOutcome
from tests.fakes import FakeTrainer

T = TypeVar("T")
TOKENS_PER_STEP = 100


class FakeTraining:
    """Each inner step moves the working copy by −0.01 and counts its tokens, until told to stop."""

    def __init__(self, trainer: FakeTrainer, ledger: TokenLedger, state: PeerState) -> None:
        self.trainer, self.ledger, self.state = trainer, ledger, state
        self.steps = 0

    async def train(self, should_stop: Callable[[], bool]) -> StepStats:
        taken = 0
        while taken == 0 or not should_stop():
            await asyncio.sleep(0.01)
            self.trainer.working = [p - 0.01 for p in self.trainer.working]
            self.ledger.stepped(TOKENS_PER_STEP, 0.01)
            self.state.inner.tokens_per_second = TOKENS_PER_STEP / 0.01
            taken += 1
            if taken > 1000:
                raise AssertionError("the clock never closed the round")
        self.steps += taken
        return StepStats(taken, 1.0, taken * TOKENS_PER_STEP, taken * 0.01)

    async def run(self, fn: Callable[[], T]) -> T:
        return fn()

    async def evaluate(self) -> float:
        return 1.0


class FakeAveraging:
    """Answers each round from a script: a function of the contribution."""

    def __init__(self, script: deque[Callable[[Contribution], RoundOutcome]]) -> None:
        self.script, self.in_allreduce = script, False
        self.seen: list[tuple[int, bytes]] = []
        self.seconds = 0.0  # how long each round takes

    async def average(self, contribution: Contribution, ticket: bytes, group_target: int) -> RoundOutcome:
        self.seen.append((contribution.step, ticket))
        await asyncio.sleep(self.seconds)
        answer = self.script.popleft() if self.script else no_group
        return answer(contribution)

    async def judge(self, outcome: RoundOutcome) -> None:
        return None


class FakeSync:
    def __init__(self, outer: OuterOptimizer, results: deque[int]) -> None:
        self.outer, self.results, self.shared = outer, results, 0
        self.offering = False  # a snapshot of our state is offered (between `share` and `withdraw`)
        self.stepped_offering: list[bool] = []  # at each outer step: was the old state still offered?
        apply = outer.apply

        def watched_apply(*args: Any, **kwargs: Any) -> None:
            self.stepped_offering.append(self.offering)
            apply(*args, **kwargs)

        outer.apply = watched_apply  # type: ignore[method-assign]
        self.state: PeerState | None = None  # to read our record while the download runs
        self.announced: list[dict[str, Any]] = []
        self.pending: list[torch.Tensor] | None = None  # a donor's round in flight, sent with its state
        self.offered: list[tuple[int, list[torch.Tensor]]] = []  # what we offered as ours (share_pending)
        self.announce_seconds: list[float] = []  # how long each announcement held the download back

    async def catch_up(
        self, min_step: int, announce: Callable[[int], Awaitable[None]] | None = None
    ) -> SyncResult:
        start = self.outer.step
        if not self.results:
            return SyncResult(False, start, start)
        if announce is not None:
            began = time.monotonic()
            await announce(self.results[0])
            self.announce_seconds.append(time.monotonic() - began)
            self.announced.append(self.state.record() if self.state is not None else {})
        step = self.results.popleft()
        self.outer.load_state(step, [*self.outer.params, *self.outer.momentum])
        return SyncResult(True, step, start, kept_progress=True, donor="donor", pending=self.pending)

    def share(self) -> None:
        self.shared += 1
        self.offering = True

    def withdraw(self) -> None:
        self.offering = False

    def share_pending(self, step: int, averaged: list[torch.Tensor]) -> None:
        self.offered.append((step, averaged))


class FakeView:
    def __init__(self) -> None:
        self.others: list[dict[str, Any]] = []
        self.state: PeerState | None = None  # set: every read also takes our record, as a heartbeat would
        self.ours: list[dict[str, Any]] = []

    async def records(self) -> list[dict[str, Any]]:
        if self.state is not None:
            self.ours.append(self.state.record())
        return list(self.others)

    async def helpers(self) -> list[dict[str, Any]]:
        return []

    async def manifest_differences(self, manifest_hash: str) -> tuple[str, ...]:
        return ()


class FakePublisher:
    def __init__(self) -> None:
        self.published = self.checkpoints = 0

    async def publish(self) -> None:
        self.published += 1

    async def checkpoint(self) -> None:
        self.checkpoints += 1


def ok(contribution: Contribution) -> RoundOutcome:
    averaged = [d * 0.5 for d in contribution.delta]
    return RoundOutcome(True, 3, 3, True, True, averaged, 0.1, majority_size=3, my_weight=150.0)


def no_group(contribution: Contribution) -> RoundOutcome:
    return RoundOutcome(False, 0, 0, False, False, None, 0.1, error="could not find a group")


def peer_record(step: int) -> dict[str, Any]:
    return {
        "role": "peer",
        "peer_id": "other",
        "outer_step": step,
        "global_sha256": "f" * 64,
        "time": time.time(),
    }


class Rig:
    def __init__(self, overlap: str = "none", script: list[Callable[[Contribution], RoundOutcome]] | None = None,
                 syncs: list[int] | None = None, sets: tuple[str, ...] = ()) -> None:  # fmt: skip
        cfg, _ = resolve_deadlines(  # as the daemon does: auto deadlines made concrete
            load_config(
                None,
                [
                    f'outer.overlap="{overlap}"',
                    "averaging.matchmaking_timeout=10",
                    "trainer.eval_every=1",
                    *sets,
                ],
            )
        )
        self.state = PeerState(NodeFacts(peer_id="me", run_id=cfg.run.id))
        self.outer = OuterOptimizer([torch.ones(4), torch.zeros(3)], cfg.outer)
        self.trainer = FakeTrainer(self.outer.params)
        self.ledger = TokenLedger()
        self.state.tokens = self.ledger
        pipeline = RoundPipeline(
            PipelineSettings(overlap=overlap),
            self.trainer,
            self.outer,
            None,
            Adversary(cfg.adversary, 0),
            None,  # type: ignore[arg-type]
        )
        self.training = FakeTraining(self.trainer, self.ledger, self.state)
        self.averaging = FakeAveraging(deque(script or []))
        self.sync = FakeSync(self.outer, deque(syncs or []))
        self.sync.state = self.state
        self.view, self.publisher = FakeView(), FakePublisher()
        parts = Parts(self.training, self.averaging, self.sync, self.view, self.publisher)
        clock = ClockSettings(target_tokens=500, reference_tokens=500, max_seconds=30, stale_after=10)
        core = RoundCore(round_settings(cfg), self.state, Metrics(), self.outer, pipeline, self.ledger)
        self.driver = RoundDriver(
            core, parts, MachineSettings(overlapped=overlap != "none"), clock, BanList(None)
        )

    def run_until(self, done: Callable[[], bool], timeout: float = 20.0) -> None:
        async def main() -> None:
            stopping = asyncio.Event()
            task = asyncio.create_task(self.driver.run(stopping))
            deadline = time.monotonic() + timeout
            while not done() and time.monotonic() < deadline and not task.done():
                await asyncio.sleep(0.01)
            stopping.set()
            await asyncio.wait_for(task, 10)

        asyncio.run(main())

    def results(self) -> list[str]:
        return [r.result for r in self.state.rounds.history]


def test_rounds_apply_the_group_average_and_count_our_tokens() -> None:
    rig = Rig(script=[ok, ok])
    rig.view.others = [peer_record(0)]
    rig.run_until(lambda: rig.outer.step >= 2)
    assert rig.results()[:2] == ["ok", "ok"] and rig.outer.step >= 2
    first = rig.state.rounds.history[0]
    assert first.tokens >= 500 and first.tokens_counted == 150.0  # the weight the group gave us
    assert rig.state.tokens.contributed >= 300 and rig.state.rounds.contributing
    assert rig.publisher.checkpoints >= 2 and rig.publisher.published >= 2 and rig.sync.shared >= 2
    # each outer step ran with our snapshot withdrawn (its old tensors freed as replaced), offered again after
    assert rig.sync.stepped_offering[:2] == [False, False] and rig.sync.offering
    assert rig.state.rounds.round_opened > 0 and rig.state.round_closes_in() is not None
    # every applied step was evaluated into its own round's record (eval_every = 1 here)
    assert [e.eval_loss for e in rig.state.rounds.history if e.result == "ok"][:2] == [1.0, 1.0]


def test_a_peer_the_run_left_behind_re_syncs_at_the_close_and_keeps_its_tokens() -> None:
    rig = Rig(script=[ok], syncs=[7])
    rig.view.others = [peer_record(7)]  # the run is at step 7; we are at 0
    rig.run_until(lambda: rig.outer.step >= 8)
    assert rig.results()[:2] == ["resynced", "ok"], rig.results()
    assert rig.outer.step >= 8 and rig.ledger.trained > 0


@pytest.mark.parametrize("overlap", ["none", "delayed"])
def test_a_re_syncing_peer_says_which_round_it_is_joining_until_it_has_the_state(overlap: str) -> None:
    """While the state downloads, our record names the round we will train with it (the run's clock holds
    that round open for us; with overlap, until we have the round in flight too, to apply at that close)."""
    joining = 7
    rig = Rig(overlap=overlap, script=[ok] * 3, syncs=[7])
    rig.view.others = [peer_record(7)]
    rig.run_until(lambda: rig.outer.step >= 8)
    during = rig.sync.announced[0]
    assert during["joining"] == joining
    if joining is not None:
        assert during["joining_since"] <= during["time"] and rig.publisher.published >= 1
    assert rig.state.record()["joining"] is None and rig.state.record()["joining_since"] is None


def test_our_record_is_never_between_joining_and_in_the_round() -> None:
    """A heartbeat may publish our record at any moment: from the download's start until we train the
    run's round, it must say either `joining` or the new round, never the old round alone (the run's
    clock would stop waiting for us, and count us in no round)."""
    rig = Rig(script=[ok] * 3, syncs=[7])
    rig.view.others = [peer_record(7)]
    rig.view.state = rig.state
    rig.run_until(lambda: rig.outer.step >= 8)
    began = next(i for i, r in enumerate(rig.view.ours) if r["joining"] is not None)
    after = rig.view.ours[began:]
    assert all(r["joining"] == 7 or r["round"] >= 7 for r in after), [
        (r["joining"], r["round"]) for r in after
    ]
    assert any(r["joining"] is None for r in after)  # and it did arrive


def test_a_failed_re_sync_trains_a_whole_round_before_trying_again() -> None:
    # No donor can be adopted (syncs=[]), the run stays past us: the peer must not spin between a
    # one-step round and another download, it trains to the clock's close (500 tokens = 5 steps) first.
    rig = Rig(syncs=[])
    rig.view.others = [peer_record(7)]
    rig.run_until(lambda: rig.results().count("sync_failed") >= 2)
    assert rig.results()[:3] == ["sync_failed", "late", "sync_failed"], rig.results()
    assert rig.training.steps >= 500 // TOKENS_PER_STEP  # the held round ran to the clock's close


def test_no_group_keeps_the_progress_and_the_tokens_for_the_next_round() -> None:
    rig = Rig(script=[no_group, ok])
    rig.view.others = [peer_record(0)]
    rig.run_until(lambda: rig.outer.step >= 1)
    assert rig.results()[:2] == ["no_group", "ok"]
    kept, applied = rig.state.rounds.history[0], rig.state.rounds.history[1]
    assert applied.tokens > kept.tokens  # the second contribution carried the first round's tokens


def test_alone_when_nobody_is_alive() -> None:
    rig = Rig(script=[no_group])
    rig.driver.observer.others_seen_at = -1e9
    rig.run_until(lambda: rig.outer.step >= 1)
    assert rig.results()[0] == "alone" and rig.state.rounds.alone


def test_delayed_overlap_averages_while_the_next_round_trains() -> None:
    rig = Rig(overlap="delayed", script=[ok, ok, ok])
    rig.view.others = [peer_record(0)]
    rig.run_until(lambda: rig.outer.step >= 2)
    assert rig.results()[:2] == ["ok", "ok"]
    assert [step for step, _ in rig.averaging.seen[:3]] == [0, 1, 2]  # one round in flight at a time


def test_with_overlap_a_completed_round_in_flight_is_offered_with_our_state() -> None:
    rig = Rig(overlap="delayed", script=[ok, no_group, ok, ok])
    rig.view.others = [peer_record(0)]
    rig.run_until(lambda: rig.outer.step >= 2)
    # a round that found no group has nothing to offer; each completed one is offered at its own step
    steps = [step for step, _ in rig.sync.offered]
    assert steps[:2] == [0, 1] and len(rig.averaging.seen) >= 3, (steps, rig.results())


def test_a_joiner_with_overlap_applies_the_donors_round_in_flight_and_then_sends_all_its_progress() -> None:
    sent: list[tuple[Contribution, list[torch.Tensor]]] = []  # each launched round, and θ_global then

    def ok_and_seen(contribution: Contribution) -> RoundOutcome:
        sent.append((contribution, [p.clone() for p in rig.outer.params]))
        return ok(contribution)

    rig = Rig(overlap="delayed", script=[ok_and_seen] * 3, syncs=[7])
    rig.view.others = [peer_record(7)]
    pending = [torch.full((4,), 0.25), torch.full((3,), -0.5)]
    rig.sync.pending = pending
    adopted = [p.clone() for p in rig.outer.params]  # the fake download keeps θ, moves only the step
    rig.run_until(lambda: rig.outer.step >= 9)
    assert rig.results()[:3] == ["resynced", "caught_up", "ok"], rig.results()
    # the donor's round was not ours: none of our tokens were in it
    caught = rig.state.rounds.history[1]
    assert caught.outer_step == 8 and caught.tokens == 0 and caught.tokens_counted == 0
    first, theta = sent[0]
    assert first.step == 8  # our first round is the run's next one, launched with everybody
    # θ_global took exactly the outer step the donor's group took at that close (lr 1, no momentum)
    assert all(torch.equal(t, a - p) for t, a, p in zip(theta, adopted, pending))
    # and that round sent every inner step we took, measured from the new θ_global, with their tokens
    steps = round(float(first.delta[0][0]) / 0.01)
    assert steps >= 5 and rig.state.rounds.history[2].tokens == steps * TOKENS_PER_STEP
    assert all(torch.allclose(d, torch.full_like(d, 0.01 * steps)) for d in first.delta)


def test_with_overlap_only_a_peer_that_missed_after_a_short_re_sync_waits_for_the_round_in_flight() -> None:
    # The run (one other trainer) is at step 7 training round 8; our re-syncs come without its round in
    # flight. The first download goes at once. Once we have it the run is already at step 8 (we missed its
    # group): the second download waits until the run's round in flight is done, which the run's records
    # put at the moment round 9 opened + window 0.2 s + 2 × request timeout 0.1 s + 1 s of all-reduce.
    sets = ("averaging.min_matchmaking_time=0.2", "averaging.request_timeout=0.1")
    rig = Rig(overlap="delayed", script=[no_group] * 10, syncs=[7, 8], sets=sets)
    opened: dict[int, float] = {8: time.time()}

    def fresh() -> list[dict[str, Any]]:
        step = 7 + min(len(rig.sync.announce_seconds), 1)
        since = opened.setdefault(step + 1, time.time())
        record = {**peer_record(step), "round": step + 1, "round_tokens": 0, "round_opened": since}
        return [{**record, "tokens_per_second": 1.0}]

    rig.view.records = lambda: _now(fresh())  # type: ignore[method-assign]
    rig.run_until(lambda: len(rig.sync.announce_seconds) >= 2, timeout=30)
    first, second = rig.sync.announce_seconds[:2]
    assert first < 0.2, rig.sync.announce_seconds
    # the wait ends 1.4 s after round 9 opened, less the moments it took us to find we were late
    assert 0.8 < second <= 1.4 + 0.05, rig.sync.announce_seconds


async def _now(value: T) -> T:
    return value


@pytest.mark.parametrize("seconds", [0.0, 0.3])
def test_rounds_that_outlast_the_next_ones_training_are_named_once(
    seconds: float, caplog: pytest.LogCaptureFixture
) -> None:
    """With overlap, a round hides behind the next round's training only while it is the shorter: rounds
    of 0.3 s against 0.05 s of training make the inner steps wait, and the peer says so (once, after three
    such rounds in a row); rounds that finish in time say nothing."""
    rig = Rig(overlap="delayed", script=[ok] * 100)
    rig.averaging.seconds = seconds
    rig.view.others = [peer_record(0)]
    with caplog.at_level("WARNING", logger="dilocod.rounds"):
        rig.run_until(lambda: rig.outer.step >= 6)
    said = [r for r in caplog.records if "outlasted the next one's training three times" in r.getMessage()]
    assert len(said) == (1 if seconds else 0), [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("overlap", ["none", "delayed"])
def test_a_stop_ends_the_loop_promptly(overlap: str) -> None:
    rig = Rig(overlap=overlap, script=[ok] * 100)
    rig.view.others = [peer_record(0)]
    started = time.monotonic()
    rig.run_until(lambda: False, timeout=1.0)
    assert time.monotonic() - started < 5.0


@pytest.mark.parametrize("overlap", ["none", "delayed"])
def test_each_round_says_where_the_time_between_its_inner_steps_went(overlap: str) -> None:
    """`/api/status` `last_round_phases` and each round's record: the seconds from the end of one stretch of
    inner steps to the start of the next, by phase (here: 0.2 s rounds, 0.1 s of them all-reduce)."""

    def timed(contribution: Contribution) -> RoundOutcome:
        return replace(ok(contribution), seconds=0.2, allreduce_seconds=0.1)

    rig = Rig(overlap=overlap, script=[timed, timed, timed])
    rig.averaging.seconds = 0.2
    rig.view.others = [peer_record(0)]
    rig.run_until(lambda: rig.outer.step >= 2 and rig.state.rounds.history[1].phases is not None)
    phases = rig.state.rounds.history[1].phases
    assert phases is not None and rig.state.rounds.last_round_phases is not None
    assert {"close", "outer_step", "eval", "checkpoint", "publish"} <= set(phases)
    if overlap == "none":  # the trainer waited for the whole round: matchmaking, then the all-reduce
        assert phases["allreduce"] == pytest.approx(0.1)
        assert 0.05 < phases["matchmaking"] < 0.5
        assert "waiting" not in phases
    else:  # the round averaged while the next one trained: at most a short wait for it
        assert "matchmaking" not in phases and "allreduce" not in phases
        assert phases.get("waiting", 0.0) < 0.2
    assert list(phases) == [p for p in PHASES if p in phases]  # in the order a round goes through them
