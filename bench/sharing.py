"""Peers sharing one machine: each peer's tokens/s against the bare loop's ÷ the number of peers.

    .venv/bin/python bench/sharing.py [--peers 2,3,4] [--modes none,delayed,streaming]
                                      [--reach public,private] [--seconds 40] [--repo DIR] [--set k=v ...]

For every combination: a bootstrap and N peers on loopback started as a user would start them on one
machine (`configs/tiny.toml` as it is, so H = 20 and batch 16 × 128; no `trainer.threads`), `outer.overlap`
= the mode, and with `private` every peer in client mode (`net.reachability = private`: it averages
through the reducing bootstrap). The peers train AdamW, what the bare loop runs (`bench/throughput.py`).
Once every peer has completed a round and 10 s more, each peer's `tokens_trained` is read over
`--seconds`; a bare torch loop alone (the tiny model, AdamW, the same batch) runs right before and after
the swarm. The ratio is a peer's tokens/s ÷ (the bare loop's ÷ N): 1 is the peer's whole share of the
machine. Also per case: the seconds from starting the peers to every peer's first completed round, the
peers' compute utilization, rounds in the window, and the mean seconds of each phase between two
stretches of inner steps (`last_round_phases`; older versions report none).

`--repo DIR` runs another checkout's daemon (its `tests/harness.py` and `dilocod/`): the commit before a
change, in a `git worktree`, for a side-by-side comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))

from bench.throughput import bare_loop  # noqa: E402

WARMUP = 10.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default="2,3,4")
    parser.add_argument("--modes", default="none,delayed,streaming")
    parser.add_argument("--reach", default="public,private")
    parser.add_argument("--seconds", type=float, default=40.0, help="how long tokens are counted")
    parser.add_argument("--bare-steps", type=int, default=40)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--repo", type=Path, default=HERE, help="the checkout whose daemon runs")
    parser.add_argument("--json", action="store_true", help="one JSON object per case instead of rows")
    return parser.parse_args()


def case(args: argparse.Namespace, harness: Any, peers: int, mode: str, reach: str) -> dict[str, Any]:
    overrides = ("trainer.optimizer=adamw", f"outer.overlap={mode}", *args.overrides)
    local = ("net.reachability=private",) if reach == "private" else ()
    before = bare_loop("tiny", 16, 128, args.bare_steps)
    with tempfile.TemporaryDirectory(prefix="sharing-") as root:
        s = harness.Swarm(Path(root), overrides=overrides)
        try:
            s.start_bootstrap()
            started = time.monotonic()
            for _ in range(peers):
                s.add_peer(*local)
            try:
                harness.wait_for(
                    "every peer's first round",
                    lambda: all(p.status()["outer_step"] >= 1 for p in s.peers) or None,
                    300,
                    0.25,
                )
            except AssertionError as e:  # what each process said last: why the swarm never got going
                raise AssertionError(f"{e}\n{s.log_tails()}") from None
            first_round = time.monotonic() - started
            time.sleep(WARMUP)
            first = [p.status() for p in s.peers]
            began = time.monotonic()
            time.sleep(args.seconds)
            last = [p.status() for p in s.peers]
            seconds = time.monotonic() - began
        finally:
            s.close()
    after = bare_loop("tiny", 16, 128, args.bare_steps)
    share = (before + after) / 2 / peers
    rates = [(b["tokens_trained"] - a["tokens_trained"]) / seconds for a, b in zip(first, last, strict=True)]
    return {
        "peers": peers,
        "mode": mode,
        "reach": reach,
        "bare": [round(before), round(after)],
        "tokens_per_second": [round(r) for r in rates],
        "ratio_mean": round(statistics.mean(rates) / share, 3),
        "ratio_min": round(min(rates) / share, 3),
        "first_round_seconds": round(first_round, 1),
        "utilization": round(statistics.mean(st["compute_utilization"] for st in last), 3),
        "rounds": min(b["outer_step"] - a["outer_step"] for a, b in zip(first, last, strict=True)),
        "threads": [st.get("threads") for st in last],
        "phases": mean_phases(last, after_step=min(st["outer_step"] for st in first)),
    }


def mean_phases(statuses: list[dict[str, Any]], after_step: int) -> dict[str, float]:
    """Mean seconds a round of each phase over the rounds in the window (0 for a round without it)."""
    tallies = [
        e["phases"]
        for st in statuses
        for e in st["rounds"]
        if e.get("phases") and e["outer_step"] > after_step
    ]
    names = sorted({name for tally in tallies for name in tally})
    return {n: round(sum(t.get(n, 0.0) for t in tallies) / len(tallies), 3) for n in names} if tallies else {}


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(args.repo))
    from tests import harness  # noqa: PLC0415  (the chosen checkout's harness)

    if not args.json:
        print(f"daemon from {args.repo}")
        print(
            "peers  mode       reach    ratio (mean, min)  tokens/s per peer      first round  util   rounds"
        )
    for reach in args.reach.split(","):
        for mode in args.modes.split(","):
            for peers in (int(n) for n in args.peers.split(",")):
                result = case(args, harness, peers, mode, reach)
                if args.json:
                    print(json.dumps(result), flush=True)
                    continue
                print(
                    f"{peers:<6d} {mode:<10s} {reach:<8s} {result['ratio_mean']:.3f}, {result['ratio_min']:.3f}"
                    f"       {', '.join(f'{r:,}' for r in result['tokens_per_second']):<22s} "
                    f"{result['first_round_seconds']:>6.1f} s     {result['utilization']:.2f}   "
                    f"{result['rounds']}   bare {result['bare']}, threads {result['threads']}, "
                    f"phases {result['phases']}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
