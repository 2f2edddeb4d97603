"""Contribution scoring through real peers on loopback: rounds until an adversary that does no work on the
data it claims is gated, the honest peers' eval loss beside a clean run's, false gates of honest peers, and
what scoring costs a peer.

    .venv/bin/python bench/scoring.py [--rounds 20] [--reducers mean,centered_clip]
        [--modes freeride,copy_update,wrong_data] [--peers 4]

For every reducer: a clean run with scoring off (the baseline), a clean run with scoring on, and one run per
adversary mode with scoring on; each has `--peers` honest peers (the same identities, so the same data, in
every run; tests/attackrun.py), tiny at H = 20, batch 8 × 64, chunks of 8192 tokens. Every outer step the
honest peers' statuses are read:
- **gated at**: the first outer step after which every honest peer lists the adversary as gated or banned;
- **false gates**: honest peer-rounds in which some honest peer listed another honest peer as gated;
- **eval ÷ clean**: the honest peers' eval loss of θ_global over the last 5 common steps ÷ the clean run's;
- **cost** (clean runs): the scoring thread's CPU seconds ÷ the seconds of inner steps, bytes fetched per
  score, and a peer's tokens/s in its inner steps (`tokens_trained ÷ train_seconds`, the honest peers'
  mean) with scoring on ÷ off. `--repeats N` runs the clean pair N times, alternating, and prints each
  ratio (the machine is noisy); `--modes ""` runs only the clean pairs.
Runs are sequential; on 2 cores each takes 1–2 minutes.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.attackrun import common_step, mean_eval, start_run  # noqa: E402

MODES = ["freeride", "copy_update", "wrong_data"]
SCORED = ("trainer.inner_steps=20", f"data.chunk_tokens={8192}")


@dataclass
class Observed:
    statuses: list[dict[str, Any]] = field(default_factory=list)
    gated_at: int | None = None
    peer_rounds: int = 0
    false_gates: int = 0
    tokens_per_second: float = 0.0  # the honest peers' mean, in their inner steps


def observe(root: Path, args: argparse.Namespace, mode: str | None, reducer: str, scoring: bool) -> Observed:
    """One run to `--rounds`, read at every outer step."""
    extra = (*SCORED, f"averaging.reducer={reducer}", f"scoring.enabled={str(scoring).lower()}")
    s = start_run(root, args.peers, 1 if mode else 0, mode, *extra)
    seen = Observed()
    try:
        honest = s.peers[-args.peers :]
        step = 1
        s.wait_all_at(step, timeout=args.timeout, peers=s.peers)
        bad = s.peers[0].status()["peer_id"] if mode else None
        while step < args.rounds:
            step += 1
            statuses = s.wait_all_at(step, timeout=args.timeout, peers=honest)
            names = {st["peer_id"] for st in statuses}
            seen.peer_rounds += len(statuses)
            seen.false_gates += sum(
                bool(names & set(st.get("scoring", {}).get("gated", []))) for st in statuses
            )
            if (
                bad is not None
                and seen.gated_at is None
                and all(
                    bad in st.get("scoring", {}).get("gated", []) or bad in st.get("banned", [])
                    for st in statuses
                )
            ):
                seen.gated_at = min(st["outer_step"] for st in statuses)
        seen.statuses = s.wait_all_at(args.rounds, timeout=args.timeout, peers=honest, evaluated=True)
        speeds = [
            st["tokens_trained"] / st["train_seconds"] for st in seen.statuses if st["train_seconds"] > 0
        ]
        seen.tokens_per_second = sum(speeds) / max(1, len(speeds))
    except AssertionError as e:
        print(f"  ({reducer}, {mode}: {str(e).splitlines()[0]})", file=sys.stderr)
    finally:
        s.close()
    return seen


def eval_ratio(attacked: Observed, clean: Observed, rounds: int) -> float:
    if not attacked.statuses or not clean.statuses:
        return math.inf
    try:
        step = common_step(attacked.statuses, clean.statuses, rounds)
    except AssertionError:
        return math.inf
    return mean_eval(attacked.statuses, step) / mean_eval(clean.statuses, step)


def cost(on: Observed, off: Observed) -> str:
    scoring = [st["scoring"] for st in on.statuses]
    cpu = sum(sc["scoring_cpu_seconds"] for sc in scoring)
    train = sum(st["train_seconds"] for st in on.statuses)
    scores = sum(sc["scores_computed"] for sc in scoring)
    fetched = sum(sc["bytes_fetched"] for sc in scoring)
    speed = on.tokens_per_second / off.tokens_per_second if off.tokens_per_second else math.nan
    return (
        f"scoring CPU ÷ inner steps {cpu / max(train, 1e-9):.3f} ({cpu:.1f} s ÷ {train:.1f} s), "
        f"{scores} scores, {fetched / max(scores, 1) / 1e6:.2f} MB fetched a score, "
        f"a peer's tokens/s in inner steps on ÷ off {speed:.3f} "
        f"({on.tokens_per_second:,.0f} ÷ {off.tokens_per_second:,.0f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", type=int, default=4, help="honest peers")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--reducers", default="mean,centered_clip")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--repeats", type=int, default=1, help="clean pairs (scoring off, on) per reducer")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    print(f"{args.peers} honest peers + 1 adversary, {args.rounds} outer rounds, tiny, H = 20, scoring on")
    print("| reducer | mode | gated at outer step | false gates / honest peer-rounds | honest eval ÷ clean |")
    print("|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for reducer in args.reducers.split(","):
            pairs = []
            for rep in range(args.repeats):
                off = observe(Path(tmp) / f"{reducer}-off-{rep}", args, None, reducer, scoring=False)
                on = observe(Path(tmp) / f"{reducer}-on-{rep}", args, None, reducer, scoring=True)
                pairs.append((on, off))
                print(f"| {reducer} | none | – | {on.false_gates} / {on.peer_rounds} | "
                      f"{eval_ratio(on, off, args.rounds):.3f} (scoring on) |", flush=True)  # fmt: skip
            for mode in modes:
                seen = observe(Path(tmp) / f"{reducer}-{mode}", args, mode, reducer, scoring=True)
                gated = "never" if seen.gated_at is None else str(seen.gated_at)
                print(f"| {reducer} | {mode} | {gated} | {seen.false_gates} / {seen.peer_rounds} | "
                      f"{eval_ratio(seen, off, args.rounds):.3f} |", flush=True)  # fmt: skip
            for on, off in pairs:
                line = cost(on, off) if on.statuses and off.statuses else "n/a"
                print(f"  {reducer}, clean runs: {line}", flush=True)


if __name__ == "__main__":
    main()
