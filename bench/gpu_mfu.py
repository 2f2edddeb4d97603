"""Tokens/s and MFU of the presets on one CUDA device (bf16 autocast), with and without torch.compile.

    python3 bench/gpu_mfu.py [--out FILE.json] [--steps 10]

Part of bench/gpu_check.sh. Each row: a fresh InnerTrainer on a byte corpus, 3 warm-up inner steps, then
`--steps` timed ones; MFU = tokens/s × the model's FLOPs per token ÷ the device's dense bf16 peak
(dilocod/trainer/flops.py). Prints a markdown table; `--out` also writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from dilocod.trainer import DataConfig, InnerTrainer, ModelConfig, TrainerConfig  # noqa: E402
from dilocod.trainer.model import count_params  # noqa: E402

# (preset, batch, seq_len, compile) rows; 1b only without compile (its compile alone takes minutes)
ROWS = [
    ("small", 16, 1024, False), ("small", 16, 1024, True),
    ("124m", 16, 1024, False), ("124m", 16, 1024, True),
    ("1b", 8, 2048, False),
]  # fmt: skip


@dataclass
class Row:
    preset: str
    params: int
    batch: int
    seq_len: int
    compile: bool
    tokens_per_second: float
    mfu: float | None
    peak_gib: float
    seconds_to_first_step: float


def measure(data: DataConfig, preset: str, batch: int, seq: int, compiled: bool, steps: int) -> Row:
    cfg = TrainerConfig(batch_size=batch, seq_len=seq, warmup_steps=2, device="cuda", compile=compiled,
                        optimizer="adamw")  # fmt: skip
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    trainer = InnerTrainer(ModelConfig(preset), data, cfg, seed=0, peer_key="gpu")
    trainer.train_steps(3)  # warm-up (and compile)
    torch.cuda.synchronize()
    first = time.perf_counter() - started
    stats = trainer.train_steps(steps)
    rate = stats.tokens / stats.seconds
    row = Row(preset, count_params(trainer.model), batch, seq, compiled, rate, trainer.mfu(rate),
              torch.cuda.max_memory_reserved() / 2**30, first)  # fmt: skip
    del trainer
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_mfu: no CUDA device; nothing measured")
        return
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 200_000)
        data = DataConfig(source=str(corpus))
        print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
        print("| preset | params | batch × seq | compile | tokens/s | MFU | peak GiB | s to first step |")
        print("|---|---|---|---|---|---|---|---|")
        rows = []
        for preset, batch, seq, compiled in ROWS:
            try:
                row = measure(data, preset, batch, seq, compiled, args.steps)
            except Exception as e:  # one row's failure (memory, compile) must not lose the others
                print(
                    f"| {preset} | | {batch} × {seq} | {compiled} | failed: {str(e).splitlines()[0][:120]} |"
                )
                continue
            rows.append(row)
            mfu = "n/a" if row.mfu is None else f"{row.mfu:.3f}"
            print(f"| {row.preset} | {row.params / 1e6:.1f} M | {batch} × {seq} | {compiled} | "
                  f"{row.tokens_per_second:,.0f} | {mfu} | {row.peak_gib:.1f} | {row.seconds_to_first_step:.1f} |")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
