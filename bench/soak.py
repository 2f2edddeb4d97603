"""An hour of a run: does anything grow, and does every round complete?

    .venv/bin/python bench/soak.py [--peers 4] [--minutes 60] [--sample 60] [--warmup 10] [--set k=v ...] [--json]

A bootstrap and `--peers` real peers on loopback (tiny preset, the test harness's fast settings, H = 5)
for `--minutes`. Every `--sample` seconds it reads, for the bootstrap and each peer, the whole process
tree (the daemon, hivemind's DHT and averager processes, p2pd): memory (proportional set size, so pages
the forked children share with the daemon count once), open file descriptors,
threads and child processes, from /proc; and from `/api/status` how many records the node's DHT holds
(`dht_records`) and every round in the peer's history. At the end it counts peer-rounds: ok, failed, of
those incomplete (results came back partial: `reason` starts with `incomplete`), and the rest by result;
and for each process, growth per hour of each figure between the first sample after `--warmup` minutes
and the last (a least-squares slope over those samples, so one noisy sample does not decide it). With
`--json` it prints one object: `rounds_total`, `rounds_ok`, `rounds_failed`, `rounds_incomplete`,
`rounds_by_result`, `processes` (name → first/last/growth per hour of `rss_mb`, `fds`, `threads`,
`children`, `dht_records`), `samples` (each with every process's own memory, `parts`: `pid:name` → MB)
and `events`: every peer-round that was not ok (`peer`, `minute` since the first sample, `outer_step`,
`result`, `reason`), so that a step in a process's memory can be set against what happened then.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from procstats import tree_figures, tree_parts  # noqa: E402

from tests.harness import FAST, Proc, Swarm, start_swarm  # noqa: E402

FIGURES = ("rss_mb", "fds", "threads", "children", "dht_records")


def sample(proc: Proc) -> dict[str, Any]:
    """One process tree's figures now (None for the DHT's records if its API did not answer), and each of
    its processes' memory (`parts`), so that a tree that grows says which process does."""
    assert proc.popen is not None
    figures: dict[str, Any] = dict(tree_figures(proc.popen.pid))
    figures.pop("cpu_seconds")
    figures["parts"] = tree_parts(proc.popen.pid)
    try:
        figures["dht_records"] = proc.status().get("dht_records")
    except Exception:
        figures["dht_records"] = None
    return figures


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value), per hour."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 0.0 if var == 0 else 3600 * sum((t - mt) * (v - mv) for t, v in points) / var


def growth(samples: list[dict[str, Any]], name: str, warmup_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for figure in FIGURES:
        points = [
            (s["t"], s["processes"][name][figure])
            for s in samples
            if s["t"] >= warmup_s and s["processes"].get(name, {}).get(figure) is not None
        ]
        if not points:
            continue
        first, last = points[0][1], points[-1][1]
        per_hour = slope_per_hour(points)
        out[figure] = {
            "first": round(first, 1),
            "last": round(last, 1),
            "per_hour": round(per_hour, 2),
            "per_hour_pct": round(100 * per_hour / first, 2) if first else None,
        }
    return out


def collect_rounds(s: Swarm, seen: dict[tuple[str, int, float], dict[str, Any]]) -> None:
    """Add each peer's history entries not seen yet (a history holds the last 100 rounds; sampled often
    enough, none is missed)."""
    for proc in s.peers:
        try:
            status = proc.status()
        except Exception:
            continue
        for entry in status["rounds"]:
            seen.setdefault((proc.name, entry["outer_step"], entry["time"]), entry)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--sample", type=float, default=60.0, help="seconds between samples")
    parser.add_argument("--warmup", type=float, default=10.0, help="minutes left out of the growth figures")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    samples: list[dict[str, Any]] = []
    rounds: dict[tuple[str, int, float], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="dilocod-soak-") as root:
        s = start_swarm(Path(root), args.peers, (*FAST, *args.overrides))
        try:
            s.wait_all_at(1, timeout=300)
            start, start_unix = time.monotonic(), time.time()
            next_sample = start
            while (now := time.monotonic()) < start + 60 * args.minutes:
                collect_rounds(s, rounds)
                if now >= next_sample:
                    assert s.bootstrap is not None
                    procs = {p.name: sample(p) for p in (s.bootstrap, *s.peers)}
                    samples.append({"t": round(now - start, 1), "processes": procs})
                    next_sample += args.sample
                    print(f"[{(now - start) / 60:5.1f} min] {_line(procs)}", file=sys.stderr, flush=True)
                time.sleep(min(10.0, args.sample))
            collect_rounds(s, rounds)
        finally:
            s.close()
    print(
        json.dumps(summary(samples, rounds, 60 * args.warmup, start_unix))
        if args.json
        else _table(samples, rounds, args)
    )
    return 0


def summary(
    samples: list[dict[str, Any]],
    rounds: dict[tuple[str, int, float], dict[str, Any]],
    warmup_s: float,
    start_unix: float = 0.0,
) -> dict[str, Any]:
    by_result = Counter(e["result"] for e in rounds.values())
    incomplete = sum(
        1
        for e in rounds.values()
        if e["result"] == "failed" and str(e.get("reason") or "").startswith("incomplete")
    )
    names = list(samples[-1]["processes"]) if samples else []
    return {
        "rounds_total": len(rounds),
        "rounds_ok": by_result.get("ok", 0),
        "rounds_failed": by_result.get("failed", 0),
        "rounds_incomplete": incomplete,
        "rounds_by_result": dict(by_result),
        "failure_reasons": dict(Counter(str(e.get("reason")) for e in rounds.values() if e.get("reason"))),
        "processes": {name: growth(samples, name, warmup_s) for name in names},
        "samples": samples,
        "events": events(rounds, start_unix),
    }


def events(rounds: dict[tuple[str, int, float], dict[str, Any]], start_unix: float) -> list[dict[str, Any]]:
    """The peer-rounds that were not ok, in time order (where the run stumbled, and when)."""
    return [
        {
            "peer": peer,
            "minute": round((when - start_unix) / 60, 2),
            "outer_step": step,
            "result": entry["result"],
            "reason": entry.get("reason"),
        }
        for (peer, step, when), entry in sorted(rounds.items(), key=lambda item: item[0][2])
        if entry["result"] != "ok"
    ]


def _line(procs: dict[str, dict[str, Any]]) -> str:
    return "  ".join(
        f"{name}: {p['rss_mb']:.0f}MB {p['fds']}fd {p['threads']}thr {p['children']}ch {p['dht_records']}rec"
        for name, p in procs.items()
    )


def _table(
    samples: list[dict[str, Any]],
    rounds: dict[tuple[str, int, float], dict[str, Any]],
    args: argparse.Namespace,
) -> str:
    result = summary(samples, rounds, 60 * args.warmup)
    lines = [
        f"{args.peers} peers, {args.minutes:g} min: {result['rounds_total']} peer-rounds, "
        f"{result['rounds_ok']} ok, {result['rounds_failed']} failed ({result['rounds_incomplete']} incomplete); "
        f"by result {result['rounds_by_result']}",
        "| process | figure | first | last | growth / h | growth / h % |",
        "|---|---|---|---|---|---|",
    ]
    for name, figures in result["processes"].items():
        for figure, g in figures.items():
            lines.append(
                f"| {name} | {figure} | {g['first']} | {g['last']} | {g['per_hour']} | {g['per_hour_pct']} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
