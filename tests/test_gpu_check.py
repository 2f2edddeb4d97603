"""bench/gpu_check.sh on a machine without a GPU (CI's): it says why it skips the CUDA checks and exits 0,
so the same command can be run anywhere; on a GPU machine it runs them (docs/benchmarks.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="on a GPU machine the script runs the CUDA checks instead; CI has no GPU, so CI runs this test",
)
def test_without_a_gpu_the_check_says_so_and_exits_0(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(REPO / "bench/gpu_check.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no CUDA device here: the CUDA checks are skipped" in done.stdout
    assert not done.stderr.strip()


def test_a_python_without_torch_is_named_not_a_traceback(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": "python3 -S"}  # -S: no site-packages, no torch
    done = subprocess.run(
        ["bash", str(REPO / "bench/gpu_check.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "has no torch" in done.stdout, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
