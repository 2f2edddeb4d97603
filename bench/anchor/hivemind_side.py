"""The hivemind side of the race: a DHT bootstrap and one worker process per peer (`worker.py`), on loopback.

Each process runs in a session of its own, so that reaping its process group also reaps what hivemind
started under it (the DHT and averager processes, p2pd); `Processes.close` always runs and is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.harness import spawn_local

from .settings import Race

START_TIMEOUT = 300.0  # seconds for every worker to build its trainer and join the DHT (2 cores, busy)


class Processes:
    """The processes started, each the leader of its own process group."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    def start(self, name: str, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            popen = spawn_local(argv, out)  # the harness's: its own session, unbuffered, in the repo
        self.procs.append((name, popen, log))
        return popen

    def check(self, outputs: dict[str, Path]) -> None:
        """Raise if a process has exited, with the end of its log; one that wrote its output file (in
        `outputs`, by name) may have."""
        for name, popen, log in self.procs:
            if not (name in outputs and outputs[name].exists()) and popen.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
                raise RuntimeError(f"hivemind {name} exited with {popen.returncode}:\n{tail}")

    def close(self, grace: float = 5.0) -> None:
        """SIGTERM every group, SIGKILL what is left after `grace` seconds in all (the results are in by
        then, or the run failed: nothing is lost by not waiting longer)."""
        try:
            for _, popen, _ in self.procs:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(popen.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace
            for _, popen, _ in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        finally:  # also when interrupted while waiting
            for _, popen, _ in self.procs:
                # Also when the leader is gone: its children (p2pd) may still be in the group.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(popen.pid, signal.SIGKILL)
            for _, popen, _ in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(timeout=5)


def wait_files(
    paths: list[Path], procs: Processes, timeout: float, what: str, outputs: dict[str, Path] | None = None
) -> None:
    """Wait until every one of `paths` exists; raise if a process dies first or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        procs.check(outputs or {})
        if time.monotonic() > deadline:
            missing = ", ".join(p.name for p in paths if not p.exists())
            raise TimeoutError(f"hivemind side: no {what} after {timeout:.0f}s ({missing})")
        time.sleep(0.2)


def run_hivemind(
    race: Race,
    keys: list[str],
    root: Path,
    *,
    eval_at_steps: int | None,
    matchmaking_time: float,
    averaging_timeout: float,
    request_timeout: float,
    target_batch_size: int,
    verbose: bool = False,
) -> list[dict[str, Any]]:
    """Train `race.peers` hivemind peers for `race.seconds` from a common start; each one's result."""
    directory = root / "hivemind"
    directory.mkdir(parents=True, exist_ok=True)
    worker = [sys.executable, "-m", "bench.anchor.worker"]
    procs = Processes()
    try:
        procs.start("bootstrap", [*worker, "bootstrap", str(directory)], directory / "bootstrap.log")
        wait_files([directory / "bootstrap.maddr"], procs, 60, "bootstrap address")
        race_file = {
            "config": str(race.config),
            "overrides": list(race.overrides),
            "keys": keys,
            "initial_peers": (directory / "bootstrap.maddr").read_text().split(),
            "run_id": "anchor",
            "target_batch_size": target_batch_size,
            "matchmaking_time": matchmaking_time,
            "averaging_timeout": averaging_timeout,
            "request_timeout": request_timeout,
            "verbose": verbose,
            "seconds": race.seconds,
            "eval_at_steps": eval_at_steps,
            "start_timeout": START_TIMEOUT + 60,
        }
        (directory / "race.json").write_text(json.dumps(race_file, indent=1))
        names = [f"peer-{i}" for i in range(race.peers)]
        for i, name in enumerate(names):
            procs.start(name, [*worker, "train", str(directory), str(i)], directory / f"{name}.log")
        wait_files([directory / f"ready-{i}" for i in range(race.peers)], procs, START_TIMEOUT, "ready")
        (directory / "go").touch()  # one start for all: the clock is the same for every peer
        results = [directory / f"result-{i}.json" for i in range(race.peers)]
        # A step can outlast the clock (an averaging round, a state download): bounded by its timeouts.
        limit = race.seconds + 2 * averaging_timeout + 60
        wait_files(results, procs, limit, "result", dict(zip(names, results)))
        return [json.loads(p.read_text()) for p in results]
    finally:
        procs.close()
