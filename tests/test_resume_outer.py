"""A FedAdam/FedYogi run's checkpoint holds the second moments and resumes them; a checkpoint of another
outer step is refused in one line (nothing in the run dir changes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dilocod.config import load_config
from dilocod.node.resume import build_trainer, checkpoint_payload
from dilocod.observability.peerstate import RoundProgress
from dilocod.statesync.checkpoint import CheckpointError

SMALL = ["trainer.batch_size=2", "trainer.seq_len=16", "trainer.threads=1"]


def trained(optimizer: str, run_dir: Path) -> tuple[dict, list[torch.Tensor]]:
    cfg = load_config(None, [*SMALL, f"outer.optimizer={optimizer}", "outer.momentum=0.9"])
    resumed = build_trainer(cfg, "resume-test", None, run_dir)
    resumed.trainer.train_steps(2)
    resumed.outer.apply(resumed.outer.pseudo_gradient(resumed.trainer.working_params_fp32()))
    return checkpoint_payload(cfg, resumed, RoundProgress()), resumed.outer.state_tensors()


@pytest.mark.parametrize("optimizer", ["fedadam", "fedyogi"])
def test_the_second_moments_survive_a_restart(optimizer: str, tmp_path: Path) -> None:
    payload, state = trained(optimizer, tmp_path)
    cfg = load_config(None, [*SMALL, f"outer.optimizer={optimizer}", "outer.momentum=0.9"])
    again = build_trainer(cfg, "resume-test", payload, tmp_path)
    assert again.outer.step == 1 and len(again.outer.second) == len(again.outer.params)
    assert all(torch.equal(a, b) for a, b in zip(again.outer.state_tensors(), state, strict=True))
    assert any(bool(v.abs().sum() > 0) for v in again.outer.second)


def test_a_checkpoint_of_another_outer_step_is_refused_in_one_line(tmp_path: Path) -> None:
    payload, _ = trained("sgd", tmp_path)
    cfg = load_config(None, [*SMALL, "outer.optimizer=fedadam"])
    with pytest.raises(CheckpointError) as caught:
        build_trainer(cfg, "resume-test", payload, tmp_path)
    message = str(caught.value)
    assert "\n" not in message and "cannot be resumed" in message and "outer step is fedadam" in message
