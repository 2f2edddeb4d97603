"""Churn at length: peers SIGKILLed again and again (mid-all-reduce, and every third kill mid-checkpoint).

    .venv/bin/python bench/churn.py [--peers 4] [--kills 20] [--seed 7] [--set k=v ...] [--json]

A bootstrap and `--peers` real peers on loopback (tiny preset, the test harness's fast settings). Once
all are at outer step 2, `--kills` times: a random peer is killed with its whole process group at a
random moment and restarted with the same run directory (`tests/churnrun.py`, which `tests/test_churn.py`
runs with 5 kills). Then the run's health is checked as the test does (deadlines kept, no NaN, at most
one split of θ_global healed at the next step, every peer back in one group) and a summary printed:
kills, kills aimed at checkpoint writes and how many cut one, restarts that resumed from a checkpoint,
seconds from serving again to the run's outer step (median, max), splits, the longest round.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.churnrun import check, churn  # noqa: E402
from tests.harness import FAST, start_swarm  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dilocod-churn-") as root:
        s = start_swarm(Path(root), args.peers, (*FAST, *args.overrides))
        try:
            s.wait_all_at(2, timeout=240)
            report = churn(s, args.kills, random.Random(args.seed))
            check(s, report)
        finally:
            s.close()
    summary = {
        **asdict(report),
        "back_seconds_median": statistics.median(report.back_seconds),
        "back_seconds_max": max(report.back_seconds),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            if key != "back_seconds":
                print(f"{key:>22}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
