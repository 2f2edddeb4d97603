"""dilocod daemons on the namespace test bed: `NetSwarm` is `Swarm` (tests/harness.py) placed in a `NetBed`.

The bootstrap runs in the public host `pub`, each peer in a host the test made (`add_nat`, `add_public`),
all started through the real CLI (`python -m dilocod …`) by `bed.run`. A daemon's HTTP API listens on
its own namespace's loopback, which only a process inside that namespace can reach, so status is read
by a one-line stdlib client run there (`bed.call`). Start, stop and reap are Swarm's; whatever a daemon
leaves behind in a namespace (p2pd leaves its process group) is killed by the bed's teardown, which
finds processes by namespace. Used by tests/test_wan.py; bench/goodput.py uses the bed directly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tests.harness import FAST, REPO, Proc, Swarm, round_hashes  # noqa: F401  (re-exported)
from tests.netbed import NetBed, _ns_pids

# Peers behind a NAT cannot be reached, so for now they are told so (client mode). Once reachability
# is detected automatically, this goes and NATed peers run with the defaults.
NAT_PEER: tuple[str, ...] = ("net.reachability=private",)

# Read a URL from inside a namespace: stdlib only (-I -S), so it starts in a few tens of ms.
_FETCH = (
    "import sys, urllib.request as u; sys.stdout.write(u.urlopen(sys.argv[1], timeout=5).read().decode())"
)


def fetch_in(bed: NetBed, host: str) -> Callable[[str], Any]:
    """A `get_json` that runs inside `host`'s namespace."""

    def fetch(url: str) -> Any:
        return json.loads(bed.call(host, [sys.executable, "-I", "-S", "-c", _FETCH, url], timeout=15).stdout)

    return fetch


def spawn_in(bed: NetBed, host: str) -> Callable[[list[str], IO[bytes]], subprocess.Popen[bytes]]:
    """A harness `Spawn` that starts the process inside `host` (its own session, reaped by the bed too)."""

    def spawn(argv: list[str], log: IO[bytes]) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        return bed.run(host, argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)

    return spawn


@dataclass
class NetSwarm(Swarm):
    """A Swarm whose processes live in bed hosts: `start_bootstrap()` in `pub`, `add_peer(where=host)`."""

    bed: NetBed = field(kw_only=True)
    poll_interval: float = 2.0  # every status poll starts a process in the namespace
    placement: dict[str, str] = field(default_factory=dict)  # process name → bed host

    def _listen_host(self, where: str | None) -> str:
        return self.bed.addr(where or "pub")

    def _proc(
        self, name: str, args: list[str], log: Path, http_port: int, run_dir: Path | None, where: str | None
    ) -> Proc:
        if where is None and name != "bootstrap":
            raise ValueError(f"{name}: say in which bed host it runs (where=...)")
        host = where or "pub"
        self.placement[name] = host
        return Proc(
            name,
            args,
            log,
            http_port,
            run_dir,
            spawn=spawn_in(self.bed, host),
            fetch=fetch_in(self.bed, host),
        )

    def where(self, proc: Proc) -> str:
        return self.placement[proc.name]


def make_net_swarm(bed: NetBed, root: Path, *extra: str) -> NetSwarm:
    """Tiny preset, the harness's fast settings plus `extra` (`section.key=value`) for every process."""
    return NetSwarm(root, overrides=(*FAST, *extra), bed=bed)


def describe(pids: list[int]) -> list[str]:
    """`pid: command line` of each live pid (for assertion messages)."""
    out = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out.append(f"{pid}: {cmd.strip()[:200]}")
    return out


def descendants(pid: int) -> list[int]:
    """Every live process whose parent chain leads to `pid` (from /proc; orphans re-parented are lost)."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children[ppid].append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def sigterm_and_survivors(swarm: NetSwarm, proc: Proc, timeout: float = 30.0) -> list[str]:
    """SIGTERM a daemon, expect exit 0 within `timeout`; return what it left running (see `survivors`)."""
    assert proc.popen is not None
    tree = descendants(proc.popen.pid)
    assert tree, f"{proc.name} has no child processes: nothing to check ({proc.output()[-2000:]})"
    proc.signal(signal.SIGTERM)
    code = proc.wait(timeout=timeout)
    assert code == 0, f"{proc.name} exited with {code} after SIGTERM:\n{proc.output()[-3000:]}"
    return survivors(swarm, proc, tree)


def survivors(swarm: NetSwarm, proc: Proc, tree: list[int], settle: float = 3.0) -> list[str]:
    """After `proc` exited: its former descendants `tree` and anything else in its namespace still alive.

    Its namespace holds only that daemon and what it started (p2pd, hivemind's DHT and averager
    processes), so a live pid there after `settle` seconds is an orphan, wherever it was re-parented.
    Both sets are given the same `settle`: a child caught mid-exit (its memory already released, so an
    empty command line) is not an orphan.
    """
    namespace = swarm.bed.ns(swarm.where(proc))
    born = {pid: _started(pid) for pid in tree}  # a pid reused by an unrelated process is not ours

    def live() -> list[int]:
        theirs = {p for p, start in born.items() if start is not None and _started(p) == start}
        return sorted(p for p in set(_ns_pids([namespace])) | theirs if _alive(p))

    deadline = time.monotonic() + settle
    while (left := live()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return describe(left)


def _started(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None if gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    """Running or sleeping, not a zombie waiting to be reaped (a container's PID 1 may never reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
