"""Stepping back (dilocod/statesync/stepback.py): when a private peer goes back to the θ_global it held
before its last round, what that does to its state, and that the reducing bootstrap follows."""

from __future__ import annotations

from typing import Any

import torch

from dilocod.config import load_config
from dilocod.diloco import OuterOptimizer
from dilocod.rounds.facts import Us, behind_on_previous
from dilocod.rounds.pipeline import PipelineSettings, RoundPipeline
from dilocod.trust.adversary import Adversary
from tests.fakes import FakeTrainer

OLD, NEW, OTHER = "a" * 64, "b" * 64, "c" * 64


def rec(step: int, sha: str = OLD) -> dict[str, Any]:
    return {"peer_id": f"p{step}{sha[0]}", "outer_step": step, "global_sha256": sha}


US = Us("me", 5, NEW, previous=(4, OLD))


def test_behind_on_previous_when_everyone_else_is_stuck_one_step_behind_on_our_previous_theta() -> None:
    assert behind_on_previous([rec(4)], US)
    assert behind_on_previous([rec(4), rec(4), rec(3)], US)


def test_not_behind_on_previous_when_someone_can_meet_us_or_serve_those_behind() -> None:
    assert not behind_on_previous([rec(4), rec(5, NEW)], US)  # a partner at our step
    assert not behind_on_previous([rec(4), rec(6, NEW)], US)  # someone ahead


def test_not_behind_on_previous_too_far_or_onto_another_theta() -> None:
    assert not behind_on_previous([], US)  # nobody to meet
    assert not behind_on_previous([rec(3)], US)  # two steps behind: no copy of that
    assert not behind_on_previous([rec(4, OTHER)], US)  # they hold another θ
    assert not behind_on_previous([rec(4), rec(3), rec(3)], US)  # not most of them
    assert not behind_on_previous([rec(4)], Us("me", 6, NEW, previous=(4, OLD)))  # our copy is not of step 5
    assert not behind_on_previous([rec(4)], Us("me", 5, NEW))  # no copy at all


def pipeline(private: bool, overlap: str = "none") -> RoundPipeline:
    cfg = load_config(None, [f'outer.overlap="{overlap}"'])
    outer = OuterOptimizer([torch.ones(3), torch.zeros(2)], cfg.outer)
    trainer = FakeTrainer(outer.params)
    settings = PipelineSettings(overlap=overlap, keep_previous=private and overlap == "none")
    return RoundPipeline(settings, trainer, outer, None, Adversary(cfg.adversary, 0), None)  # type: ignore[arg-type]


def apply_round(p: RoundPipeline) -> None:
    contribution = p.contribution()
    p.apply(contribution, [torch.full((3,), 0.5), torch.full((2,), -0.5)])


def test_a_private_peer_steps_back_to_its_previous_theta_and_momentum() -> None:
    p = pipeline(private=True)
    apply_round(p)
    before = (p.outer.step, p.outer.sha256, [t.clone() for t in p.outer.state_tensors()])
    apply_round(p)
    working = p.trainer.working_params_fp32()
    previous = p.step_back()
    assert previous is not None and (previous.step, previous.sha256) == before[:2]
    assert (p.outer.step, p.outer.sha256) == before[:2]
    for now, then in zip(p.outer.state_tensors(), before[2]):
        assert torch.equal(now, then)
    for now, then in zip(p.trainer.working_params_fp32(), working):  # our progress since is kept
        assert torch.equal(now, then)
    assert p.step_back() is None  # one step back at most


def test_public_peers_and_overlap_keep_no_copy_and_never_step_back() -> None:
    for p in (pipeline(private=False), pipeline(private=True, overlap="delayed")):
        apply_round(p)
        apply_round(p)
        assert p.previous is None and p.step_back() is None
        assert p.outer.step == 2
