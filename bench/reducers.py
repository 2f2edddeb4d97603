"""Cost of each reducer on a whole pseudo-gradient of a preset: seconds per round and peak memory vs mean.

    .venv/bin/python bench/reducers.py [--preset small] [--senders 4,8] [--repeats 3]

A round's reduction work, summed over the group, is: every part of Δ (|Δ| = the preset's parameter
count), with one copy per sender, screened and reduced by `make_part_reduce` (what the all-reduce
runs), in hivemind's default parts of 2¹⁹ bytes. In a butterfly each of n members reduces 1/n of it,
so one member's share of the time is the total ÷ n. The senders' copies are honest-looking noise
(each sender = a common direction + its own noise), so CenteredClip iterates as it would on real
pseudo-gradients rather than stopping at once.

Time: every reducer runs on the same inputs, alternating, `--repeats` times; the table gives the median
and its ratio to `mean` from the same run. Memory: each reducer runs once more in a fresh process, and
the extra peak resident memory over the inputs is compared with mean's (VmHWM, reset once the inputs
exist, so the figure
includes the reducer's temporary buffers for one part at a time, which is what a reducer holds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dilocod.aggregation.partrules import make_part_reduce  # noqa: E402
from dilocod.config import AveragingConfig  # noqa: E402
from dilocod.trainer import ModelConfig, build_model, count_params  # noqa: E402

REDUCERS = ["mean", "trimmed_mean", "median", "centered_clip"]
PART_FLOATS = 2**19 // 4  # hivemind's DEFAULT_PART_SIZE_BYTES, in float32 values


def senders_copies(size: int, senders: int, seed: int = 0) -> torch.Tensor:
    """[senders, size]: a shared direction plus each sender's own noise, like real pseudo-gradients."""
    # filled in place, part by part, so that making the inputs leaves no peak above their own size
    g = torch.Generator().manual_seed(seed)
    stacked = torch.empty(senders, size).normal_(std=1e-3, generator=g)
    for begin in range(0, size, PART_FLOATS):
        part = stacked[:, begin : begin + PART_FLOATS]
        part += torch.randn(part.shape[1], generator=g) * 1e-3
    return stacked


def reduce_all(stacked: torch.Tensor, reducer: str) -> float:
    """Seconds to screen and reduce every part of `stacked` with `reducer`."""
    cfg = AveragingConfig(reducer=reducer)
    reduce_part = make_part_reduce(cfg.reducer_settings(), cfg.screening_settings())
    weights = torch.ones(stacked.shape[0])
    start = time.perf_counter()
    for begin in range(0, stacked.shape[1], PART_FLOATS):
        reduce_part(stacked[:, begin : begin + PART_FLOATS].contiguous(), weights)
    return time.perf_counter() - start


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: resets VmHWM to the current RSS


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # KiB
    raise RuntimeError("no VmHWM in /proc/self/status")


def memory_child(size: int, senders: int, reducer: str) -> None:
    """Run in a fresh process: print the peak RSS growth caused by the reduction (MiB)."""
    torch.set_num_threads(1)
    stacked = senders_copies(size, senders)
    reset_peak_rss()
    before = peak_rss_mib()
    reduce_all(stacked, reducer)
    print(json.dumps({"extra_mib": peak_rss_mib() - before}))


def extra_memory(size: int, senders: int, reducer: str) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--child", reducer, "--size", str(size), "--senders", str(senders)],
        check=True,
        capture_output=True,
        text=True,
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1])["extra_mib"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    parser.add_argument("--senders", default="4,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child")
    parser.add_argument("--size", type=int)
    args = parser.parse_args()
    if args.child:
        memory_child(args.size, int(args.senders), args.child)
        return
    torch.set_num_threads(1)  # a reducer runs in the averager's event loop: one core
    size = count_params(build_model(ModelConfig(args.preset), seed=0))
    print(f"preset {args.preset}: |Δ| = {size:,} values; one thread; median of {args.repeats}")
    print(
        "| senders | reducer | s per round (whole group) | ÷ mean | s per member | extra peak MiB | ÷ mean |"
    )
    print("|---|---|---|---|---|---|---|")
    for senders in (int(n) for n in args.senders.split(",")):
        stacked = senders_copies(size, senders)
        times: dict[str, list[float]] = {r: [] for r in REDUCERS}
        for _ in range(args.repeats):
            for reducer in REDUCERS:
                times[reducer].append(reduce_all(stacked, reducer))
        del stacked
        memory = {r: extra_memory(size, senders, r) for r in REDUCERS}
        base_t = statistics.median(times["mean"])
        for reducer in REDUCERS:
            t = statistics.median(times[reducer])
            ratio_m = memory[reducer] / memory["mean"] if memory["mean"] > 0 else float("nan")
            print(
                f"| {senders} | {reducer} | {t:.2f} | {t / base_t:.2f} | {t / senders:.2f} "
                f"| {memory[reducer]:.0f} | {ratio_m:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
