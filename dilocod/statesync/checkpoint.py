"""Atomic checkpoints in the run directory: everything a peer needs to resume where it stopped.

A write goes to a temporary file, is fsynced, and only then replaces `checkpoint.pt`; the one it replaces
is kept as `checkpoint.prev.pt`. So a kill at any moment leaves a whole checkpoint: the new one, the old
one, or (killed between the two renames) the old one under its `prev` name. `open_checkpoint` is how a
peer starts: it sweeps a killed write's temporary file, reads the newest whole checkpoint, and moves an
unreadable one aside (never deleting it) with one line saying so, so that a damaged file costs at most a
re-sync from the run, never the start of the daemon.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dilocod.files import atomic_file, temp_prefix

FORMAT = "dilocod-checkpoint"
VERSION = 1
FILENAME = "checkpoint.pt"
PREVIOUS = "checkpoint.prev.pt"
TEMP_PREFIX = temp_prefix(Path(FILENAME))


@dataclass(frozen=True)
class CheckpointConfig:
    """`[checkpoint]`: how often this machine writes its state to the run directory."""

    # seconds between checkpoints, written at the end of a round; 0 = after every round. The first round
    # writes one, and a stop always writes the last. A restart loses at most this long of progress, plus a
    # round; each write costs disk time (~24 bytes per parameter: a 1B peer writes ~24 GB).
    every: float = 300.0

    def validate(self) -> None:
        if not (math.isfinite(self.every) and self.every >= 0):
            raise ValueError(f"checkpoint.every must be >= 0 seconds (0 = every round), got {self.every}")


def checkpoint_due(now: float, last: float | None, every: float) -> bool:
    """Whether a round's end should write a checkpoint: the first always, then once `every` seconds
    have passed since the last one began."""
    return last is None or now - last >= every


class CheckpointError(Exception):
    """An unreadable or foreign checkpoint; the message is one line and the file is left untouched."""


def checkpoint_path(run_dir: Path) -> Path:
    return run_dir / FILENAME


def save_checkpoint(
    run_dir: Path, state: dict[str, Any], serialized: Callable[[], None] | None = None
) -> Path:
    """Write `state` so that a crash at any moment leaves either the old or the new file, never half.
    `serialized()` is called once the tensors have been read (before the slow fsync): from then on the
    caller may change them."""
    target = checkpoint_path(run_dir)
    with atomic_file(target, previous=run_dir / PREVIOUS) as f:
        torch.save({"format": FORMAT, "version": VERSION, **state}, f)
        f.flush()
        if serialized is not None:
            serialized()
    return target


def load_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """The saved state, or None if this run directory has none yet."""
    path = checkpoint_path(run_dir)
    if not path.exists():
        return None
    return read_checkpoint(path)


class UnreadableCheckpoint(CheckpointError):
    """The file is damaged (truncated, garbage, unsafe objects): a peer moves it aside and goes on."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"checkpoint {path} is unreadable ({reason}); move it away to start fresh")
        self.path, self.reason = path, reason


def read_checkpoint(path: Path, *, mmap: bool = False) -> dict[str, Any]:
    """One checkpoint file. UnreadableCheckpoint if damaged; CheckpointError if whole but not one this
    dilocod can use (another format or version: a wrong --run-dir or binary, which the operator decides).
    With `mmap`, the tensors are mapped from the file, not read (a check that reads only the header)."""
    try:
        # weights_only: a checkpoint file must never be able to run code.
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:
        # torch's own message advises turning weights_only off, which would run whatever the file holds.
        reason = "not a dilocod checkpoint, or it holds objects other than tensors and plain data"
        raise UnreadableCheckpoint(path, reason) from None
    except Exception as e:
        reason = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip().split("\n")[0][:200] or type(e).__name__
        raise UnreadableCheckpoint(path, reason) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a dilocod checkpoint; move it away to start fresh")
    if state.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint {path} has version {state.get('version')}, this dilocod reads {VERSION}"
        )
    return state


@dataclass
class Opened:
    """What a peer starts from: the newest whole checkpoint (None: none), and what was done to find it."""

    state: dict[str, Any] | None
    path: Path | None = None
    notes: list[str] = field(default_factory=list)  # one line each, for the log


def open_checkpoint(run_dir: Path) -> Opened:
    """The newest whole checkpoint in `run_dir`, recovering from a killed write or a damaged file.

    Raises CheckpointError only for a whole file this dilocod must not use (another format or version)."""
    opened = Opened(None, notes=_sweep_temporaries(run_dir))
    damaged = False
    for path in _newest_first(run_dir):
        if not path.exists():
            continue
        try:
            opened.state, opened.path = read_checkpoint(path), path
            return opened
        except UnreadableCheckpoint as e:
            aside, damaged = _move_aside(path), True
            opened.notes.append(f"checkpoint {path} is unreadable ({e.reason}); moved to {aside.name}")
    if damaged:
        opened.notes.append(
            "no whole checkpoint left: starting from the run's state, downloaded from its peers"
        )
    return opened


def check_checkpoint(run_dir: Path) -> None:
    """Raise the CheckpointError `open_checkpoint` would (a whole file this dilocod must not use), reading
    no tensor: a peer checks this before it starts its network, and reads the checkpoint after forking
    hivemind's processes, so that they hold no copy of it. A damaged file is left to `open_checkpoint`."""
    for path in _newest_first(run_dir):
        if not path.exists():
            continue
        try:
            read_checkpoint(path, mmap=True)
            return
        except UnreadableCheckpoint:
            continue


def _newest_first(run_dir: Path) -> tuple[Path, Path]:
    """The checkpoint and the one it replaced: where a peer looks for a whole one, in that order."""
    return checkpoint_path(run_dir), run_dir / PREVIOUS


def _sweep_temporaries(run_dir: Path) -> list[str]:
    """Remove what a write killed midway left; the checkpoint it would have replaced is still whole."""
    if not run_dir.is_dir():
        return []
    notes = []
    for tmp in sorted(run_dir.glob(f"{TEMP_PREFIX}*.tmp")):
        tmp.unlink(missing_ok=True)
        notes.append(f"removed {tmp.name}, a checkpoint write that was cut short")
    return notes


def _move_aside(path: Path) -> Path:
    aside = path.with_name(f"{path.name}.bad-{int(time.time())}")
    n = 1
    while aside.exists():
        aside, n = path.with_name(f"{path.name}.bad-{int(time.time())}-{n}"), n + 1
    os.replace(path, aside)
    return aside
