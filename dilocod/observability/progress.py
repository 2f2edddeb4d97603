"""The peer's console: one live progress line on a terminal, log records above it.

On a terminal (stderr is a TTY) a running peer shows

    outer 12 │ inner 3 │ loss 3.214 │ eval 3.301 │ 1,234 tok/s │ round closes in ~41s │ share 0.97 │ 2 peers │ training

rewritten in place about once a second, and only warnings reach the console once training started (every
record still goes to `dilocod.log` in the run dir). When stderr is not a terminal (a service, the demo,
the tests) there is no progress line and the console keeps the INFO lines: one per outer round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import shutil
import sys
import threading
import time
from typing import TextIO

from dilocod.observability.peerstate import PeerState, Phase

REFRESH_SECONDS = 1.0
CLEAR = "\r\x1b[K"  # back to column 0, erase to the end of the line


class Console:
    """stderr, shared by log records and a status line kept at the bottom of the terminal."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.line = ""
        self._lock = threading.Lock()  # log records may come from any thread

    @property
    def tty(self) -> bool:
        try:
            return self.stream.isatty()
        except (AttributeError, ValueError):
            return False

    def write_record(self, text: str) -> None:
        """Print a log record above the status line (which is redrawn below it)."""
        with self._lock:
            if self.line:
                self.stream.write(CLEAR + text + "\n" + self.line)
            else:
                self.stream.write(text + "\n")
            self.stream.flush()

    def show(self, line: str) -> None:
        width = shutil.get_terminal_size((120, 24)).columns - 1
        line = line if len(line) <= width else line[: max(0, width - 1)] + "…"
        with self._lock:
            self.line = line
            self.stream.write(CLEAR + line)
            self.stream.flush()

    def clear(self) -> None:
        with self._lock:
            if self.line:
                self.stream.write(CLEAR)
                self.stream.flush()
            self.line = ""


class ConsoleHandler(logging.Handler):
    """A logging handler that writes through `Console`, so records never garble the progress line."""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.console.write_record(self.format(record))
        except Exception:
            self.handleError(record)


_console: Console | None = None
_handler: ConsoleHandler | None = None


def console_handler(stream: TextIO | None = None) -> ConsoleHandler:
    """The process's console handler (made once; `runtime.setup_logging` installs it)."""
    global _console, _handler
    if _handler is None or (stream is not None and stream is not _handler.console.stream):
        _console = Console(stream if stream is not None else sys.stderr)
        _handler = ConsoleHandler(_console)
    return _handler


class StepClock:
    """Seconds per inner step, measured from how fast the inner step counter moves while training."""

    def __init__(self) -> None:
        self.seconds_per_step: float | None = None
        self._last: tuple[float, int] | None = None

    def observe(self, inner_step: int, now: float, training: bool = True) -> None:
        if not training:  # averaging and syncing pauses are not step time
            self._last = None
            return
        if self._last is not None and inner_step > self._last[1]:
            sample = (now - self._last[0]) / (inner_step - self._last[1])
            old = self.seconds_per_step
            self.seconds_per_step = sample if old is None else 0.7 * old + 0.3 * sample
        if self._last is None or inner_step != self._last[1]:
            self._last = (now, inner_step)


def duration(seconds: float) -> str:
    """A short human duration: 42s, 17m, 3.5h."""
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def progress_line(state: PeerState, inner_steps: int, seconds_per_step: float | None) -> str:
    """One line: outer step, inner steps this round, loss, tokens/s, when the run's clock closes the round
    (before it is known: H inner steps at our own pace), the share of our tokens that reached θ_global."""
    loss = state.inner.loss
    parts = [
        f"outer {state.rounds.outer_step}",
        f"inner {state.tokens.round_steps}",
        f"loss {loss:.3f}" if isinstance(loss, float) and math.isfinite(loss) else "loss –",
    ]
    if state.rounds.eval_loss is not None and math.isfinite(state.rounds.eval_loss):
        parts.append(f"eval {state.rounds.eval_loss:.3f}")
    parts.append(
        f"{state.inner.tokens_per_second:,.0f} tok/s" if state.inner.tokens_per_second else "– tok/s"
    )
    closes_in = state.round_closes_in()
    if state.phase is Phase.AVERAGING:
        parts.append("averaging now")
    elif state.phase is Phase.SYNCING:
        parts.append("downloading θ_global")
    elif closes_in is not None:
        parts.append(f"round closes in ~{duration(closes_in)}")
    elif seconds_per_step is not None:
        parts.append(
            f"round closes in ~{duration(max(0, inner_steps - state.tokens.round_steps) * seconds_per_step)}"
        )
    else:
        parts.append("round closes in –")
    share = state.contribution_share
    if share is not None:
        parts.append(f"share {share:.2f}")
    parts.append(f"{state.swarm.peers_known} peer{'s' if state.swarm.peers_known != 1 else ''}")
    parts.append(state.phase.value)
    return " │ ".join(parts)


async def show_progress(state: PeerState, inner_steps: int, stream: TextIO | None = None) -> None:
    """Keep the progress line up to date until cancelled; returns at once when stderr is no terminal."""
    handler = console_handler(stream)
    console = handler.console
    if not console.tty:
        return
    quieted = handler.level == logging.INFO or handler.level == logging.NOTSET
    if quieted:  # from now on the line says what INFO records said; -v keeps them
        handler.setLevel(logging.WARNING)
    clock = StepClock()
    try:
        while True:
            clock.observe(state.inner.inner_step, time.monotonic(), state.phase is Phase.TRAINING)
            console.show(progress_line(state, inner_steps, clock.seconds_per_step))
            await asyncio.sleep(REFRESH_SECONDS)
    finally:
        console.clear()
        if quieted:
            handler.setLevel(logging.INFO)
        with contextlib.suppress(Exception):
            console.stream.flush()
