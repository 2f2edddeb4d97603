"""Unequal machines: how much of each peer's work reaches θ_global, and what the fast peers lose to the slow.

    .venv/bin/python bench/hetero.py [--speeds 1,1,0.667,0.333] [--seconds 240] [--set k=v ...]
                                     [--repo DIR] [--json] [--keep DIR]

A bootstrap and one real peer per entry of `--speeds` on loopback (tiny preset, the test harness's fast
settings, 1 torch thread each). A peer of speed s < 1 runs its trainer only s of the time
(`tests.harness.Proc.throttle`: SIGSTOP/SIGCONT every 0.2 s), as a machine s times as fast. After
`--seconds` of training it reads every peer's `/api/status` and reports:

- each peer's contribution share: its tokens that reached θ_global ÷ tokens it trained;
- the swarm's useful-compute fraction: Σ tokens that reached θ_global ÷ Σ tokens trained;
- each peer's compute utilization (time in inner steps ÷ wall time);
- the share of peer-rounds in the run's round (a successful round with every peer in it);
- the eval loss of θ_global at the end (equal wall time for every variant compared);
- the median seconds of an applied round in matchmaking and in the all-reduce;
- the bootstrap's cost over the measured seconds: cores busy on average and memory (PSS of its process
  tree), in all and per peer.

`--repo DIR` runs another checkout's daemon (its `tests/harness.py` and `dilocod/`), for a side-by-side
comparison with an older commit in a `git worktree`. A version without token accounting (before the
run's clock) reports no `tokens_contributed`: the bench then reconstructs it from the round history,
crediting each successful round with the H inner steps of every attempt since the peer's last θ_global
and dropping them at a re-sync, which is what that version did.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE / "bench"))

from procstats import tree, tree_figures  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--speeds", default="1,1,0.667,0.333", help="one per peer: share of the time it runs")
    parser.add_argument("--peers", type=int, default=0, help="N equal peers instead of --speeds (scale runs)")
    parser.add_argument("--seconds", type=float, default=240.0, help="training time measured")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--repo", type=Path, default=HERE, help="the checkout whose daemon runs (default: this)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument(
        "--keep", type=Path, default=None, help="keep the run directory (logs, statuses.json) here"
    )
    return parser.parse_args()


def contributed(status: dict[str, Any], tokens_per_step: int, inner_steps: int) -> float:
    """Tokens of this peer that reached θ_global: reported, or rebuilt from the history (older versions)."""
    if status.get("tokens_contributed") is not None:
        return float(status["tokens_contributed"])
    pending, reached = 0, 0
    for entry in status["rounds"]:
        if entry["result"] in ("ok", "alone"):
            reached += pending + inner_steps
            pending = 0
        elif entry["result"] in ("no_group", "failed"):
            pending += inner_steps  # kept for the next round
        elif entry["result"] in ("resynced", "diverged"):
            pending = 0  # dropped
    return float(reached * tokens_per_step)


def trained(status: dict[str, Any], tokens_per_step: int) -> float:
    if status.get("tokens_trained") is not None:
        return float(status["tokens_trained"])
    return float(status["inner_step"] * tokens_per_step)


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    sys.path.insert(0, str(args.repo))
    from tests import harness  # noqa: PLC0415  (the chosen checkout's harness)

    speeds = [1.0] * args.peers if args.peers else [float(x) for x in args.speeds.split(",")]
    s = harness.Swarm(root, overrides=(*harness.FAST, *args.overrides))
    try:
        s.start_bootstrap()
        for _ in speeds:
            s.add_peer()
        for peer in s.peers:
            s.wait_serving(peer, timeout=180)
        for peer, speed in zip(s.peers, speeds):
            if speed < 1:
                peer.throttle(speed)
        assert s.bootstrap is not None and s.bootstrap.popen is not None
        boot_pids = tree(s.bootstrap.popen.pid)
        boot_before = tree_figures(s.bootstrap.popen.pid)["cpu_seconds"]
        time.sleep(args.seconds)
        boot = tree_figures(s.bootstrap.popen.pid)
        whole = set(tree(s.bootstrap.popen.pid)) >= set(boot_pids)  # no child of its tree ended meanwhile
        for peer in s.peers:
            peer.unthrottle()
        statuses = [p.status() for p in s.peers]
    finally:
        s.close()
    if args.keep is not None:  # every peer's /api/status as read, with the logs: why a round missed whom
        (root / "statuses.json").write_text(json.dumps(statuses))
    result = summarize(args, (*harness.FAST, *args.overrides), speeds, statuses)
    # The bootstrap's cost (its DHT, relay and auxiliary reducer): CPU over the measured seconds (its tree
    # as it was at the start: children that lived throughout) and memory at the end, per peer served.
    cpu = boot["cpu_seconds"] - boot_before if whole else None
    result["bootstrap"] = {
        "cpu_share": None if cpu is None else round(cpu / args.seconds, 3),  # cores busy on average
        "cpu_share_per_peer": None if cpu is None else round(cpu / args.seconds / len(speeds), 4),
        "memory_mb": round(boot["rss_mb"], 1),
        "memory_mb_per_peer": round(boot["rss_mb"] / len(speeds), 1),
    }
    return result


def setting(overrides: tuple[str, ...], key: str) -> int:
    """The last `--set key=…` value among the harness's settings and ours."""
    return int([o.split("=", 1)[1] for o in overrides if o.startswith(key + "=")][-1])


