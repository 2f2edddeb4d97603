"""What a re-sync does to a daemon's memory: idle rounds first, then stalls that force state downloads.

    .venv/bin/python bench/resync_memory.py [--peers 3] [--idle 1] [--stalls 3] [--set k=v ...] [--json]

A bootstrap and `--peers` peers on loopback (tiny, the test harness's fast settings) train until outer
step 3 and 20 s more; then `--idle` times 37 s of plain training, then `--stalls` times peer-0 is
stopped (SIGSTOP) for 12 s, so that the run closes rounds without it and it downloads the state from
another peer when it is let go (SIGCONT), and 25 s later every daemon (the peer's own python process,
not its forks) is read again. Each reading is the daemon's memory (PSS, MB) split by kind of mapping
(`/proc/PID/smaps`): `heap` (the main malloc heap), `anon` (other anonymous memory: torch's large
buffers, malloc's other arenas), `shm` (shared memory: tensors torch moved there to pass them to
hivemind's averager process) and `file`. A step that appears with a stall and stays is what one state
transfer leaves behind; a step in the idle readings is warm-up.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.harness import FAST, Proc, start_swarm  # noqa: E402

IDLE_SECONDS, STALL_SECONDS, SETTLE_SECONDS = 37.0, 12.0, 25.0


def kind(mapping: str) -> str:
    """The kind of a line of /proc/PID/smaps naming a mapping ('' for an anonymous one)."""
    if mapping.startswith("/dev/shm") or "torch_" in mapping:
        return "shm"
    if mapping == "[heap]":
        return "heap"
    return "file" if mapping.startswith("/") else "anon"


def memory_by_kind(pid: int) -> dict[str, float]:
    """The process's PSS in MB by kind of mapping."""
    found: dict[str, float] = {}
    current = "anon"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if not fields[0].endswith(":"):  # a mapping's header: address perms offset dev inode [name]
            current = kind(fields[5] if len(fields) > 5 else "")
        elif fields[0] == "Pss:":
            found[current] = found.get(current, 0.0) + int(fields[1]) / 1024
    return {k: round(v, 1) for k, v in sorted(found.items())}


def reading(label: str, peers: list[Proc]) -> dict[str, Any]:
    daemons = [memory_by_kind(p.popen.pid) for p in peers if p.popen is not None]
    resynced = sum(1 for r in peers[0].status()["rounds"] if r["result"] == "resynced")
    row = {
        "label": label,
        "outer_step": peers[0].status()["outer_step"],
        "peer0_resyncs_in_history": resynced,
        "daemons_mb": [round(sum(d.values()), 1) for d in daemons],
        "by_kind": daemons,
    }
    print(f"{label:<10} daemons {row['daemons_mb']} MB  " + "  ".join(map(str, daemons)), file=sys.stderr)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--idle", type=int, default=1)
    p.add_argument("--stalls", type=int, default=3)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="dilocod-resync-") as root:
        s = start_swarm(Path(root), args.peers, (*FAST, *args.overrides))
        try:
            s.wait_all_at(3, timeout=300)
            time.sleep(20)
            rows.append(reading("start", s.peers))
            for i in range(args.idle):
                time.sleep(IDLE_SECONDS)
                rows.append(reading(f"idle {i + 1}", s.peers))
            for i in range(args.stalls):
                s.peers[0].signal(signal.SIGSTOP)
                time.sleep(STALL_SECONDS)
                s.peers[0].signal(signal.SIGCONT)
                time.sleep(SETTLE_SECONDS)
                rows.append(reading(f"stall {i + 1}", s.peers))
        finally:
            s.close()
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
