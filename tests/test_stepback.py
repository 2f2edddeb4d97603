"""Stepping back (dilocod/stepback.py): when a private peer goes back to the θ_global it held before its
last round, and what that does to its state and history."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import torch

from dilocod.config import load_config
from dilocod.diloco import OuterOptimizer
from dilocod.metrics import Metrics
from dilocod.peerstate import PeerState, RoundRecord
from dilocod.stepback import STRANDED_ROUNDS, Previous, StepBack, should_step_back

OLD, NEW, OTHER = "a" * 64, "b" * 64, "c" * 64


def rec(step: int, sha: str = OLD) -> dict[str, Any]:
    return {"peer_id": f"p{step}{sha[0]}", "outer_step": step, "global_sha256": sha}


PREVIOUS = Previous(4, OLD, [])


def test_steps_back_only_when_everyone_else_is_stuck_one_step_behind_on_our_previous_theta() -> None:
    assert should_step_back(5, PREVIOUS, [rec(4)], STRANDED_ROUNDS)
    assert should_step_back(5, PREVIOUS, [rec(4), rec(4), rec(3)], STRANDED_ROUNDS)


def test_does_not_step_back_when_someone_can_meet_us_or_serve_those_behind() -> None:
    assert not should_step_back(5, PREVIOUS, [rec(4), rec(5, NEW)], STRANDED_ROUNDS)  # a partner at our step
    assert not should_step_back(5, PREVIOUS, [rec(4), rec(6, NEW)], STRANDED_ROUNDS)  # someone ahead


def test_does_not_step_back_too_early_too_far_or_onto_another_theta() -> None:
    assert not should_step_back(5, PREVIOUS, [rec(4)], STRANDED_ROUNDS - 1)  # records can lag: wait
    assert not should_step_back(5, PREVIOUS, [], STRANDED_ROUNDS)  # nobody to meet
    assert not should_step_back(5, PREVIOUS, [rec(3)], STRANDED_ROUNDS)  # two steps behind: no copy of that
    assert not should_step_back(5, PREVIOUS, [rec(4, OTHER)], STRANDED_ROUNDS)  # they hold another θ
    assert not should_step_back(5, PREVIOUS, [rec(4), rec(3), rec(3)], STRANDED_ROUNDS)  # not most of them
    assert not should_step_back(6, PREVIOUS, [rec(4)], STRANDED_ROUNDS)  # our copy is not of step 5
    assert not should_step_back(5, None, [rec(4)], STRANDED_ROUNDS)


def step_back(keeper: StepBack, others: list[dict[str, Any]]) -> bool:
    return asyncio.run(keeper._maybe_step_back(others))


class Keeper(StepBack):
    """StepBack with what RoundKeeper gives it, on a real outer optimizer."""

    def __init__(self, private: bool, overlap: str = "none") -> None:
        self.cfg = load_config(None, [f'outer.overlap="{overlap}"'])
        self.state, self.metrics, self.feedback = PeerState(), Metrics(), None
        self.state.history = deque()
        self.outer = OuterOptimizer([torch.ones(3), torch.zeros(2)], self.cfg.outer)
        self._previous, self._stranded, self._private = None, 0, private

    @property
    def serves_no_state(self) -> bool:
        return self._private

    def _after_new_global(self) -> None:
        self.state.outer_step, self.state.global_sha256 = self.outer.step, self.outer.sha256

    async def _in_trainer(self, fn: Any) -> Any:
        return fn()

    def apply_round(self) -> None:
        self._keep_previous()
        self.outer.apply([torch.full((3,), 0.5), torch.full((2,), -0.5)])
        self.state.history.append(RoundRecord(self.outer.step, "ok", 2, 1.0, self.outer.sha256))


def test_a_private_peer_steps_back_to_its_previous_theta_and_momentum_and_marks_the_round() -> None:
    keeper = Keeper(private=True)
    keeper.apply_round()
    before = (keeper.outer.step, keeper.outer.sha256, [t.clone() for t in keeper.outer.state_tensors()])
    keeper.apply_round()
    stuck = [{"peer_id": "b", "outer_step": before[0], "global_sha256": before[1]}]
    assert not step_back(keeper, stuck)  # first stranded round: records may lag
    assert step_back(keeper, stuck)
    assert (keeper.outer.step, keeper.outer.sha256) == before[:2]
    for now, then in zip(keeper.outer.state_tensors(), before[2]):
        assert torch.equal(now, then)
    assert [(e.outer_step, e.result) for e in keeper.state.history] == [
        (1, "ok"),
        (2, "undone"),
        (1, "stepped_back"),
    ]
    assert keeper.state.outer_step == 1 and keeper._previous is None  # one step back at most


def test_public_peers_and_overlap_keep_no_copy_and_never_step_back() -> None:
    for keeper in (Keeper(private=False), Keeper(private=True, overlap="delayed")):
        keeper.apply_round()
        keeper.apply_round()
        assert keeper._previous is None
        stuck = [{"peer_id": "b", "outer_step": 1, "global_sha256": "0" * 64}]
        assert not step_back(keeper, stuck) and not step_back(keeper, stuck)
        assert keeper.outer.step == 2


def test_the_reducing_bootstrap_follows_peers_back_to_a_step_it_reduced_once_records_settle() -> None:
    from types import SimpleNamespace

    from dilocod.helper import AuxReducer

    helper = SimpleNamespace(last_step=2, reduced_at=100.0, record_lag=10.0)
    peers = [{"role": "peer", "outer_step": 2}, {"role": "peer", "outer_step": 2}]
    assert AuxReducer._target(helper, peers, now=101.0) == 3  # their records still show the round just done
    assert AuxReducer._target(helper, peers, now=111.0) == 2  # they really are there: they stepped back
    assert AuxReducer._target(helper, [{"role": "peer", "outer_step": 4}], now=101.0) == 4
    assert AuxReducer._target(helper, [{"role": "helper", "outer_step": 9}], now=101.0) is None
