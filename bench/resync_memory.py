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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from procstats import memory_by_kind  # noqa: E402

from tests.harness import FAST, Proc, start_swarm  # noqa: E402

IDLE_SECONDS, STALL_SECONDS, SETTLE_SECONDS = 37.0, 12.0, 25.0


def reading(label: str, peers: list[Proc]) -> dict[str, Any]:
    daemons = [memory_by_kind(p.popen.pid) for p in peers if p.popen is not None]
    status = peers[0].status()
    resynced = sum(1 for r in status["rounds"] if r["result"] == "resynced")
    row = {
        "label": label,
        "outer_step": status["outer_step"],
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
