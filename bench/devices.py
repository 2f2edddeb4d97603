"""tokens/s of one peer's trainer on 1 vs 2 local devices, side by side (on CPU: 2 gloo ranks).

    .venv/bin/python bench/devices.py [--steps 40] [--repeats 3] [--batch 16] [--seq 128]

The configurations alternate within each repeat (this machine is noisy) and the median is reported.
Each configuration gets the whole machine: `--devices 1` runs with every core as torch threads,
`--devices 2` with half the cores per rank (what `trainer.threads = 0` does), plus `--devices 1` on
half the cores, which shows the per-rank speed the 2-rank figure would double with perfect scaling.
What is measured is `InnerTrainer.train_steps` with a `LocalGroup`, i.e. what the daemon's trainer
thread runs; rank 1 is a real worker process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dilocod.trainer import DataConfig, InnerTrainer, LocalGroup, ModelConfig, TrainerConfig


def tokens_per_second(devices: int, threads: int, steps: int, batch: int, seq: int) -> float:
    cfg = TrainerConfig(
        batch_size=batch, seq_len=seq, warmup_steps=1, device="cpu", devices=devices, threads=threads
    )
    trainer = InnerTrainer(ModelConfig("tiny"), DataConfig(), cfg, seed=0, peer_key="bench")
    group = LocalGroup(trainer) if devices > 1 else None
    if group is not None:
        group.start()
    try:
        trainer.train_steps(3)  # warm-up: first-step allocations, DDP's bucket rebuild
        stats = trainer.train_steps(steps)
        return stats.tokens / stats.seconds
    finally:
        if group is not None:
            group.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="sequences per step and rank")
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    half = max(1, cores // 2)
    configs = {
        f"--devices 1 ({cores} threads)": (1, cores),
        f"--devices 2 ({half} thread(s) per rank)": (2, half),
        f"--devices 1 ({half} thread(s))": (1, half),
    }
    print(
        f"torch {torch.__version__}, {cores} cores, tiny preset, {args.batch}×{args.seq} tokens per rank and step"
    )
    results: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.repeats):
        for name, (devices, threads) in configs.items():
            results[name].append(tokens_per_second(devices, threads, args.steps, args.batch, args.seq))
    base = statistics.median(results[next(iter(configs))])
    for name, values in results.items():
        median = statistics.median(values)
        runs = ", ".join(f"{v:,.0f}" for v in values)
        print(f"{name:38s} {median:>10,.0f} tok/s  ×{median / base:.2f}  (runs: {runs})")


if __name__ == "__main__":
    main()
