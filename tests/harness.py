"""The one harness for multi-process tests: a bootstrap and peers started through the real CLI.

Every process gets its own session (process group) so that reaping it also reaps what it spawned
(hivemind's DHT and averager processes, p2pd). `Swarm.close` always runs, from the fixture.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

from dilocod.node.demo import free_port

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")

# A tiny, fast configuration: H=5 inner steps of 8×64 tokens, short deadlines, frequent status records.
# No trainer.threads: as on a user's machine, every peer takes its share of the cores by itself
# (dilocod/node/coreshare.py).
FAST = (
    "trainer.inner_steps=5",
    "trainer.batch_size=8",
    "trainer.seq_len=64",
    "trainer.warmup_steps=5",
    "trainer.eval_batches=2",
    "averaging.min_matchmaking_time=1.5",
    "averaging.request_timeout=1",
    "averaging.matchmaking_timeout=8",
    "averaging.allreduce_timeout=20",
    "averaging.state_timeout=20",
    "net.status_interval=1",
)


def get_json(url: str, timeout: float = 3.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def get_text(url: str, timeout: float = 3.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return str(response.read().decode())


def round_hashes(statuses: list[dict[str, Any]]) -> dict[int, set[str]]:
    """outer step → the θ_global hashes the peers report holding after it (averaged or re-synced rounds)."""
    by_step: dict[int, set[str]] = {}
    for status in statuses:
        for entry in status["rounds"]:
            if entry["result"] in ("ok", "resynced", "caught_up"):
                by_step.setdefault(entry["outer_step"], set()).add(entry["global_sha256"])
    return by_step


def round_results(statuses: list[dict[str, Any]]) -> str:
    """Each peer's rounds as `step:result/group size`, one line per peer (for assertion messages)."""
    return "\n".join(
        f"{st['peer_id'][-6:]}: "
        + " ".join(f"{e['outer_step']}:{e['result']}/{e['group_size']}" for e in st["rounds"])
        for st in statuses
    )


def _latest_evaluated(status: dict[str, Any]) -> bool:
    """Whether the record of the peer's latest outer step, if it made one, holds its eval loss."""
    latest = [
        e
        for e in status["rounds"]
        if e["outer_step"] == status["outer_step"] and e["result"] in ("ok", "alone")
    ]
    return all(e["eval_loss"] is not None for e in latest)


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, interval: float = 0.5) -> T:
    """Poll `probe` until it returns something truthy; fail the test with `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = probe()
            if value:
                return value
        except Exception as e:  # the process may not be serving yet
            last_error = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last_error!r})")


# How a process is started: argv and its log file in, a Popen of its own session out.
Spawn = Callable[[list[str], IO[bytes]], "subprocess.Popen[bytes]"]


def spawn_local(argv: list[str], log: IO[bytes]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@dataclass
class Proc:
    name: str
    args: list[str]
    log: Path
    http_port: int | None
    run_dir: Path | None = None
    popen: subprocess.Popen[bytes] | None = None
    # Where it runs and how its HTTP API is read: here on loopback by default; tests/wanrun.py puts
    # processes in network namespaces, whose loopback only a process inside can reach.
    spawn: Spawn = spawn_local
    fetch: Callable[[str], Any] = get_json
    _throttled: threading.Event | None = None  # set: the throttle thread stops and leaves it running

    def throttle(self, share: float, period: float = 0.2) -> None:
        """Run the daemon's main process (its trainer) only `share` of the time, as a slower machine: it is
        stopped for the rest of every `period` (its averager process and p2pd run on, as a network would)."""
        assert self.popen is not None and 0 < share < 1
        stop = self._throttled = threading.Event()
        pid = self.popen.pid

        def duty_cycle() -> None:
            try:
                while not stop.is_set():
                    os.kill(pid, signal.SIGSTOP)
                    stop.wait((1 - share) * period)
                    os.kill(pid, signal.SIGCONT)
                    stop.wait(share * period)
            except ProcessLookupError:
                return
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

        threading.Thread(target=duty_cycle, name=f"throttle-{self.name}", daemon=True).start()

    def unthrottle(self) -> None:
        if self._throttled is not None:
            self._throttled.set()
            self._throttled = None
            time.sleep(0.05)  # the thread's last SIGCONT
            if self.popen is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.popen.pid, signal.SIGCONT)

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            self.popen = self.spawn([sys.executable, "-m", "dilocod", *self.args], log)

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def status(self) -> dict[str, Any]:
        return dict(self.fetch(f"http://127.0.0.1:{self.http_port}/api/status"))

    def signal(self, signum: int) -> None:
        assert self.popen is not None
        self.popen.send_signal(signum)

    def wait(self, timeout: float) -> int:
        assert self.popen is not None
        return self.popen.wait(timeout=timeout)

    def reap(self) -> None:
        """Kill the whole process group (p2pd and hivemind children included)."""
        if self.popen is None:
            return
        if self._throttled is not None:  # a failed test may leave its duty cycle running: stop it first
            self._throttled.set()
            self._throttled = None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM, a wait of at most `timeout` s for it to exit, then reap what is left."""
        if self.alive:
            self.signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(timeout=timeout)
        self.reap()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


# Every swarm made during the current test (cleared before each by conftest): a failed test shows their
# processes' log tails, however the test made them.
SWARMS_OF_THIS_TEST: list[Swarm] = []


