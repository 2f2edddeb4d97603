"""A dilocod run of many peers, simulated with the daemon's own decisions (issue 44; bench/netsim/).

    .venv/bin/python bench/netsim.py --peers N [--nat SHARE] [--churn PER_HOUR] [--speeds equal|spread|mixed]
        [--link-mbit R] [--preset P] [--rounds K] [--seed S] [--json]

  --peers N         peers at the start (churn keeps the number: every leave brings a joiner)
  --nat SHARE       share of peers behind NAT (private: they reduce nothing), 0 ≤ SHARE < 1 (default 0)
  --churn PER_HOUR  % of the peers that leave per hour (5: 5 %/hour, the issue's goal), half crashes, half
                    clean exits, each replaced by a joiner (default 0)
  --speeds          equal; spread (1 … 1/10 of the base); mixed (2/3 GPUs, 1/3 CPUs at 1/20) (default equal)
  --link-mbit R     every peer's upload and download, Mbit/s (default 100)
  --preset P        the model and its config: configs/P.toml (default tiny)
  --rounds K        rounds the run closes (default 5)
  --seed S          the seed of everything drawn (default 0): one seed, one result
  --json            print one JSON object (else a short summary)

What is run for real and what is modelled: bench/netsim/__init__.py and docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.netsim.run import simulate  # noqa: E402
from bench.netsim.settings import BASE_TOKENS_PER_SECOND, SPEEDS, Scenario  # noqa: E402


def parse(argv: Sequence[str]) -> Scenario:
    parser = argparse.ArgumentParser(prog="netsim.py", description="Simulate a dilocod run of many peers.")
    parser.add_argument("--peers", type=int, required=True)
    parser.add_argument("--nat", type=float, default=0.0)
    parser.add_argument("--churn", type=float, default=0.0)
    parser.add_argument("--speeds", choices=SPEEDS, default="equal")
    parser.add_argument("--link-mbit", type=float, default=100.0)
    parser.add_argument("--preset", choices=sorted(BASE_TOKENS_PER_SECOND), default="tiny")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    scenario = Scenario(
        peers=args.peers, nat=args.nat, churn=args.churn, speeds=args.speeds, link_mbit=args.link_mbit,
        preset=args.preset, rounds=args.rounds, seed=args.seed,
    )  # fmt: skip
    try:
        scenario.validate()
    except ValueError as e:
        parser.error(str(e))
    return scenario


def main(argv: Sequence[str] | None = None) -> int:
    scenario = parse(sys.argv[1:] if argv is None else argv)
    result = simulate(scenario)
    if "--json" in (sys.argv[1:] if argv is None else argv):
        print(json.dumps(result, sort_keys=True))
        return 0
    keys = ("peers", "rounds", "tokens_in_global_share", "full_group_share", "one_global_share", "round_seconds",
            "utilization", "bytes_per_peer_round", "dht_messages_per_peer_round", "joiner_seconds",
            "bootstrap_requests_per_second", "bootstrap_bytes_per_second")  # fmt: skip
    for key in keys:
        print(f"{key}: {result[key]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
