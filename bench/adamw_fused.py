"""A plain training step with the default (`foreach`) AdamW against the fused one, on CPU.

    .venv/bin/python bench/adamw_fused.py [--preset small] [--batch 1] [--seq 64] [--steps 10] [--repeats 2]

The trainer uses `fused=True` on CPU as on CUDA (dilocod/trainer/inner.py). A step here is the trainer's
work without the daemon: forward, backward, grad clipping, the optimizer step. The two kinds alternate,
each on a fresh model of the same seed, and each reports the median of its steps after two warm-up steps.
The optimizer's share of a step, and so the gain, is largest for small batches.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dilocod.trainer import ModelConfig  # noqa: E402
from dilocod.trainer.lm import build_lm  # noqa: E402


def median_step_seconds(preset: str, fused: bool, batch: int, seq: int, steps: int) -> float:
    model = build_lm(ModelConfig(preset), 0)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, fused=fused)
    windows = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    x, y = windows[:, :-1], windows[:, 1:]
    times = []
    for i in range(steps + 2):
        started = time.perf_counter()
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.preset}, batch {args.batch}×{args.seq}"
    )
    for _ in range(args.repeats):
        foreach = median_step_seconds(args.preset, False, args.batch, args.seq, args.steps)
        fused = median_step_seconds(args.preset, True, args.batch, args.seq, args.steps)
        print(
            f"  step: foreach {foreach * 1e3:.0f} ms, fused {fused * 1e3:.0f} ms (fused ÷ foreach {fused / foreach:.2f})"
        )


if __name__ == "__main__":
    main()
