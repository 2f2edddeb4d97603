"""The daemon caps glibc's malloc arenas: threads that allocate share two arenas instead of one each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dilocod.node.memory import cap_malloc_arenas

REPO = Path(__file__).resolve().parent.parent

# Six threads allocate and free 40 KB buffers (below glibc's mmap threshold, so from an arena) at once;
# then the process counts the heaps glibc made for extra arenas: anonymous mappings that start on a
# 64 MiB boundary (HEAP_MAX_SIZE on 64-bit).
PROBE = """
import sys, threading
if sys.argv[1] == "cap":
    from dilocod.node.memory import cap_malloc_arenas
    assert cap_malloc_arenas()
barrier = threading.Barrier(6)
def work():
    barrier.wait()
    for _ in range(2000):
        kept = [bytearray(40_000) for _ in range(4)]
        del kept
threads = [threading.Thread(target=work) for _ in range(6)]
for t in threads: t.start()
for t in threads: t.join()
heaps = set()
for line in open("/proc/self/maps"):
    fields = line.split()
    start = int(fields[0].split("-")[0], 16)
    if len(fields) == 5 and start % (64 << 20) == 0:
        heaps.add(start)
print(len(heaps))
"""


def _extra_arenas(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


def test_threads_share_two_arenas_once_capped() -> None:
    assert _extra_arenas("free") >= 3  # the probe sees arenas: one per allocating thread
    assert _extra_arenas("cap") <= 1  # the main arena and one more


def test_a_users_malloc_arena_max_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert cap_malloc_arenas()
    assert os.environ["MALLOC_ARENA_MAX"] == "8"
