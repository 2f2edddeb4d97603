"""`dilocod demo`: a bootstrap and N peers on loopback, as separate processes, with one progress line."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dilocod.manifest.keys import is_run_wide

DEMO_RUN_ID = "dilocod"
STARTUP_TIMEOUT = 120.0
STOP_TIMEOUT = 30.0


@dataclass(frozen=True)
class DemoArgs:
    peers: int
    config: Path
    overrides: tuple[str, ...]
    http_port: int
    run_dir: Path
    rounds: int = 0


def local_overrides(overrides: Sequence[str]) -> list[str]:
    """The `--set` items that are a machine's own (the run-wide ones are in the bootstrap's manifest)."""
    local = []
    for item in overrides:
        section, _, key = item.partition("=")[0].strip().partition(".")
        if not is_run_wide(section, key):
            local.append(item)
    return local


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a child to bind soon.

    Chosen at random below the kernel's ephemeral range: ports the kernel hands out by itself (p2pd's
    listeners, the source port of every outgoing connection) come from that range, so a port picked
    there can be taken by someone else before our child binds it.
    """
    first_ephemeral = _first_ephemeral_port()
    if first_ephemeral > 12_000:
        for _ in range(64):
            port = random.randrange(10_000, first_ephemeral)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _first_ephemeral_port() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default; other systems differ, and then the fallback above still works


