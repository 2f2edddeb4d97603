"""`trainer.micro_batch_size`: an inner step in pieces with accumulated gradients (dilocod.trainer.inner).

The run's tokens per step (`batch_size` × `seq_len` per local device) stay what they are; only how many
sequences one forward/backward pass holds changes. The local group with micro batches (devices = 2):
tests/test_local_group.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from dilocod.config import ConfigError, load_config
from dilocod.trainer.batches import Corpus, DataConfig
from dilocod.trainer.inner import InnerTrainer
from dilocod.trainer.model import ModelConfig
from dilocod.trainer.settings import TrainerConfig

TEXT = b"the quick brown fox jumps over the lazy dog. " * 400
# AdamW: the parameter tolerances below follow its update's arithmetic (Muon's orthogonalisation spreads a
# gradient's rounding differently); what micro-batching changes, the gradients, does not depend on it.
CFG = TrainerConfig(
    batch_size=8, seq_len=64, lr=3e-3, warmup_steps=5, total_steps=1000, device="cpu", optimizer="adamw"
)


def make_trainer(cfg: TrainerConfig) -> InnerTrainer:
    tokens = torch.frombuffer(bytearray(TEXT), dtype=torch.uint8)
    corpus = Corpus(train=tokens, eval=tokens[:2000].clone(), name="fox")
    return InnerTrainer(ModelConfig("tiny"), DataConfig(), cfg, seed=0, peer_key="peer-a", corpus=corpus)


def record_grads(trainer: InnerTrainer) -> list[list[torch.Tensor]]:
    """The gradients each optimizer step applies (after clipping), one list per step."""
    seen: list[list[torch.Tensor]] = []
    step = trainer.optimizer.step

    def recording_step(*args: Any, **kwargs: Any) -> Any:
        seen.append([p.grad.detach().clone() for p in trainer.params() if p.grad is not None])
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step  # type: ignore[method-assign]
    return seen


# ---------------------------------------------------------------- config


def test_default_is_the_whole_batch() -> None:
    assert TrainerConfig().micro_batch_size == 0
    TrainerConfig().validate()
    for micro in (0, 1, 2, 4, 8):  # 0 and every divisor of 8, the batch itself included
        replace(CFG, micro_batch_size=micro).validate()


@pytest.mark.parametrize("micro", [3, 5, 16, -1, -4])
def test_a_value_that_does_not_divide_the_batch_is_refused(micro: int) -> None:
    with pytest.raises(ValueError) as info:
        replace(CFG, micro_batch_size=micro).validate()
    message = str(info.value)
    assert message == (
        "trainer.micro_batch_size must be 0 (the whole batch at once) or a divisor of "
        f"trainer.batch_size (8), got {micro}"
    )


def test_config_key_and_one_line_error() -> None:
    assert load_config(None, ["trainer.micro_batch_size=4"]).trainer.micro_batch_size == 4
    with pytest.raises(ConfigError) as info:
        load_config(None, ["trainer.batch_size=16", "trainer.micro_batch_size=6"])
    message = str(info.value)
    assert "trainer.micro_batch_size must be" in message and "got 6" in message and "\n" not in message
    with pytest.raises(ConfigError, match="trainer.micro_batch_size"):
        load_config(None, ["trainer.micro_batch_size=2.5"])


# ---------------------------------------------------------------- the inner step


def test_micro_batches_give_the_full_batch_step() -> None:
    full, pieces = make_trainer(CFG), make_trainer(replace(CFG, micro_batch_size=CFG.batch_size // 4))
    full_grads, piece_grads = record_grads(full), record_grads(pieces)
    full_stats, piece_stats = full.train_steps(1), pieces.train_steps(1)

    assert piece_stats.tokens == full_stats.tokens == CFG.batch_size * CFG.seq_len
    assert pieces.tokens_per_step == full.tokens_per_step
    assert pieces.step == full.step == 1 and pieces.data_position == full.data_position == 1
    assert piece_stats.mean_loss == pytest.approx(full_stats.mean_loss, rel=1e-6)
    assert len(piece_grads) == len(full_grads) == 1 and len(piece_grads[0]) == len(full.params())
    for mine, theirs in zip(piece_grads[0], full_grads[0], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7)  # summation order differs only
    # AdamW's first update is about lr × sign(g) (lr = 6e-4 here): where g is near 0, its rounding
    # difference moves the update by up to ~2e-6 (measured), still under 2 % of the step.
    for mine, theirs in zip(pieces.params(), full.params(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_micro_batches_keep_following_the_full_batch() -> None:
    full, pieces = make_trainer(CFG), make_trainer(replace(CFG, micro_batch_size=2))
    for _ in range(3):
        expected, got = full.train_steps(1), pieces.train_steps(1)
        assert got.mean_loss == pytest.approx(expected.mean_loss, rel=1e-4)
    for mine, theirs in zip(pieces.params(), full.params(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


def test_micro_batches_split_forward_and_backward() -> None:
    trainer = make_trainer(replace(CFG, micro_batch_size=2))
    sizes: list[int] = []
    trainer.model.register_forward_pre_hook(lambda _module, args: sizes.append(args[0].shape[0]))
    trainer.train_steps(2)
    assert sizes == [2] * 8  # 4 pieces of 2 sequences per step, 2 steps


@pytest.mark.parametrize("micro", [0, CFG.batch_size])
def test_zero_or_the_whole_batch_takes_the_unchanged_path(
    micro: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_accumulation(*_args: Any) -> torch.Tensor:
        raise AssertionError("micro_batch_size = 0 (or the batch) must not accumulate")

    monkeypatch.setattr(InnerTrainer, "_accumulate", no_accumulation)
    reference, trainer = make_trainer(CFG), make_trainer(replace(CFG, micro_batch_size=micro))
    expected, got = reference.train_steps(2), trainer.train_steps(2)
    assert got.mean_loss == expected.mean_loss and got.tokens == expected.tokens
    for mine, theirs in zip(trainer.params(), reference.params(), strict=True):
        assert torch.equal(mine, theirs)
