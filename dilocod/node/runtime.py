"""Process-level plumbing shared by every command: the event loop, signals and logging."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import faulthandler
import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

SPIN_COUNT = "1000"  # see calm_openmp_waits
REPEAT_IS_ECHO_SECONDS = 2.0
SLOW_STOP_SECONDS = 45.0  # a stop still running then prints where each thread is (it goes on)
STOP_GRACE_SECONDS = (
    15.0  # how long a running all-reduce may finish after a stop signal (peers: rounds/exchange.py)
)


async def wait_while(busy: Callable[[], bool], grace: float, poll: float = 0.1) -> bool:
    """Return once `busy()` is false (True) or after `grace` s (False): a stop waits for the round in
    progress, not for the node's long-lived tasks, which end only when cancelled (waiting on those held
    every bootstrap stop that came mid-round for the whole grace)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    while busy():
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(poll)
    return True


def run_main(main: Coroutine[Any, Any, int]) -> int:
    """Run `main` on uvloop when it is installed (faster sockets for HTTP), else asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def calm_openmp_waits() -> None:
    """Make torch's OpenMP threads wait briefly before they sleep (libgomp's GOMP_SPINCOUNT), unless the
    user chose a wait policy. Must run before torch is imported: libgomp reads it once, when loaded.

    Why: libgomp's default keeps a waiting team thread spinning for ~300,000 iterations. When processes
    together run more threads than there are cores, the spinning threads take the cores that the threads
    they wait for need: two processes of 2 threads on 2 cores trained at 649 tokens/s each (tiny, batch 16
    × 128), 45× below their share; with 1,000 spins, 13,400 each, while one process alone keeps its speed
    (31,700-32,100 against 31,300-32,000 with the default)."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)


def leave_cores_to_training() -> None:
    """From now on, torch work in this thread and in the event loop's default executor runs on one core, so
    that the trainer's thread alone runs torch's OpenMP team. Call it first thing in a training daemon's
    event loop, before any tensor work there.

    Why: every long-lived thread that once ran a parallel torch op keeps an OpenMP team of its own, and
    once the process holds more OpenMP threads than the machine has cores, libgomp stops letting idle team
    threads spin and parks them on a futex between parallel regions: the trainer then pays a sleep and a
    wake-up per op. Measured on 2 cores (tiny, batch 16 × 128): a trainer thread beside an event loop thread
    that had run one parallel op trained at 0.90–0.94 of the same thread alone, with ~35,000 voluntary
    context switches per 40 steps against ~5 (docs/benchmarks.md, "Throughput").
    """
    from concurrent.futures import ThreadPoolExecutor

    one_core_here()
    executor = ThreadPoolExecutor(thread_name_prefix="dilocod-side", initializer=one_core_here)
    asyncio.get_running_loop().set_default_executor(executor)


def one_core_here() -> bool:
    """This thread's torch ops run on one core (OpenMP's per-thread setting; torch's global thread count,
    which the trainer's thread uses, is untouched). False where torch does not use libgomp."""
    import torch

    set_threads = _omp_set_num_threads()
    if set_threads is None:
        return False
    torch.get_num_threads()  # torch's per-thread setup first: run later, it would set the count back
    set_threads(1)
    return True


@functools.cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    """libgomp's `omp_set_num_threads`, from the copy torch loaded (its wheels ship one in torch/lib)."""
    import torch

    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    candidates = sorted(Path(torch.__file__).parent.joinpath("lib").glob("libgomp*.so*")) + [
        Path("libgomp.so.1")
    ]
    for candidate in candidates:
        try:
            return ctypes.CDLL(str(candidate)).omp_set_num_threads  # type: ignore[no-any-return]
        except (OSError, AttributeError):
            continue
    return None


def install_stop_signals(stop: asyncio.Event) -> None:
    """SIGINT/SIGTERM set `stop`; a second signal while stopping exits at once."""
    loop = asyncio.get_running_loop()
    first: list[float] = []

    def _on_signal(signum: int) -> None:
        # A signal sent to our whole process group reaches our hivemind children too, and they report it
        # through the same wakeup fd: repeats within a moment are that echo, not a user insisting.
        if first and time.monotonic() - first[0] > REPEAT_IS_ECHO_SECONDS:
            logging.getLogger("dilocod").warning("second signal: exiting without cleanup")
            os._exit(130)
        if not first:
            first.append(time.monotonic())
            logging.getLogger("dilocod").info("received %s, shutting down", signal.Signals(signum).name)
            _report_if_slow(SLOW_STOP_SECONDS)
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, _on_signal, signum)


def _report_if_slow(seconds: float) -> None:
    """A stop still running after `seconds` logs so and prints every thread's stack to stderr: what a user
    (or a test's log tail) needs to say where it hangs. A thread, not the event loop: the loop may be what
    is stuck. The stop goes on; a second signal exits at once."""

    def report() -> None:
        logging.getLogger("dilocod").warning(
            "still stopping after %.0f s; where each thread is (a second signal exits at once):", seconds
        )
        with contextlib.suppress(Exception):  # no usable stderr: nothing to print to
            faulthandler.dump_traceback(file=2, all_threads=True)

    timer = threading.Timer(seconds, report)
    timer.daemon = True  # never what keeps the process alive
    timer.start()


def setup_logging(log_file: Path | None, *, verbose: bool = False) -> None:
    """Our own log lines to stderr and (when a run dir exists) to a file; hivemind's chatter to the file only.

    The console handler is `progress.ConsoleHandler`: on a terminal a peer keeps a progress line under
    the log records and shows only warnings once it trains (see `dilocod.observability.progress`).
    """
    from dilocod.observability.progress import console_handler

    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    root = logging.getLogger()
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    console = console_handler(sys.stderr)
    console.filters.clear()
    console.setFormatter(fmt)
    console.setLevel(logging.DEBUG if verbose else logging.INFO)
    # hivemind logs every failed matchmaking as an error with a traceback: useful in the file, noise on a console.
    # The networking layer's warnings (e.g. records refused for a wrong run.key) are the user's to see too.
    console.addFilter(
        lambda record: (
            record.name.startswith("dilocod")
            or (record.name.startswith("peers") and record.levelno >= logging.WARNING)
        )
    )
    root.addHandler(console)
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_file)
        file_handler.setFormatter(fmt)
        root.addHandler(file_handler)
    # hivemind installs its own handler on its logger; route it through ours instead.
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("nowhere")
    logging.getLogger("hivemind").setLevel(logging.WARNING)
