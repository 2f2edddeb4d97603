"""Where a machine's CPU goes while something runs beside it (the suite, a bench), by the role of each process.

    .venv/bin/python bench/cpuroles.py --seconds 2700 --out cpu.json &
    CI=true .venv/bin/python -m pytest -q tests

Every `--interval` seconds it reads every process's utime + stime from /proc and adds what each used since the
last read to its role: a daemon's main process (`peer-main`, `bootstrap-main`), hivemind's DHT and averager
processes (forks of it: `peer-child`, `bootstrap-child`), `p2pd`, `pytest` (the unit tests run in it), others
by their command name. A process that exits between two reads loses at most its last interval. The JSON it
rewrites after each read holds the seconds elapsed and each role's CPU seconds, the largest first.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Proc:
    ppid: int
    cpu: float  # seconds, user + system
    comm: str
    cmdline: str


def snapshot() -> dict[int, Proc]:
    procs: dict[int, Proc] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
            cmdline = (
                Path(f"/proc/{entry.name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
        except OSError:
            continue
        close = stat.rindex(")")  # the command name may hold spaces and parentheses
        fields = stat[close + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
        procs[int(entry.name)] = Proc(int(fields[1]), cpu, stat[stat.index("(") + 1 : close], cmdline)
    return procs


def role(proc: Proc, procs: dict[int, Proc]) -> str:
    if "p2pd" in proc.comm or "p2pd" in proc.cmdline:
        return "p2pd"
    if "pytest" in proc.cmdline:
        return "pytest"
    if "-m dilocod" in proc.cmdline:
        kind = (
            "bootstrap" if " bootstrap " in proc.cmdline else "peer" if " join " in proc.cmdline else "other"
        )
        parent = procs.get(proc.ppid)
        return f"{kind}-child" if parent is not None and "-m dilocod" in parent.cmdline else f"{kind}-main"
    return "kernel workers" if proc.comm.startswith("kworker") else f"other:{proc.comm}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, required=True, help="how long to sample")
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--out", type=Path, required=True, help="the JSON, rewritten after every read")
    args = parser.parse_args()
    used: collections.defaultdict[str, float] = collections.defaultdict(float)
    start = time.monotonic()
    before = snapshot()
    while time.monotonic() - start < args.seconds:
        time.sleep(args.interval)
        now = snapshot()
        for pid, proc in now.items():
            old = before.get(pid)
            spent = proc.cpu - (old.cpu if old is not None and old.comm == proc.comm else 0.0)
            if spent > 0:
                used[role(proc, now)] += spent
        before = now
        largest = dict(sorted(used.items(), key=lambda item: -item[1]))
        report = {"seconds": round(time.monotonic() - start, 1), "cpu_seconds": largest}
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
