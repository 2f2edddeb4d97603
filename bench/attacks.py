"""Attack × reducer: honest eval loss ÷ clean, with real peers on loopback.

    .venv/bin/python bench/attacks.py [--peers 4 --attackers 1] [--rounds 10]
        [--reducers mean,trimmed_mean,median,centered_clip] [--attacks sign_flip,...]

For every reducer, a clean run (all honest) and one run per attack are trained to the same outer
step; the table gives the honest peers' eval loss of θ_global divided by the clean run's at that
step (∞ when the run diverged). Runs are sequential: on 2 cores each takes about a minute.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.harness import FAST, Swarm  # noqa: E402

ATTACKS = ["sign_flip", "random_direction", "scale", "nan", "stale", "alie", "bad_reducer", "bad_donor"]
REDUCERS = ["mean", "trimmed_mean", "median", "centered_clip"]


def run(root: Path, peers: int, attackers: int, mode: str | None, reducer: str, rounds: int) -> float:
    settings = (*FAST, f"averaging.reducer={reducer}", f"averaging.group_size={peers}",
                "averaging.min_matchmaking_time=3", "averaging.matchmaking_timeout=10")  # fmt: skip
    s = Swarm(root, overrides=settings)
    try:
        s.start_bootstrap()
        liars = attackers if mode else 0
        honest = [s.add_peer() for _ in range(peers - liars)]
        for _ in range(liars):
            s.add_peer(f"adversary.mode={mode}")
        statuses = s.wait_all_at(rounds, timeout=900, peers=honest)
        return eval_at(statuses, rounds)
    finally:
        s.close()


def eval_at(statuses: list[dict[str, Any]], step: int) -> float:
    values = [
        e["eval_loss"]
        for s in statuses
        for e in s["rounds"]
        if e["outer_step"] >= step and e["result"] == "ok"
    ]
    if not values:
        return math.inf
    return math.inf if values[0] is None else float(values[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--attackers", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--reducers", default=",".join(REDUCERS))
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    args = parser.parse_args()
    attacks = args.attacks.split(",")
    print(
        f"{args.peers} peers, {args.attackers} attacker(s), {args.rounds} outer rounds; honest eval ÷ clean"
    )
    print("| reducer | " + " | ".join(attacks) + " |")
    print("|---" * (len(attacks) + 1) + "|")
    with tempfile.TemporaryDirectory() as tmp:
        for reducer in args.reducers.split(","):
            clean = run(
                Path(tmp) / f"{reducer}-clean", args.peers, args.attackers, None, reducer, args.rounds
            )
            cells = []
            for mode in attacks:
                loss = run(
                    Path(tmp) / f"{reducer}-{mode}", args.peers, args.attackers, mode, reducer, args.rounds
                )
                cells.append("∞" if not math.isfinite(loss) else f"{loss / clean:.3f}")
            print(f"| {reducer} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
