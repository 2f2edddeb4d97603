"""A child forked after `freeze_before_fork` keeps sharing the parent's objects through a full collection."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The parent makes ~60 MB of small long-lived objects (as imports and a model's Python objects are), forks,
# and the child runs a full collection and reports how many MB of its memory became private since the fork.
PROBE = """
import gc, os, sys
from peers.forking import freeze_before_fork
kept = [[i, [str(i)]] for i in range(300_000)]  # lists: the collector tracks them
if sys.argv[1] == "freeze":
    freeze_before_fork()
def private_mb():
    total = 0
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith(("Private_Dirty:", "Private_Clean:")):
            total += int(line.split()[1])
    return total / 1024
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    before = private_mb()
    gc.collect()
    os.write(write, f"{private_mb() - before:.1f}".encode())
    os._exit(0)
os.waitpid(pid, 0)
print(os.read(read, 100).decode())
"""


def _copied_mb(mode: str) -> float:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return float(done.stdout.strip())


def test_a_full_collection_in_the_child_copies_nothing_frozen() -> None:
    unfrozen, frozen = _copied_mb("plain"), _copied_mb("freeze")
    assert unfrozen > 20  # the collector wrote into every object's header: their pages were copied
    assert frozen < unfrozen / 4
