"""Stepping back (dilocod/statesync/stepback.py): when a private peer goes back to the θ_global it held
before its last round, what that does to its state, and that the reducing bootstrap follows."""

from __future__ import annotations

from typing import Any

import torch

from dilocod.config import load_config
from dilocod.diloco import OuterOptimizer
from dilocod.processes.helper import due_now, next_round
from dilocod.rounds import clock
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


def test_the_reducing_bootstrap_joins_a_round_again_once_it_reopens() -> None:
    settings = clock.ClockSettings(target_tokens=1000, reference_tokens=1000, max_seconds=600, stale_after=10)

    def trainer(peer: str, round_index: int, opened: float, tokens: int = 0) -> dict[str, Any]:
        return {"role": "peer", "peer_id": peer, "round": round_index, "round_tokens": tokens,
                "tokens_per_second": 100.0, "time": 100.0, "round_opened": opened}  # fmt: skip

    due = next_round([trainer("a", 2, 90.0, 400), trainer("b", 2, 90.5, 400)], settings, now=100.0)
    assert due is not None
    round_index, opened, close, count = due
    assert (round_index, opened, count) == (2, 90.25, 2)
    assert close.at == 101.0  # 200 tokens left at 200 tokens/s
    # After a step back the trainers train round 2 again, opened anew: the helper sees a new round.
    again = next_round([trainer("a", 2, 99.0), trainer("b", 2, 99.2)], settings, now=100.0)
    assert again is not None and again[0] == 2 and again[1] > opened + 1
    # A tie between rounds goes to the later one (the others are about to catch up); helpers don't vote.
    tie = next_round([trainer("a", 3, 95.0), trainer("b", 4, 96.0), {"role": "helper"}], settings, now=100.0)
    assert tie is not None and tie[0] == 4
    assert next_round([], settings, now=100.0) is None


def test_the_reducing_bootstrap_joins_each_instance_of_a_round_once() -> None:
    assert due_now(None, 3, opened=90.0, close_at=100.0, now=100.0)
    assert not due_now(None, 3, opened=90.0, close_at=101.0, now=100.0)  # not closing yet
    joined = (3, 100.0)
    # The trainers' reports of when round 3 opened drift as records arrive: still the round we joined.
    assert not due_now(joined, 3, opened=90.6, close_at=100.5, now=101.0)
    # Round 3 reopened after we joined (it failed, or the trainers stepped back to it): join again.
    assert due_now(joined, 3, opened=103.0, close_at=105.0, now=105.0)
    assert due_now(joined, 4, opened=100.2, close_at=104.0, now=104.0)
    # Nobody says when the round opened (peers of an older version): no sign of a new instance.
    assert not due_now(joined, 3, opened=None, close_at=100.0, now=101.0)
