"""Clean stops: a peer, a bootstrap or the demo stopped with SIGTERM or SIGINT prints no traceback.

What a user reads last is the end of the console. hivemind's shutdown of its averager printed there
(see `RunAverager._shutdown` in peers/averager.py): after a SIGTERM to the whole process group p2pd is
gone before the averager unregisters its handlers from it (a traceback from the averager's thread), and
an averager that exits while the DHT process has yet to read its last requests leaves the DHT failing
to read them (a traceback, or a DHT process that dies). The first two tests take each case alone,
in-process; the others stop whole processes through the CLI, every way a user does:

- a service manager's stop: SIGTERM to the peer's whole process group (p2pd and hivemind's processes too);
- `kill -INT PID`: SIGINT to the peer alone;
- Ctrl-C in the bootstrap's terminal: SIGINT to its whole process group;
- the demo stopped with SIGTERM, which stops its bootstrap and peers with SIGTERM to each of them alone
  (Ctrl-C of the demo: tests/test_demo.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from peers.group import AveragingSettings, GroupAverager
from peers.node import Node, NodeSettings
from tests.harness import FAST, REPO, Swarm, wait_for

pytestmark = pytest.mark.integration

NOISE = ("Traceback", "Exception ignored")


@pytest.fixture
def stderr(capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], str]]:
    """What the test and the processes it forks write to stderr, as they would on a console: `sys.stderr`
    writes each line straight to fd 2 (a forked process ends without flushing it). The test calls
    `_print_thread_tracebacks` too."""
    stream = open(os.dup(2), "w", buffering=1)  # noqa: SIM115 (closed below)
    monkeypatch.setattr(sys, "stderr", stream)
    yield lambda: capfd.readouterr().err
    stream.close()


def _print_thread_tracebacks() -> None:
    """Python's own hook, which prints a thread's traceback: pytest keeps them to itself during a test
    (and puts its own hook back after it)."""
    threading.excepthook = threading.__excepthook__


def _quiet(name: str, output: str) -> None:
    for word in NOISE:
        assert word not in output, f"{name} printed {word!r}:\n{output[-4000:]}"


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _gone(pid: int) -> bool:
    try:
        return not Path(f"/proc/{pid}/cmdline").read_bytes()  # a zombie has no command line
    except FileNotFoundError:
        return True


def _kill_groups_of(text: str) -> None:
    """SIGKILL the process groups of every process whose command line mentions `text`."""
    ours = os.getpgid(0)
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or text not in (entry / "cmdline").read_bytes().decode(
                errors="replace"
            ):
                continue
            if (group := os.getpgid(int(entry.name))) != ours:
                os.killpg(group, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def _averager(node: Node) -> GroupAverager:
    template = [torch.zeros(1000)]
    options = AveragingSettings(request_timeout=1.0, min_matchmaking_time=2.0, matchmaking_timeout=5.0)
    group = GroupAverager(node, template, options, state_provider=lambda: (b"", template))
    group.start()
    return group


def test_averager_stopped_with_dht_requests_in_flight(stderr: Callable[[], str]) -> None:
    """The averager stops right after it asked the DHT for state donors and a group: the DHT process
    reads those requests before the averager is gone (without that, most such stops made it fail). Also
    no averager hangs on a download task collected mid-flight (`StateDonors._download_state`)."""
    _print_thread_tracebacks()
    node = Node(NodeSettings(run_id="cleanstop", host="127.0.0.1"))
    node.start()
    try:
        for _ in range(4):
            group = _averager(node)
            time.sleep(0.3)
            for _ in range(3):
                group.averager.download_state(exclude=[], min_step=0, max_elements=10**6, timeout=2)
            group.averager.step(gather=b"", wait=False, timeout=5)
            time.sleep(0.01)
            group.stop()
            assert node.dht is not None and node.dht.is_alive()
        started = time.monotonic()
        node.stop()
        assert time.monotonic() - started < 3, (
            "the DHT process was held up reading requests of a gone averager"
        )
    finally:
        node.stop()
    _quiet("the averager or the DHT", stderr())


def test_averager_stops_quietly_once_p2pd_is_gone(stderr: Callable[[], str]) -> None:
    """As after a SIGTERM to the whole process group: p2pd (the DHT process's child) has exited first."""
    _print_thread_tracebacks()
    node = Node(NodeSettings(run_id="cleanstop", host="127.0.0.1"))
    node.start()
    try:
        group = _averager(node)
        assert node.dht is not None and node.dht.pid is not None
        (p2pd,) = _children(node.dht.pid)
        os.kill(p2pd, signal.SIGTERM)
        wait_for("p2pd to exit", lambda: _gone(p2pd), 10, 0.05)
        started = time.monotonic()
        group.stop()
        assert time.monotonic() - started < 3
    finally:
        # The DHT process's own shutdown waits for the p2pd it lost (hivemind), until the host kills it.
        if node.dht is not None and node.dht.pid is not None:
            os.kill(node.dht.pid, signal.SIGKILL)
        node.stop()
    _quiet("the averager", stderr())


SLOW_STOP = """
import asyncio, logging, sys, time
from dilocod.node import runtime

def stuck_in_a_cleanup() -> None:
    time.sleep(4)

async def main() -> None:
    stop = asyncio.Event()
    runtime.install_stop_signals(stop)
    print("ready", flush=True)
    await stop.wait()
    stuck_in_a_cleanup()

logging.basicConfig(level=logging.INFO)
runtime.SLOW_STOP_SECONDS = 1.0
asyncio.run(main())
"""


def test_a_stop_that_hangs_says_where_each_thread_is() -> None:
    """A stop still running after `SLOW_STOP_SECONDS` prints every thread's stack (from a thread of its
    own: the event loop may be the one stuck) and goes on."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_STOP], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "received SIGTERM, shutting down" in err and "still stopping after 1 s" in err, err
    assert "in stuck_in_a_cleanup" in err, err


def test_peers_and_bootstrap_stop_without_a_traceback(swarm: Callable[..., Swarm]) -> None:
    s = swarm(2)
    s.wait_all_at(1, timeout=120)
    assert s.bootstrap is not None and s.bootstrap.popen is not None
    by_manager, by_kill = s.peers
    assert by_manager.popen is not None
    os.killpg(by_manager.popen.pid, signal.SIGTERM)  # systemd's stop: p2pd gets it too, and exits
    by_kill.signal(signal.SIGINT)  # kill -INT PID
    os.killpg(s.bootstrap.popen.pid, signal.SIGINT)  # Ctrl-C in its terminal (p2pd ignores SIGINT)
    # SIGINT is a stop like SIGTERM: exit code 0 (130 is for a second signal, which skips the cleanup).
    assert by_manager.wait(timeout=60) == 0
    assert by_kill.wait(timeout=60) == 0
    assert s.bootstrap.wait(timeout=60) == 0
    for proc in (by_manager, by_kill, s.bootstrap):
        output = proc.output()
        assert "shutting down" in output, output[-2000:]
        _quiet(proc.name, output)


def test_demo_stops_on_sigterm_without_a_traceback(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo"
    out = tmp_path / "demo.out"
    sets = [item for o in FAST for item in ("--set", o)]
    with out.open("wb") as sink:
        demo = subprocess.Popen(
            [sys.executable, "-m", "dilocod", "demo", "--peers", "2", "--http-port", "0", "--run-dir", str(run_dir), *sets],
            stdout=sink, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )  # fmt: skip
    try:
        wait_for(
            "the demo's first outer round", lambda: "first outer round completed" in out.read_text(), 120
        )
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(timeout=60) == 0
    finally:
        _kill_groups_of(str(run_dir))  # the demo's children have sessions of their own; the demo's too
    logs = {"demo": out, "bootstrap": run_dir / "bootstrap.log"}
    logs |= {f"peer-{i}": run_dir / f"peer-{i}" / "console.log" for i in range(2)}
    for name, path in logs.items():
        _quiet(name, path.read_text(errors="replace"))
    assert "stopping the swarm" in out.read_text()


# ---------------------------------------------------------------- a round given up mid-exchange


class _Step:
    def __init__(self, cancelled: bool) -> None:
        self._cancelled = cancelled

    def cancelled(self) -> bool:
        return self._cancelled


@pytest.mark.parametrize("cancelled", [True, False])
def test_a_cancelled_rounds_late_result_is_dropped_quietly(
    cancelled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hivemind sets a round's result on its step future even when the driver cancelled the step meanwhile;
    the mpfuture raises concurrent.futures' InvalidStateError, which hivemind's `_step` lets out (a
    traceback in the log). `RunAverager._step` drops it for a cancelled step, and only then."""
    import asyncio
    import concurrent.futures

    from hivemind.averaging import averager as averager_module

    from peers.averager import RunAverager

    async def late_result(self: object, *, step: _Step, future_for_init: object) -> None:
        raise concurrent.futures.InvalidStateError("Can't set_result to a future that is CANCELLED")

    monkeypatch.setattr(averager_module.DecentralizedAverager, "_step", late_result)
    # No processes: only the method is under test (and an averager never started has nothing to delete).
    monkeypatch.setattr(averager_module.DecentralizedAverager, "__del__", lambda self: None)
    averager = RunAverager.__new__(RunAverager)

    async def outcome() -> str:
        try:
            await averager._step(step=_Step(cancelled), future_for_init=None)  # type: ignore[arg-type]
        except concurrent.futures.InvalidStateError:
            return "raised"
        return "dropped"

    assert asyncio.run(outcome()) == ("dropped" if cancelled else "raised")
