"""Muon's orthogonalisation dtype follows what the machine computes fast, and batching changes no update.

On a CPU without native bf16 (AVX2 only, or AVX-512 without BF16) every bf16 product is emulated, ~100×
slower than fp32's: there Muon must orthogonalise in fp32 (`dilocod/trainer/precision.py`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
import torch

from dilocod.trainer import precision
from dilocod.trainer.muon import Muon, orthogonalise
from dilocod.trainer.optim import MuonWithAdamW
from tests.test_trainer_inner import CFG, make_trainer

NS = ((3.4445, -4.7750, 2.0315), 5, 1e-7)


@pytest.mark.parametrize(
    ("bf16_ms", "fp32_ms", "bf16"),
    [
        (119.0, 0.81, False),  # AVX2 only: bf16 emulated (oneDNN limited to AVX2 on an AMX Xeon)
        (3.3, 0.81, False),  # AVX-512 without its BF16 extension
        (0.21, 1.0, True),  # AMX
        (0.5, 0.5, True),  # as fast: bf16 (it halves the iterations' memory)
    ],
)
def test_bf16_only_where_it_is_no_slower(bf16_ms: float, fp32_ms: float, bf16: bool) -> None:
    assert precision.prefers_bf16(bf16_ms / 1e3, fp32_ms / 1e3) is bf16


@pytest.fixture
def probe_says() -> Iterator[Callable[[float, float], None]]:
    """Set what the CPU probe measures: `probe_says(bf16_seconds, fp32_seconds)`."""
    real = precision.probe_matmul_seconds

    def set_probe(bf16_seconds: float, fp32_seconds: float) -> None:
        precision.bf16_is_fast.cache_clear()
        precision.probe_matmul_seconds = lambda: (bf16_seconds, fp32_seconds)

    yield set_probe
    precision.probe_matmul_seconds = real
    precision.bf16_is_fast.cache_clear()


def muon_of(trainer: object) -> Muon:
    optimizer = trainer.optimizer  # type: ignore[attr-defined]
    assert isinstance(optimizer, MuonWithAdamW)
    muon = optimizer.parts["muon"]
    assert isinstance(muon, Muon)
    return muon


def test_a_cpu_without_fast_bf16_orthogonalises_in_fp32(probe_says: Callable[[float, float], None]) -> None:
    probe_says(0.119, 0.0008)
    assert muon_of(make_trainer(replace(CFG, optimizer="muon"))).ns_dtype == torch.float32
    probe_says(0.0002, 0.001)
    assert muon_of(make_trainer(replace(CFG, optimizer="muon"))).ns_dtype == torch.bfloat16


def test_cuda_keeps_bf16_without_a_probe(probe_says: Callable[[float, float], None]) -> None:
    def no_probe() -> tuple[float, float]:
        raise AssertionError("CUDA needs no probe")

    precision.bf16_is_fast.cache_clear()
    precision.probe_matmul_seconds = no_probe
    assert precision.low_precision_dtype(torch.device("cuda")) == torch.bfloat16


def test_the_probe_finds_emulated_bf16_slow() -> None:
    """With oneDNN limited to AVX2 (what a CPU without bf16 has), the real probe picks fp32."""
    code = "from dilocod.trainer import precision; print(precision.bf16_is_fast('cpu'))"
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def _matrices() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(32, 32), (32, 32), (96, 32), (32, 96), (96, 32), (48, 16)]
    return [torch.randn(*shape, generator=g) for shape in shapes]


def test_batched_orthogonalisation_gives_each_matrix_its_own() -> None:
    matrices = _matrices()
    together = orthogonalise(matrices, *NS, torch.float32)
    for matrix, ortho in zip(matrices, together, strict=True):
        (alone,) = orthogonalise([matrix], *NS, torch.float32)
        assert ortho.shape == matrix.shape
        torch.testing.assert_close(ortho, alone, rtol=1e-5, atol=1e-5)
    # What Newton–Schulz is for: singular values near 1 (the quintic leaves them in ~[0.5, 1.5]).
    for ortho in together:
        singular = torch.linalg.svdvals(ortho)
        assert singular.min() > 0.3 and singular.max() < 1.6


def _train(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_our_muon_takes_torchs_steps(dtype: torch.dtype) -> None:
    """Same update rule and state as torch.optim.Muon: in bf16 up to bf16's rounding, in fp32 closer."""
    ours = [torch.nn.Parameter(m.clone()) for m in _matrices()]
    theirs = [torch.nn.Parameter(m.clone()) for m in _matrices()]
    options = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
    mine, reference = Muon(ours, ns_dtype=dtype, **options), torch.optim.Muon(theirs, **options)
    _train(mine, ours, 3)
    _train(reference, theirs, 3)
    for a, b, start in zip(ours, theirs, _matrices(), strict=True):
        moved = (b - start).norm()
        assert (a - b).norm() < 0.05 * moved  # bf16 rounding of the iterations, not another rule
    # The state is torch's: a checkpoint of one loads into the other.
    reloaded = torch.optim.Muon([torch.nn.Parameter(m.clone()) for m in _matrices()], **options)
    reloaded.load_state_dict(mine.state_dict())
    assert set(reloaded.state_dict()["state"][0]) == {"momentum_buffer"}
