"""How fast a peer that fell behind gets back into the run's groups.

    .venv/bin/python bench/rejoin.py [--peers 3] [--pause 6] [--after 12] [--repeats 3] [--slow SHARE] [--restart]
                                     [--set k=v ...] [--keep DIR]

A bootstrap and `--peers` real peers on loopback (tiny preset, the test harness's fast settings: H = 5,
a 1.5 s matchmaking window). Once all are at outer step 3, the last peer is frozen (SIGSTOP) for
`--pause` seconds, as a machine that stalls, then thawed: it finds the run ahead and re-syncs. With
`--slow SHARE` it is instead throttled for good, as a slower machine: its process runs only SHARE of
every 0.2 s (`tests.harness.Proc.throttle`); with `--restart` its process group is SIGKILLed, as a
machine that dies, and restarted after the pause with the same run directory (it resumes from its
checkpoint, behind the run, and re-syncs; "the thaw" is then when it serves again; with `--slow` too, the
restarted peer is throttled). From the thaw (or the throttle) on, for `--after` outer steps of the run, the bench counts the stalled peer's re-syncs and its
rounds in a full group (every peer averaging together), and how long it took to its first full round.
The figures come from the peers' own `/api/status` round history. Run it from two checkouts to compare
two versions side by side (docs/benchmarks.md has the commands and results).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.harness import FAST, Swarm, wait_for  # noqa: E402


def one_run(root: Path, args: argparse.Namespace) -> dict[str, float]:
    s = Swarm(root, overrides=(*FAST, *args.overrides))
    try:
        s.start_bootstrap()
        for _ in range(args.peers):
            s.add_peer()
        s.wait_all_at(3, timeout=180)
        stalled = s.peers[-1]
        if args.restart:  # a machine that dies and comes back: it resumes from its checkpoint, behind
            assert stalled.popen is not None
            os.killpg(stalled.popen.pid, signal.SIGKILL)
            stalled.popen.wait(timeout=10)
            time.sleep(args.pause)
            stalled.start()
            if args.slow:  # ... and is slow: its state download too
                stalled.throttle(args.slow)
            s.wait_serving(stalled, timeout=120)
        elif args.slow:  # a slower machine from here on, rather than one stall
            stalled.throttle(args.slow)
        else:
            stalled.signal(signal.SIGSTOP)
            time.sleep(args.pause)
            stalled.signal(signal.SIGCONT)
        thawed = time.monotonic()
        start_step = max(p.status()["outer_step"] for p in s.peers[:-1])
        full = wait_for(
            "a full round with the stalled peer",
            lambda: _full_rounds(stalled.status(), start_step, args.peers),
            300,
        )
        first_full = time.monotonic() - thawed
        s.wait_all_at(start_step + args.after, timeout=300)
        history = stalled.status()["rounds"]
        after = [e for e in history if e["outer_step"] > start_step]
        full = _full_rounds(stalled.status(), start_step, args.peers)
        return {
            "seconds_to_full_round": first_full,
            "resyncs": sum(e["result"] == "resynced" for e in after),
            "full_rounds": len(full),
            "steps": args.after,
        }
    finally:
        s.close()


def _full_rounds(status: dict[str, Any], after_step: int, peers: int) -> list[dict[str, Any]]:
    return [
        e
        for e in status["rounds"]
        if e["outer_step"] > after_step and e["result"] == "ok" and e["group_size"] == peers
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--pause", type=float, default=6.0, help="seconds the peer is frozen")
    parser.add_argument(
        "--after", type=int, default=12, help="outer steps of the run measured after the thaw"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--slow", type=float, default=None, metavar="SHARE",
        help="instead of the pause: run the last peer's trainer only this share of the time from then on",
    )  # fmt: skip
    parser.add_argument(
        "--restart", action="store_true",
        help="instead of freezing it: SIGKILL the last peer's process group, restart it after the pause",
    )  # fmt: skip
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--keep", type=Path, default=None, help="keep each run's directory (logs) under this one"
    )
    args = parser.parse_args()
    # A SIGTERM (`timeout`, Ctrl-C from a wrapper) must still reap the swarm: exit through `finally`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows = []
    with tempfile.TemporaryDirectory(prefix="dilocod-rejoin-") as tmp:
        for k in range(args.repeats):
            row = one_run((args.keep or Path(tmp)) / f"run-{k}", args)
            rows.append(row)
            print(
                f"run {k + 1}: first full round {row['seconds_to_full_round']:.1f}s after the thaw; "
                f"in the next {args.after} steps {row['full_rounds']:.0f} full rounds, {row['resyncs']:.0f} re-syncs",
                flush=True,
            )
    for key in ("seconds_to_full_round", "full_rounds", "resyncs"):
        print(f"median {key}: {statistics.median(r[key] for r in rows):.1f}")


if __name__ == "__main__":
    main()