def _spawn(args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        # Own session: the terminal's Ctrl-C reaches only us, and we stop the children in order.
        return subprocess.Popen(
            [sys.executable, "-m", "dilocod", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=2) as response:
        return json.loads(response.read())


class Swarm:
    """The demo's processes, started in order and always reaped (process groups, p2pd included)."""

    def __init__(self, args: DemoArgs) -> None:
        self.args = args
        self.procs: list[subprocess.Popen[bytes]] = []
        self.peer_ports: list[int] = []
        self.http_port = args.http_port or free_port()

    def start_bootstrap(self) -> str:
        maddr_file = self.args.run_dir / "bootstrap.maddr"
        maddr_file.unlink(missing_ok=True)
        self.procs.append(
            _spawn(
                ["bootstrap", "--host", "127.0.0.1", "--port", "0", "--http-host", "127.0.0.1",
                 "--http-port", str(self.http_port), "--run-id", DEMO_RUN_ID, "--maddr-file", str(maddr_file),
                 "--identity", str(self.args.run_dir / "bootstrap.key"), "--config", str(self.args.config),
                 *[item for o in self.args.overrides for item in ("--set", o)]],
                self.args.run_dir / "bootstrap.log",
            )
        )  # fmt: skip
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.procs[0].poll() is not None:
                raise RuntimeError(f"the bootstrap exited; see {self.args.run_dir / 'bootstrap.log'}")
            if maddr_file.exists() and maddr_file.read_text().strip():
                return maddr_file.read_text().split()[0]
            time.sleep(0.2)
        raise RuntimeError("the bootstrap did not start in time")

    def start_peers(self, bootstrap: str) -> None:
        for i in range(self.args.peers):
            port = free_port()
            self.peer_ports.append(port)
            # As a user joins: the bootstrap's address and this machine's own keys; the run's settings come
            # from the bootstrap's manifest (the demo's --config and run-wide --set went to the bootstrap).
            # Each takes its share of the machine's cores by itself (processes/coreshare.py).
            sets = [item for o in local_overrides(self.args.overrides) for item in ("--set", o)]
            run_dir = self.args.run_dir / f"peer-{i}"
            self.procs.append(
                _spawn(
                    ["join", bootstrap, "--run-dir", str(run_dir),
                     "--host", "127.0.0.1", "--http-port", str(port), *sets],
                    run_dir / "console.log",
                )
            )  # fmt: skip

    def statuses(self) -> list[dict[str, Any]]:
        found = []
        for port in self.peer_ports:
            with contextlib.suppress(OSError, ValueError):
                found.append(_get_json(f"http://127.0.0.1:{port}/api/status"))
        return found

    def stop(self) -> None:
        for proc in reversed(self.procs):  # peers first, the bootstrap last
            if proc.poll() is None:  # the main process only: it shuts its own p2pd down in order
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for proc in self.procs:  # anything left in a group (p2pd, averager) goes now
            _signal_group(proc, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)


def _signal_group(proc: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signum)


def progress_line(statuses: list[dict[str, Any]]) -> str:
    if not statuses:
        return "waiting for peers…"
    step = min(s["outer_step"] for s in statuses)
    losses = [s["loss"] for s in statuses if isinstance(s.get("loss"), int | float)]
    tps = sum(s.get("tokens_per_second") or 0 for s in statuses)
    rounds = [s["last_round_seconds"] for s in statuses if s.get("last_round_seconds") is not None]
    loss = f"{sum(losses) / len(losses):.3f}" if losses else "–"
    last = f"{max(rounds):.1f}s" if rounds else "–"
    inner = max(s["round_steps"] for s in statuses)
    ok, failed = (
        sum(s.get("rounds_ok") or 0 for s in statuses),
        sum(s.get("rounds_failed") or 0 for s in statuses),
    )
    trained = sum(s.get("tokens_trained") or 0 for s in statuses)
    reached = sum(s.get("tokens_contributed") or 0 for s in statuses)
    share = f"{100 * reached / trained:.0f}%" if trained else "–"
    return (
        f"outer step {step} | inner {inner} | loss {loss} | {len(statuses)} peers | "
        f"{tps:,.0f} tokens/s | last round {last} | rounds ok/failed {ok}/{failed} | tokens in θ_global {share}"
    )


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def run_demo(args: DemoArgs) -> int:
    # Ctrl-C and SIGTERM both stop the swarm cleanly, even when this process was started with SIGINT
    # ignored (as a background job of a non-interactive shell is).
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    swarm = Swarm(args)
    started = time.monotonic()
    tty = sys.stdout.isatty()
    try:
        bootstrap = swarm.start_bootstrap()
        print(f"bootstrap: {bootstrap}")
        print(
            f"dashboard: http://127.0.0.1:{swarm.http_port}/   run API: http://127.0.0.1:{swarm.http_port}/api/run"
        )
        swarm.start_peers(bootstrap)
        for i, port in enumerate(swarm.peer_ports):
            print(f"peer {i}: http://127.0.0.1:{port}/api/status   logs: {args.run_dir / f'peer-{i}'}")
        print("Ctrl-C stops the swarm.", flush=True)
        return _watch(swarm, args, started, tty)
    except KeyboardInterrupt:
        return 0
    except RuntimeError as e:
        print(f"dilocod: error: {e}", file=sys.stderr)
        return 1
    finally:
        print("\nstopping the swarm…", flush=True)
        swarm.stop()


def _watch(swarm: Swarm, args: DemoArgs, started: float, tty: bool) -> int:
    first_round_reported = False
    last_line = ""
    while True:
        dead = [p for p in swarm.procs if p.poll() is not None]
        if dead:
            print(
                f"\na demo process exited (code {dead[0].returncode}); logs are in {args.run_dir}",
                file=sys.stderr,
            )
            return 1
        statuses = swarm.statuses()
        line = progress_line(statuses)
        reached = min((s["outer_step"] for s in statuses), default=0) if len(statuses) == args.peers else 0
        # The progress line first: whoever reads "first outer round completed" also finds the step it reached.
        if tty:
            print("\r" + line.ljust(110), end="", flush=True)
        elif line != last_line and "inner" in line:
            print(line, flush=True)
        last_line = line
        if reached >= 1 and not first_round_reported:
            first_round_reported = True
            print(f"\nfirst outer round completed {time.monotonic() - started:.1f}s after start", flush=True)
        if args.rounds and reached >= args.rounds:
            print(f"\nreached outer step {args.rounds} in {time.monotonic() - started:.1f}s", flush=True)
            return 0
        time.sleep(1.0)