@dataclass
class Swarm:
    root: Path
    overrides: tuple[str, ...] = FAST
    bootstrap: Proc | None = None
    maddr: str = ""
    peers: list[Proc] = field(default_factory=list)
    # Between status polls in the wait_* helpers: a test waits at most this long past the moment it waits for.
    poll_interval: float = 0.25
    config: Path = REPO / "configs" / "tiny.toml"  # every process's --config (the bootstrap's too)

    def __post_init__(self) -> None:
        SWARMS_OF_THIS_TEST.append(self)

    # Placement hooks: loopback here; tests/wanrun.py's NetSwarm overrides them for namespaces.
    def _listen_host(self, where: str | None) -> str:
        """The address a process placed at `where` listens on for p2p."""
        return "127.0.0.1"

    def _proc(
        self, name: str, args: list[str], log: Path, http_port: int, run_dir: Path | None, where: str | None
    ) -> Proc:
        return Proc(name, args, log, http_port, run_dir)

    def start_bootstrap(self, run_id: str = "dilocod", *extra_args: str, where: str | None = None) -> str:
        maddr_file = self.root / "bootstrap.maddr"
        port = free_port()
        # The bootstrap reduces for the run, so it gets the peers' config and overrides too.
        sets = [item for o in self.overrides for item in ("--set", o)]
        self.bootstrap = self._proc(
            "bootstrap",
            ["bootstrap", "--host", self._listen_host(where), "--port", "0", "--http-host", "127.0.0.1",
             "--http-port", str(port), "--run-id", run_id, "--maddr-file", str(maddr_file),
             "--config", str(self.config), *sets, *extra_args],
            self.root / "bootstrap.log",
            port,
            None,
            where,
        )  # fmt: skip
        self.bootstrap.start()

        def maddrs() -> str | None:
            return maddr_file.read_text() if maddr_file.exists() else None

        text = wait_for("the bootstrap's maddr file", maddrs, 60, interval=0.1)  # the peers start after it
        self.maddr = text.split()[0]
        return self.maddr

    def add_peer(
        self,
        *extra: str,
        start: bool = True,
        identity: Path | None = None,
        where: str | None = None,
        bare: bool = False,
        initial: list[str] | None = None,
    ) -> Proc:
        """A `dilocod join` peer; `identity` (a key file) pins its peer ID, so its data shard too. A `bare`
        peer is given no config and none of the swarm's overrides (only `extra`): it takes the run's
        manifest from the bootstrap, as `dilocod join <maddr>` does. `initial`: the peers it is given
        (default: the bootstrap)."""
        index = len(self.peers)
        run_dir = self.root / f"peer-{index}"
        if identity is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(identity, run_dir / "identity.key")
        port = free_port()
        sets = [item for o in ((*self.overrides, *extra) if not bare else extra) for item in ("--set", o)]
        config = [] if bare else ["--config", str(self.config)]
        if initial is None:
            initial = [self.maddr] if self.maddr else []
        peer = self._proc(
            f"peer-{index}",
            ["join", *initial, *config, "--run-dir", str(run_dir),
             "--host", self._listen_host(where), "--http-port", str(port), *sets],
            run_dir / "console.log",
            port,
            run_dir,
            where,
        )  # fmt: skip
        self.peers.append(peer)
        if start:
            peer.start()
        return peer

    def wait_serving(self, proc: Proc, timeout: float = 90) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            assert proc.alive, f"{proc.name} exited:\n{proc.output()[-3000:]}"
            status = proc.status()
            return status if status.get("phase") != "starting" else None

        return wait_for(f"{proc.name} to serve /api/status", probe, timeout, self.poll_interval)

    def wait_all_at(
        self, step: int, timeout: float, peers: list[Proc] | None = None, evaluated: bool = False
    ) -> list[dict[str, Any]]:
        """Statuses once every peer is at `step` or later. With `evaluated`, also once the eval loss of
        each peer's latest outer step is in its record (a step is recorded before it is evaluated)."""
        group = peers if peers is not None else self.peers

        def probe() -> list[dict[str, Any]] | None:
            for proc in group:
                assert proc.alive, f"{proc.name} exited:\n{proc.output()[-3000:]}"
            statuses = [proc.status() for proc in group]
            if not all(s["outer_step"] >= step for s in statuses):
                return None
            return statuses if not evaluated or all(map(_latest_evaluated, statuses)) else None

        return wait_for(f"all peers at outer step {step}", probe, timeout, self.poll_interval)

    def log_tails(self, chars: int = 3000) -> str:
        """The end of every process's console log, for a failing test's message."""
        procs = [*([self.bootstrap] if self.bootstrap else []), *self.peers]
        return "\n".join(f"--- {p.name} ---\n{p.output()[-chars:]}" for p in procs)

    def close(self) -> None:
        procs = [*self.peers, *([self.bootstrap] if self.bootstrap else [])]
        for proc in procs:
            proc.unthrottle()  # a stopped process would not act on SIGTERM
        for proc in procs:
            if proc.alive:
                proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in procs:
            if proc.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        for proc in procs:
            proc.reap()


def start_swarm(root: Path, peers: int, overrides: tuple[str, ...] = FAST) -> Swarm:
    """A bootstrap and `peers` peers, started (all reaped if one fails to start): for benchmarks."""
    s = Swarm(root, overrides=overrides)
    try:
        s.start_bootstrap()
        for _ in range(peers):
            s.add_peer()
    except BaseException:
        s.close()
        raise
    return s
