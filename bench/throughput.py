"""Throughput of one peer vs a bare torch loop on the same model and batch, and of each preset.

    .venv/bin/python bench/throughput.py [--steps 60] [--presets tiny,small,124m] [--peer | --peer-only]
                                         [--peer-seconds 40] [--muon-only]

The trainer is compared with the bare loop on AdamW (what the bare loop runs); then the trainer with Muon
(`trainer.optimizer = muon`, the tiny config's default) and with AdamW alternate, for the cost of Muon's step
(`--muon-only`: that comparison alone). The first line names the CPU and its bf16 features: Muon's cost
depends on them (`dilocod/trainer/precision.py`). `ONEDNN_MAX_CPU_ISA=AVX2` in the environment makes a CPU
with native bf16 compute it as one without does.

Measured side by side in one run (this machine is noisy): the bare loop and the daemon's trainer
alternate, several times, and the ratio is taken per pair. With `--peer`, a real `dilocod join`
process (alone, no bootstrap, on AdamW like the bare loop) runs too: its trained tokens per wall-clock
second, inside one long round and over whole rounds with delayed overlap, against bare loops run right
before and after it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dilocod.trainer import DataConfig, InnerTrainer, ModelConfig, TrainerConfig, build_model, count_params
from dilocod.trainer.batches import ShardSampler, load_corpus


def bare_loop(preset: str, batch: int, seq: int, steps: int) -> float:
    """tokens/s of the plainest loop: model, AdamW, random windows of the same corpus; nothing else."""
    model = build_model(ModelConfig(preset), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)  # as the trainer
    corpus = load_corpus(DataConfig())
    sampler = ShardSampler(
        corpus.train, seed=0, peer_key="bench", num_shards=16, batch_size=batch, seq_len=seq
    )
    x, y = sampler.batch(0)
    for _ in range(3):  # warm-up
        _step(model, opt, x, y)
    started = time.perf_counter()
    for i in range(steps):
        x, y = sampler.batch(i)
        _step(model, opt, x, y)
    return steps * batch * seq / (time.perf_counter() - started)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    logits = model(x)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def trainer_loop(preset: str, batch: int, seq: int, steps: int, optimizer: str = "adamw") -> float:
    cfg = TrainerConfig(batch_size=batch, seq_len=seq, inner_steps=steps, warmup_steps=1, optimizer=optimizer)
    trainer = InnerTrainer(ModelConfig(preset), DataConfig(), cfg, seed=0, peer_key="bench")
    trainer.train_steps(3)
    stats = trainer.train_steps(steps)
    return stats.tokens / stats.seconds


PEER_FLAGS = (  # a lone peer: no one to wait for in matchmaking
    "--set", "averaging.matchmaking_timeout=3", "--set", "averaging.min_matchmaking_time=1",
    "--set", "trainer.optimizer=adamw",  # what the bare loop runs (Muon's step costs ~1.16× AdamW's)
)  # fmt: skip
# What a lone peer is timed in: inside one long round (no round in the window: only the daemon's
# processes beside training), and over whole rounds of H = 50 with delayed overlap (matchmaking,
# averaging, the outer step and eval too).
PEER_CASES = {
    "between rounds": ("--set", "trainer.inner_steps=1000000"),
    "whole rounds, delayed overlap": ("--set", "trainer.inner_steps=50", "--set", "outer.overlap=delayed"),
}


def _status(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=5) as r:
        return dict(json.loads(r.read()))


def peer_tokens_per_second(flags: tuple[str, ...], warmup: float, seconds: float) -> float:
    """A lone `dilocod join`'s trained tokens per wall-clock second over `seconds`, after `warmup` s of
    training (from its `tokens_trained`: eval, rounds and every process of the peer count)."""
    port = 18777
    with tempfile.TemporaryDirectory() as run_dir:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dilocod", "join", "--config", "configs/tiny.toml", "--run-dir", run_dir,
             "--host", "127.0.0.1", "--http-port", str(port), *PEER_FLAGS, *flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while True:  # until it trains
                time.sleep(1)
                try:
                    if _status(port)["tokens_trained"] > 0:
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the peer did not start training")
            time.sleep(warmup)
            first, began = _status(port)["tokens_trained"], time.monotonic()
            time.sleep(seconds)
            last, ended = _status(port)["tokens_trained"], time.monotonic()
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return (last - first) / (ended - began)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--presets", default="tiny,small,124m")
    parser.add_argument("--peer", action="store_true")
    parser.add_argument("--peer-seconds", type=float, default=40, help="how long a peer is timed")
    parser.add_argument("--peer-only", action="store_true", help="only the peer's rows")
    parser.add_argument("--muon-only", action="store_true", help="only Muon against AdamW")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {cpu_line()}")

    if args.muon_only:
        compare_muon(args.repeats, args.steps)
        return
    if not args.peer_only:
        compare_trainer(args.repeats, args.steps)
        compare_muon(args.repeats, args.steps)
    if args.peer or args.peer_only:
        compare_peer(args.repeats, args.steps, args.peer_seconds)
    if not args.peer_only:
        presets(args.presets, args.steps)


def compare_trainer(repeats: int, steps: int) -> None:
    ratios, bare, ours = [], [], []
    for _ in range(repeats):
        b = bare_loop("tiny", 16, 128, steps)
        t = trainer_loop("tiny", 16, 128, steps)
        bare.append(b)
        ours.append(t)
        ratios.append(t / b)
    print(
        f"tiny, batch 16×128: bare loop {statistics.median(bare):,.0f} tok/s, dilocod trainer "
        f"{statistics.median(ours):,.0f} tok/s, ratio {statistics.median(ratios):.3f} "
        f"(pairs: {', '.join(f'{r:.3f}' for r in ratios)})"
    )


def cpu_line() -> str:
    """The CPU's model, its bf16 features, what oneDNN may use and the dtype Muon orthogonalises in."""
    from dilocod.trainer.precision import bf16_is_fast

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next(
        (line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?"
    )
    flags = next(
        (line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []
    )
    bf16 = [f for f in ("avx512_bf16", "amx_bf16", "avx512f", "avx2") if f in flags]
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or "all"
    ns = "bf16" if bf16_is_fast("cpu") else "fp32"
    return f"CPU {model} ({', '.join(bf16) or 'no AVX'}), oneDNN ISA {isa}: Muon orthogonalises in {ns}"


def compare_muon(repeats: int, steps: int) -> None:
    muon, adamw = [], []
    for _ in range(repeats):
        muon.append(trainer_loop("tiny", 16, 128, steps, "muon"))
        adamw.append(trainer_loop("tiny", 16, 128, steps, "adamw"))
    pairs = [a / m for m, a in zip(muon, adamw, strict=True)]
    print(
        f"tiny, batch 16×128: trainer with Muon {statistics.median(muon):,.0f} tok/s, with AdamW "
        f"{statistics.median(adamw):,.0f} tok/s: Muon's step takes {statistics.median(pairs):.3f}× AdamW's "
        f"(pairs: {', '.join(f'{r:.3f}' for r in pairs)})"
    )


def compare_peer(repeats: int, steps: int, seconds: float) -> None:
    """A lone peer's tokens/s in each of PEER_CASES against bare loops run right before and after it."""
    for _ in range(repeats):
        for case, flags in PEER_CASES.items():
            before = bare_loop("tiny", 16, 128, steps)
            peer = peer_tokens_per_second(flags, warmup=10, seconds=seconds)
            after = bare_loop("tiny", 16, 128, steps)
            print(
                f"lone `dilocod join` peer, {case}: {peer:,.0f} tok/s vs bare loop {before:,.0f}/{after:,.0f} "
                f"(ratio {peer / ((before + after) / 2):.3f})",
                flush=True,
            )


def presets(names: str, steps_arg: int) -> None:
    print("\npreset  params        batch×seq  tokens/s (CPU train step)")
    for preset in names.split(","):
        params = count_params(build_model(ModelConfig(preset), seed=0))
        batch, seq = (16, 128) if preset == "tiny" else (4, 128)
        steps = max(2, steps_arg // (1 if preset == "tiny" else 10 if preset == "small" else 30))
        tps = trainer_loop(preset, batch, seq, steps)
        print(f"{preset:7s} {params:>13,}  {batch}×{seq:<6d}  {tps:,.0f}")


if __name__ == "__main__":
    main()
