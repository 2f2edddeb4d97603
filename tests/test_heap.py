"""The daemon gives freed tensor memory back to the system (peers/heap.py): after each round, a checkpoint
write and an all-reduce."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# 200 tensors of 1 MB (below glibc's mmap threshold once it has risen, so from the heap), the first of
# every pair kept: the freed half stays resident until the heap is trimmed.
PROBE = """
import sys, torch
from peers import heap
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
big = torch.ones(8 << 20, dtype=torch.uint8); del big  # raises glibc's dynamic mmap threshold
tensors = [torch.ones(1 << 18) for _ in range(200)]
del tensors[1::2]
before = rss_mb()
assert heap.trim()
print(before - rss_mb())
"""


def test_trim_gives_freed_tensors_back() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) > 50  # ~100 MB of freed 1 MB tensors; at least half goes back
