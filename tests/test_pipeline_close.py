"""A round's close reads Δ from the trainer's live parameters, with no copy of the working copy
(`RoundPipeline.contribution`), and adds the error-feedback residual into that fresh Δ in place."""

from __future__ import annotations

import pytest
import torch

from dilocod.codecs import ErrorFeedback
from dilocod.config import load_config
from dilocod.diloco import OuterOptimizer
from dilocod.rounds.pipeline import PipelineSettings, RoundPipeline
from dilocod.trust.adversary import Adversary
from tests.fakes import FakeTrainer


class CountingTrainer(FakeTrainer):
    """Counts the copies of the working copy the pipeline asks for."""

    copies = 0

    def working_params_fp32(self) -> list[torch.Tensor]:
        self.copies += 1
        return super().working_params_fp32()


def close(
    overlap: str, decay: float = 1.0, keep_own_work: bool = False
) -> tuple[RoundPipeline, CountingTrainer, list[torch.Tensor]]:
    cfg = load_config(None, [f'outer.overlap="{overlap}"', "outer.fragments=2"])
    outer = OuterOptimizer([torch.ones(3, 2), torch.zeros(4)], cfg.outer)
    trainer = CountingTrainer(outer.params)
    trainer.working = [torch.full((3, 2), 0.75), torch.full((4,), -0.25)]  # inner steps moved it
    feedback = ErrorFeedback([p.shape for p in outer.params], decay=decay)
    feedback.residual = [torch.full((3, 2), 0.125), torch.full((4,), 0.5)]
    fragments = 2 if overlap == "streaming" else 1
    settings = PipelineSettings(overlap=overlap, fragments=fragments, keep_own_work=keep_own_work)
    pipeline = RoundPipeline(settings, trainer, outer, feedback, Adversary(cfg.adversary, 0), None)  # type: ignore[arg-type]
    return pipeline, trainer, [t.clone() for t in trainer.working]


@pytest.mark.parametrize("overlap", ["none", "streaming"])
def test_the_close_reads_the_live_parameters_and_leaves_them_alone(overlap: str) -> None:
    pipeline, trainer, before = close(overlap)
    contribution = pipeline.contribution()
    assert trainer.copies == 0
    indices = contribution.indices if contribution.indices is not None else [0, 1]
    # Δ = θ_global − θ_local + e, for each tensor the round sends
    expected = {0: torch.full((3, 2), 0.25 + 0.125), 1: torch.full((4,), 0.25 + 0.5)}
    for i, delta in zip(indices, contribution.delta, strict=True):
        assert torch.equal(delta, expected[i])
        assert delta.data_ptr() != trainer.working[i].data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(trainer.working, before, strict=True))
    assert pipeline.feedback is not None
    assert torch.equal(pipeline.feedback.residual[1], torch.full((4,), 0.5))  # e is read, not changed


def test_delayed_overlap_keeps_its_copy_of_the_working_copy() -> None:
    pipeline, trainer, _ = close("delayed")
    contribution = pipeline.contribution()
    assert trainer.copies == 1  # the next round is measured from it
    assert contribution.progress is not None
    assert torch.equal(contribution.progress[0], torch.full((3, 2), 0.25))  # progress carries no residual
    assert torch.equal(contribution.delta[0], torch.full((3, 2), 0.375))


@pytest.mark.parametrize("overlap", ["none", "delayed", "streaming"])
def test_with_scoring_a_contribution_carries_its_rounds_own_work_without_the_feedback(overlap: str) -> None:
    """Scorers judge the round's own Δ: with topk's decaying feedback the residual holds many rounds of work
    not yet sent, and judging Δ + β·e failed honest peers."""
    pipeline, _, _ = close(overlap, decay=0.5, keep_own_work=True)
    contribution = pipeline.contribution()
    indices = contribution.indices if contribution.indices is not None else [0, 1]
    carried = {0: 0.5 * 0.125, 1: 0.5 * 0.5}
    assert contribution.own is not None
    for i, delta, own in zip(indices, contribution.delta, contribution.own, strict=True):
        assert torch.equal(delta, torch.full_like(delta, 0.25 + carried[i]))
        assert torch.equal(own, torch.full_like(delta, 0.25))
    assert close(overlap)[0].contribution().own is None  # scoring off: no copy
