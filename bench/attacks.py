"""Attack × reducer: honest eval loss ÷ clean, with real peers on loopback.

    .venv/bin/python bench/attacks.py [--peers 4 --attackers 1] [--rounds 10]
        [--reducers mean,trimmed_mean,median,centered_clip] [--attacks sign_flip,...] [--scoring]
        [--compression int4|int2|topk|...]

For every reducer, a clean run (the honest peers alone) and one run per attack (the same honest
peers, with the same identities and so the same data, plus the attackers) are trained to outer step
`--rounds`; a cell is the honest peers' eval loss of θ_global, averaged over the last five outer steps
both runs evaluated, divided by the clean run's (∞ when the attacked run diverged or stopped meeting).
The setup and the comparison are those of `tests/test_attacks.py`. Runs are sequential: on 2 cores
each takes about a minute with 4 peers. `--scoring` runs every run with contribution scoring on (H = 20,
the chunk schedule): what the attacks on work (`freeride`, `copy_update`, `wrong_data`) do to the loss once
scoring gates them; `bench/scoring.py` measures how fast they are gated and what scoring costs.
`--compression topk` runs the sparse codec, whose own rule replaces the reducer (one row is enough).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.attackrun import common_step, mean_eval, start_run  # noqa: E402

ATTACKS = [
    "sign_flip", "random_direction", "scale", "nan", "stale", "alie", "bad_reducer", "bad_donor", "inflate_tokens",
    "freeride", "copy_update", "wrong_data", "concentrate", "copy_support",
]  # fmt: skip
SCORING = ("scoring.enabled=true", "trainer.inner_steps=20", "data.chunk_tokens=8192")
REDUCERS = ["mean", "trimmed_mean", "median", "centered_clip"]


def run(root: Path, args: argparse.Namespace, mode: str | None, reducer: str) -> list[dict[str, Any]]:
    """The honest peers' statuses once all reached `--rounds` (or when the run stalled: [] )."""
    honest = args.peers - args.attackers
    extra = (*(SCORING if args.scoring else ()), f"averaging.compression={args.compression}")
    s = start_run(root, honest, args.attackers, mode, f"averaging.reducer={reducer}", *extra)
    try:
        return s.wait_all_at(args.rounds, timeout=args.timeout, peers=s.peers[-honest:], evaluated=True)
    except AssertionError as e:  # a wrecked run's peers stop meeting: that is a result, not a crash
        print(f"  ({reducer}, {mode}: {str(e).splitlines()[0]})", file=sys.stderr)
        return []
    finally:
        s.close()


def ratio(attacked: list[dict[str, Any]], clean: list[dict[str, Any]], rounds: int) -> float:
    if not attacked:
        return math.inf
    try:
        step = common_step(attacked, clean, rounds)
    except AssertionError:
        return math.inf
    return mean_eval(attacked, step) / mean_eval(clean, step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--attackers", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--reducers", default=",".join(REDUCERS))
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--scoring", action="store_true", help="contribution scoring on in every run")
    parser.add_argument("--compression", default="int4", help="averaging.compression of every run")
    args = parser.parse_args()
    attacks = args.attacks.split(",")
    print(
        f"{args.peers} peers, {args.attackers} attacker(s), {args.rounds} outer rounds, {args.compression}; "
        "honest eval ÷ clean" + ("; scoring on, H = 20" if args.scoring else "")
    )
    print("| reducer | " + " | ".join(attacks) + " |")
    print("|---" * (len(attacks) + 1) + "|", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for reducer in args.reducers.split(","):
            clean = run(Path(tmp) / f"{reducer}-clean", args, None, reducer)
            cells = []
            for mode in attacks:
                value = ratio(run(Path(tmp) / f"{reducer}-{mode}", args, mode, reducer), clean, args.rounds)
                cells.append("∞" if not math.isfinite(value) else f"{value:.3f}")
            print(f"| {reducer} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