def summarize(
    args: argparse.Namespace, overrides: tuple[str, ...], speeds: list[float], statuses: list[dict[str, Any]]
) -> dict[str, Any]:
    tokens_per_step = setting(overrides, "trainer.batch_size") * setting(overrides, "trainer.seq_len")
    inner_steps = setting(overrides, "trainer.inner_steps")
    peers = []
    for speed, st in zip(speeds, statuses):
        made, reached = trained(st, tokens_per_step), contributed(st, tokens_per_step, inner_steps)
        peers.append(
            {
                "speed": speed,
                "contribution_share": round(min(1.0, reached / made), 3) if made else None,
                "tokens_trained": made,
                "tokens_contributed": reached,
                "compute_utilization": round(st["compute_utilization"], 3),
                "outer_step": st["outer_step"],
                "eval_loss": st["eval_loss"],
            }
        )
    return {
        "speeds": speeds,
        "seconds": args.seconds,
        "useful_compute": round(
            sum(p["tokens_contributed"] for p in peers) / sum(p["tokens_trained"] for p in peers), 3
        ),
        "fast_utilization": round(
            statistics.mean(p["compute_utilization"] for p in peers if p["speed"] >= 1), 3
        ),
        "in_run_round": in_run_round(statuses),
        "not_in_run_round": not_in_run_round(statuses),
        "reached_share": reached_share(statuses),
        "close_to_applied": close_to_applied(statuses),
        "matchmaking_seconds": phase_median(statuses, allreduce=False),
        "allreduce_seconds": phase_median(statuses, allreduce=True),
        "eval_loss": min((p["eval_loss"] for p in peers if p["eval_loss"] is not None), default=None),
        "outer_steps": max(p["outer_step"] for p in peers),
        "peers": peers,
    }


def first_full_round(statuses: list[dict[str, Any]]) -> int | None:
    """The first outer step every peer reached together (the start, while peers come up, is left out)."""
    n = len(statuses)
    full = [
        e["outer_step"]
        for st in statuses
        for e in st["rounds"]
        if e["result"] == "ok" and e["group_size"] == n
    ]
    return min(full) if full else None


def in_run_round(statuses: list[dict[str, Any]]) -> float:
    """Share of peer-rounds after the first full round that were a successful round with every peer."""
    first = first_full_round(statuses)
    if first is None:
        return 0.0
    entries = [e for st in statuses for e in st["rounds"] if e["outer_step"] > first]
    full = [e for e in entries if e["result"] == "ok" and e["group_size"] == len(statuses)]
    return round(len(full) / max(1, len(entries)), 3)


def not_in_run_round(statuses: list[dict[str, Any]]) -> dict[str, int]:
    """The peer-rounds after the first round with every peer that were not in a full successful round, by
    what they were (`ok/3`: a successful round in a group of 3; otherwise the round's result); all of
    them when no round ever had every peer."""
    n, first = len(statuses), first_full_round(statuses)
    entries = [e for st in statuses for e in st["rounds"] if first is None or e["outer_step"] > first]
    found = Counter(
        f"ok/{e['group_size']}" if e["result"] == "ok" else e["result"]
        for e in entries
        if not (e["result"] == "ok" and e["group_size"] == n)
    )
    return dict(found.most_common())


def reached_share(statuses: list[dict[str, Any]]) -> float:
    """Share of (peer, outer step) pairs, over the steps the run made after its first full round, in which
    the peer reached the step's θ_global by averaging (an `ok` round), whatever its group's size."""
    first = first_full_round(statuses)
    if first is None:
        return 0.0
    oks = [{e["outer_step"] for e in st["rounds"] if e["result"] == "ok"} for st in statuses]
    steps = {step for ok in oks for step in ok if step > first}
    return round(sum(len(ok & steps) for ok in oks) / max(1, len(statuses) * len(steps)), 3)


def close_to_applied(statuses: list[dict[str, Any]]) -> float | None:
    """Median seconds from a round's close to its average (matchmaking + all-reduce) over applied rounds."""
    seconds = [e["seconds"] for st in statuses for e in st["rounds"] if e["result"] == "ok"]
    return round(statistics.median(seconds), 3) if seconds else None


def phase_median(statuses: list[dict[str, Any]], allreduce: bool) -> float | None:
    """Median seconds of applied rounds spent in the all-reduce, or before it (matchmaking); None for a
    version whose round records do not split them."""
    rounds = [e for st in statuses for e in st["rounds"] if e["result"] == "ok" and "allreduce_seconds" in e]
    if not rounds:
        return None
    values = [e["allreduce_seconds"] if allreduce else e["seconds"] - e["allreduce_seconds"] for e in rounds]
    return round(statistics.median(values), 3)


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # reap the swarm through `finally`
    with tempfile.TemporaryDirectory(prefix="dilocod-hetero-") as tmp:
        result = run(args, args.keep or Path(tmp))
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"speeds {args.speeds}, {args.seconds:.0f}s: useful compute {result['useful_compute']:.3f}, "
        f"fast peers' utilization {result['fast_utilization']:.3f}, peer-rounds in the run's round "
        f"{result['in_run_round']:.3f} (reached θ_global: {result['reached_share']:.3f}; the others: "
        f"{result['not_in_run_round']}), close to applied "
        f"{result['close_to_applied']}s (matchmaking {result['matchmaking_seconds']}s, all-reduce "
        f"{result['allreduce_seconds']}s), {result['outer_steps']} outer steps, eval loss {result['eval_loss']}; "
        f"bootstrap {result['bootstrap']}"
    )
    for p in result["peers"]:
        print(
            f"  speed {p['speed']:.3f}: share {p['contribution_share']}, utilization {p['compute_utilization']:.3f}, "
            f"{p['tokens_trained']:.0f} tokens trained, {p['tokens_contributed']:.0f} reached θ_global"
        )


if __name__ == "__main__":
    main()
