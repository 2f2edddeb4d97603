"""The CUDA path (marker `cuda`: skipped where torch sees no GPU, see conftest.py). On a GPU machine they
run through bench/gpu_check.sh (last: one H200, 5 passed and the 2-GPU test skipped; docs/benchmarks.md)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dilocod.config import load_config
from dilocod.diloco.outer import OuterConfig, OuterOptimizer
from dilocod.trainer import DataConfig, InnerTrainer, LocalGroup, ModelConfig, TrainerConfig
from dilocod.trainer.flops import known_peak_flops
from dilocod.trainer.optim import MuonWithAdamW

pytestmark = pytest.mark.cuda

REPO = Path(__file__).resolve().parent.parent
CFG = TrainerConfig(batch_size=8, seq_len=128, warmup_steps=2, device="cuda")


@pytest.fixture
def data(tmp_path: Path) -> DataConfig:
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 4000)
    return DataConfig(source=str(path))


@pytest.fixture(autouse=True)
def _fresh_memory_stats() -> Iterator[None]:
    yield
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_cuda_trainer_uses_bf16_fused_adamw_and_pinned_copies(data: DataConfig, optimizer: str) -> None:
    trainer = InnerTrainer(
        ModelConfig("tiny"), data, replace(CFG, optimizer=optimizer), seed=0, peer_key="gpu"
    )
    assert trainer.device.type == "cuda"
    inner = trainer.optimizer
    adamw = inner.parts["adamw"] if isinstance(inner, MuonWithAdamW) else inner  # Muon's AdamW part too
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["fused"] is True
    with trainer._autocast():
        assert torch.get_autocast_dtype("cuda") == torch.bfloat16
    stats = trainer.train_steps(5)
    assert math.isfinite(stats.mean_loss)
    copies = trainer.working_params_fp32()
    assert all(c.is_pinned() and c.device.type == "cpu" and c.dtype == torch.float32 for c in copies)
    outer = OuterOptimizer(copies, OuterConfig())
    outer.pin_memory()
    assert all(p.is_pinned() for p in outer.params)
    outer.apply([torch.full_like(p, 1e-3) for p in outer.params])
    assert all(p.is_pinned() for p in outer.params)  # updated in place
    trainer.load_params(outer.params)
    for param, theta in zip(trainer.params(), outer.params, strict=True):
        assert torch.equal(param.detach().cpu(), theta)


def test_mfu_is_reported_for_a_known_gpu(data: DataConfig) -> None:
    name = torch.cuda.get_device_name(0)
    if known_peak_flops(name) is None:
        pytest.skip(f"{name} is not in the table of peaks (GPU-only test; CI has no GPU)")
    trainer = InnerTrainer(ModelConfig("tiny"), data, CFG, seed=0, peer_key="gpu")
    stats = trainer.train_steps(5)
    value = trainer.mfu(stats.tokens / stats.seconds)
    assert value is not None and 0 < value < 1


def test_compile_on_cuda(data: DataConfig) -> None:
    trainer = InnerTrainer(ModelConfig("tiny"), data, replace(CFG, compile=True), seed=0, peer_key="gpu")
    assert math.isfinite(trainer.train_steps(3).mean_loss)


def test_1b_fits_one_80gb_gpu(data: DataConfig) -> None:
    """configs/1b.toml as shipped: the model, its AdamW moments and activations on one GPU, θ_global
    (fp32, 4 GB) pinned on the host."""
    total = torch.cuda.get_device_properties(0).total_memory
    if total < 79e9:
        pytest.skip(f"the GPU has {total / 1e9:.0f} GB (GPU-only test; CI has no GPU)")
    cfg = replace(load_config(REPO / "configs" / "1b.toml").trainer, device="cuda")
    trainer = InnerTrainer(ModelConfig("1b"), data, cfg, seed=0, peer_key="gpu")
    assert trainer.model.activation_checkpointing  # auto: on for 1b on CUDA
    outer = OuterOptimizer(trainer.working_params_fp32(), OuterConfig())
    outer.pin_memory()
    torch.cuda.reset_peak_memory_stats()
    stats = trainer.train_steps(2)
    assert math.isfinite(stats.mean_loss)
    peak = torch.cuda.max_memory_reserved()
    assert peak < 80e9, f"1b needs {peak / 1e9:.1f} GB on the GPU"


def test_two_gpus_stay_identical(data: DataConfig) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (GPU-only test; CI has no GPU)")
    trainer = InnerTrainer(ModelConfig("tiny"), data, replace(CFG, devices=2), seed=0, peer_key="gpu")
    group = LocalGroup(trainer)
    group.start()
    try:
        for _ in range(3):
            trainer.train_steps(1)
            assert len(set(group.digests())) == 1
        assert trainer.tokens_per_step == 2 * CFG.batch_size * CFG.seq_len
    finally:
        group.stop()
