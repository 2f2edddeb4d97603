"""Bytes a peer puts on the wire per token it trained, by codec and group size, from the daemon's own counters.

    .venv/bin/python bench/wirebytes.py [--codecs int4,int2,topk] [--peers 2,4,8] [--rounds 4]

For each codec and each group size n, a bootstrap and n peers (the tiny preset, the test harness's fast
settings, `averaging.group_size = n`) train to outer step `--rounds`; a cell is Σ bytes_sent ÷ Σ tokens over
the rounds every peer recorded as ok in a group of all n (each round's record in `/api/status`: what the peer
sent, its replies as a reducer included, and the tokens behind its contribution). The bootstrap reduces too
(one more reducer, no contribution), as in a real run. Runs are sequential.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.harness import FAST, Swarm  # noqa: E402


def bytes_per_token(statuses: list[dict[str, Any]], n: int) -> float:
    rounds = [e for st in statuses for e in st["rounds"] if e["result"] == "ok" and e["group_size"] == n]
    tokens = sum(e["tokens"] for e in rounds)
    return sum(e["bytes_sent"] for e in rounds) / tokens if tokens else float("nan")


def measure(root: Path, codec: str, n: int, rounds: int, timeout: float) -> float:
    s = Swarm(root, overrides=(*FAST, f"averaging.compression={codec}", f"averaging.group_size={n}"))
    try:
        s.start_bootstrap()
        for _ in range(n):
            s.add_peer()
        return bytes_per_token(s.wait_all_at(rounds, timeout=timeout), n)
    except AssertionError as e:
        print(f"  ({codec}, n = {n}: {str(e).splitlines()[0]})", file=sys.stderr)
        return float("nan")
    finally:
        s.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--codecs", default="int4,int2,topk")
    parser.add_argument("--peers", default="2,4,8")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=400)
    args = parser.parse_args()
    sizes = [int(n) for n in args.peers.split(",")]
    print("bytes sent per token trained (tiny preset)")
    print("| codec | " + " | ".join(f"n = {n}" for n in sizes) + " |")
    print("|---" * (len(sizes) + 1) + "|", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for codec in args.codecs.split(","):
            cells = [measure(Path(tmp) / f"{codec}-{n}", codec, n, args.rounds, args.timeout) for n in sizes]
            print(f"| {codec} | " + " | ".join(f"{c:.1f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
