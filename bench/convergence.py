"""DiLoCo variants against a data-parallel baseline: eval loss, bytes per token, compute utilization.

    .venv/bin/python bench/convergence.py [--peers 4] [--steps 200] [--only dp,h10,...]

Every variant trains the tiny preset on the built-in corpus with `--peers` real peers on loopback
(tests/harness.py), each peer taking `--steps` inner steps of the same batch: the same total tokens
for all. A variant is a set of config overrides; the data-parallel baseline is the same code path with
H = 1 and a plain-average outer step (outer lr 1, momentum 0): every step's update is averaged.
(Each peer keeps its own AdamW moments, so it averages updates rather than gradients: close to, not
exactly, synchronous data parallel.)

Per variant: the eval loss of θ_global after the last outer step (mean over the peers that evaluated
it), bytes sent by all peers ÷ tokens trained by all peers, and the peers' mean compute utilization
(time in inner steps ÷ wall time). Ratios are to the baseline measured in the same invocation.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.harness import FAST, Swarm  # noqa: E402

BATCH, SEQ = 8, 64  # tests.harness.FAST
# Four peers and a bootstrap share this machine's 2 cores, so peers reach a round up to a second or two
# apart; the test harness's quick matchmaking (1.5 s) then splits them into groups of 2 that re-sync
# each other, and the table would measure the machine. A wider window keeps groups whole (a full group
# begins at once, so rounds of peers in step cost nothing more).
TOLERANT = ("averaging.min_matchmaking_time=3", "averaging.request_timeout=1.5")
VARIANTS: dict[str, tuple[str, ...]] = {
    "dp": ("trainer.inner_steps=1", "outer.lr=1.0", "outer.momentum=0.0"),
    "h10": ("trainer.inner_steps=10",),
    "h50": ("trainer.inner_steps=50",),
    "h100": ("trainer.inner_steps=100",),
    "h10-fp16": ("trainer.inner_steps=10", "averaging.compression=fp16"),
    "h10-int8": ("trainer.inner_steps=10", "averaging.compression=int8"),
    "h10-int4": ("trainer.inner_steps=10", "averaging.compression=int4"),
    "h10-int2": ("trainer.inner_steps=10", "averaging.compression=int2"),
    "h100-int2": ("trainer.inner_steps=100", "averaging.compression=int2"),
    "h150-int2": ("trainer.inner_steps=150", "averaging.compression=int2"),
    "h100-muon-int2": ("trainer.inner_steps=100", "trainer.optimizer=muon", "averaging.compression=int2"),
    # re-syncing without keeping the unsent progress (the behaviour before outer.rebase_on_resync)
    "h100-norebase": ("trainer.inner_steps=100", "outer.rebase_on_resync=false"),
    "h10-delayed": ("trainer.inner_steps=10", "outer.overlap=delayed"),
    # Streaming DiLoCo: 2 fragments, each synced once per 10 steps, one every 5 steps
    "h10-streaming": ("trainer.inner_steps=10", "outer.overlap=streaming", "outer.fragments=2"),
    "h10-muon": ("trainer.inner_steps=10", "trainer.optimizer=muon"),
    "h10-muon-int2": ("trainer.inner_steps=10", "trainer.optimizer=muon", "averaging.compression=int2"),
    # tuning the outer step and the inner warmup (the defaults: outer.lr 0.7, harness warmup 5 steps)
    "h50-olr0.4": ("trainer.inner_steps=50", "outer.lr=0.4"),
    "h50-olr1.0": ("trainer.inner_steps=50", "outer.lr=1.0"),
    "h50-warmup50": ("trainer.inner_steps=50", "trainer.warmup_steps=50"),
    "h50-fedavg": ("trainer.inner_steps=50", "outer.lr=1.0", "outer.momentum=0.0"),
}


def setting(overrides: tuple[str, ...], key: str, default: str) -> str:
    return next((o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")), default)


def outer_rounds(overrides: tuple[str, ...], steps: int) -> int:
    """Outer steps in `steps` inner steps: one per H, or one per H / fragments with streaming."""
    every = int(setting(overrides, "trainer.inner_steps", "0"))
    if setting(overrides, "outer.overlap", "none") == "streaming":
        every //= int(setting(overrides, "outer.fragments", "4"))
    return steps // every


def run_variant(root: Path, peers: int, steps: int, overrides: tuple[str, ...]) -> dict[str, float]:
    rounds = outer_rounds(overrides, steps)
    settings = (*FAST, *TOLERANT, f"averaging.group_size={peers}", "trainer.eval_batches=8", *overrides)
    s = Swarm(root, overrides=settings)
    try:
        s.start_bootstrap()
        for _ in range(peers):
            s.add_peer()
        statuses = s.wait_all_at(rounds, timeout=120 + 10 * rounds)
    finally:
        s.close()
    return summarize(statuses, rounds)


def summarize(statuses: list[dict[str, Any]], rounds: int) -> dict[str, float]:
    # Per peer, the eval of θ_global at the last outer step it evaluated up to `rounds` (a peer that got
    # there by re-syncing has no eval at exactly that step).
    evals = []
    for st in statuses:
        done = [e for e in st["rounds"] if e["outer_step"] <= rounds and e["eval_loss"] is not None]
        if done:
            evals.append(max(done, key=lambda e: e["outer_step"])["eval_loss"])
    tokens = sum(st["inner_step"] for st in statuses) * BATCH * SEQ
    return {
        "eval": statistics.fmean(evals) if evals else float("nan"),
        "bytes_per_token": sum(st["bytes_sent"] for st in statuses) / max(tokens, 1),
        "utilization": statistics.fmean(st["compute_utilization"] for st in statuses),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200, help="inner steps per peer (same tokens for all)")
    parser.add_argument("--only", default=",".join(VARIANTS), help="variants to run; dp always runs")
    parser.add_argument("--keep", type=Path, help="keep every variant's logs and run directories here")
    args = parser.parse_args()
    names = ["dp", *[n for n in args.only.split(",") if n != "dp"]]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s): {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    print(f"{args.peers} peers, {args.steps} inner steps each of {BATCH}×{SEQ} tokens, tiny preset")
    print("| variant | eval loss | ÷ dp | bytes sent per token | dp ÷ this | compute utilization |")
    print("|---|---|---|---|---|---|", flush=True)
    base: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        for name in names:
            try:
                result = run_variant(root / name, args.peers, args.steps, VARIANTS[name])
            except Exception as e:  # one variant that does not finish must not hide the others' figures
                print(f"| {name} | did not finish: {str(e).splitlines()[0][:100]} | | | | |", flush=True)
                if not base:
                    raise
                continue
            base = base or result
            print(
                f"| {name} | {result['eval']:.4f} | {result['eval'] / base['eval']:.3f} "
                f"| {result['bytes_per_token']:.1f} | {base['bytes_per_token'] / result['bytes_per_token']:.0f}× "
                f"| {result['utilization']:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
