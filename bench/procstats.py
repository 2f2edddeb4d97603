"""What a daemon's process tree costs, from /proc: shared by bench/soak.py, bench/hetero.py and
bench/resync_memory.py.

A daemon's tree is the daemon, hivemind's DHT and averager processes (forks of it) and p2pd. Memory is
the proportional set size (PSS): a page the forks share with the daemon counts once in the sum, where
plain RSS would count torch's pages in every fork.
"""

from __future__ import annotations

import os
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    """`pid` and every live descendant."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                ppid = int(_stat_fields(int(entry.name))[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [pid], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name: index 0 is field 3 (state)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _status_field(pid: int, name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return int(line.split()[1])
    return 0


def pss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return _status_field(pid, "VmRSS")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of `pids` so far (those still alive)."""
    ticks = 0
    for pid in pids:
        try:
            fields = _stat_fields(pid)
            ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
        except (OSError, IndexError, ValueError):
            continue
    return ticks / CLOCK_TICKS


def tree_figures(pid: int) -> dict[str, float]:
    """The tree's memory (MB, PSS), open file descriptors, threads, child processes and CPU seconds."""
    pss = fds = threads = 0
    pids = tree(pid)
    for p in pids:
        try:
            pss += pss_kb(p)
            threads += _status_field(p, "Threads")
            fds += len(os.listdir(f"/proc/{p}/fd"))
        except OSError:  # gone meanwhile
            continue
    return {
        "rss_mb": pss / 1024,
        "fds": fds,
        "threads": threads,
        "children": len(pids) - 1,
        "cpu_seconds": cpu_seconds(pids),
    }


def tree_parts(pid: int) -> dict[str, float]:
    """Each process of the tree's memory (MB, PSS), keyed `pid:name`, to tell which one grows."""
    parts: dict[str, float] = {}
    for p in tree(pid):
        try:
            name = Path(f"/proc/{p}/comm").read_text().strip()
            parts[f"{p}:{name}"] = round(pss_kb(p) / 1024, 1)
        except OSError:  # gone meanwhile
            continue
    return parts


def _mapping_kind(name: str) -> str:
    """The kind of a mapping in /proc/PID/smaps by its name ('' for an anonymous one)."""
    if name.startswith("/dev/shm") or "torch_" in name:
        return "shm"  # tensors torch moved to shared memory to pass them to another process
    if name == "[heap]":
        return "heap"
    return "file" if name.startswith("/") else "anon"


def memory_by_kind(pid: int) -> dict[str, float]:
    """One process's PSS in MB by kind of mapping: heap, anon, shm, file."""
    found: dict[str, float] = {}
    current = "anon"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if not fields[0].endswith(":"):  # a mapping's header: address perms offset dev inode [name]
            current = _mapping_kind(fields[5] if len(fields) > 5 else "")
        elif fields[0] == "Pss:":
            found[current] = found.get(current, 0.0) + int(fields[1]) / 1024
    return {k: round(v, 1) for k, v in sorted(found.items())}
