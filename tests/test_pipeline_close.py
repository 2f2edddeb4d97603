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


def close(overlap: str) -> tuple[RoundPipeline, CountingTrainer, list[torch.Tensor]]:
    cfg = load_config(None, [f'outer.overlap="{overlap}"', "outer.fragments=2"])
    outer = OuterOptimizer([torch.ones(3, 2), torch.zeros(4)], cfg.outer)
    trainer = CountingTrainer(outer.params)
    trainer.working = [torch.full((3, 2), 0.75), torch.full((4,), -0.25)]  # inner steps moved it
    feedback = ErrorFeedback([p.shape for p in outer.params])
    feedback.residual = [torch.full((3, 2), 0.125), torch.full((4,), 0.5)]
    settings = PipelineSettings(overlap=overlap, fragments=2 if overlap == "streaming" else 1)
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
