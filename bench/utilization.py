"""Compute utilization of each overlap mode on a slow link, side by side in one run.

    .venv/bin/python bench/utilization.py [--rate 100] [--delay-ms 25] [--peers 2] [--rounds 6] \
        [--modes none,delayed,streaming] [--set section.key=value ...]

Needs root (network namespaces: tests/netbed.py, docs/testbed.md). For each `outer.overlap` mode, a
fresh test bed: the public bootstrap (which reduces) in `pub` and `--peers` peers, each behind its own
NAT on a link of `--rate` Mbit/s both ways with `--delay-ms` each way at its router (so the RTT to the
bootstrap is twice that: 25 ms gives the 50 ms of the issue's slow link). Every daemon is the real
CLI (tests/wanrun.py). Tiny preset, the test harness's fast settings, H = 20 unless `--set` says
otherwise. Per mode: the peers' mean `compute_utilization` (time in inner steps ÷ wall time since the
first inner step, from `/api/status`) once every peer has passed `--rounds` rounds of H inner steps
(with `streaming`, one outer step per fragment: `--rounds` × `outer.fragments` outer steps), and the
mean round time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dilocod.config import load_config  # noqa: E402
from tests.netbed import NetBed, cleanup_stale, require_netns  # noqa: E402
from tests.wanrun import NAT_PEER, make_net_swarm  # noqa: E402

MODES = ("none", "delayed", "streaming")
DEFAULTS = ("trainer.inner_steps=20", "trainer.warmup_steps=20")


def run_mode(mode: str, args: argparse.Namespace, root: Path) -> dict[str, float]:
    with NetBed() as bed:
        hosts = [f"nat{chr(ord('A') + k)}" for k in range(args.peers)]
        for host in hosts:
            bed.add_nat(host, rate_mbit=args.rate, delay_ms=args.delay_ms)
        s = make_net_swarm(bed, root / mode, *DEFAULTS, f"outer.overlap={mode}", *args.overrides)
        try:
            s.start_bootstrap()
            for host in hosts:
                s.add_peer(*NAT_PEER, where=host)
            statuses = s.wait_all_at(args.rounds * _syncs_per_round(mode, args.overrides), args.timeout)
        finally:
            s.close()
        bed.check()
    rounds = [e for st in statuses for e in st["rounds"] if e["result"] == "ok"]
    return {
        "utilization": statistics.fmean(st["compute_utilization"] for st in statuses),
        "round_seconds": statistics.fmean(e["seconds"] for e in rounds) if rounds else float("nan"),
        "ok_rounds": float(len(rounds)) / len(statuses),
    }


def _syncs_per_round(mode: str, overrides: list[str]) -> int:
    """Outer steps per H inner steps: 1, or one per fragment with streaming."""
    if mode != "streaming":
        return 1
    cfg = load_config(None, [*DEFAULTS, "outer.overlap=streaming", *overrides])
    return cfg.outer.fragments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=100.0, help="Mbit/s each way on every peer's link")
    parser.add_argument("--delay-ms", type=float, default=25.0, help="one-way delay at every peer's router")
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6, help="rounds of H inner steps every peer must pass")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mode")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if any(mode not in MODES for mode in modes):
        parser.error(f"--modes: choose from {', '.join(MODES)}")
    require_netns()
    cleanup_stale()
    print(
        f"{args.peers} NATed peers + reducing bootstrap, {args.rate:g} Mbit/s, "
        f"{2 * args.delay_ms:g} ms RTT, tiny preset, {' '.join([*DEFAULTS, *args.overrides])}"
    )
    print("| outer.overlap | compute utilization | mean round (s) | ok rounds per peer |")
    print("|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            try:
                r = run_mode(mode, args, Path(tmp))
            except Exception as e:  # one mode failing must not hide the others' figures
                print(f"| {mode} | failed: {str(e).splitlines()[0][:120]} | | |", flush=True)
                continue
            print(
                f"| {mode} | {r['utilization']:.3f} | {r['round_seconds']:.2f} | {r['ok_rounds']:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
