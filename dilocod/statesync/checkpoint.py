"""Atomic checkpoints in the run directory: everything a peer needs to resume where it stopped."""

from __future__ import annotations

import os
import pickle
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

FORMAT = "dilocod-checkpoint"
VERSION = 1
FILENAME = "checkpoint.pt"


class CheckpointError(Exception):
    """An unreadable or foreign checkpoint; the message is one line and the file is left untouched."""


def checkpoint_path(run_dir: Path) -> Path:
    return run_dir / FILENAME


def save_checkpoint(run_dir: Path, state: dict[str, Any]) -> Path:
    """Write `state` so that a crash at any moment leaves either the old or the new file, never half."""
    run_dir.mkdir(parents=True, exist_ok=True)
    target = checkpoint_path(run_dir)
    fd, tmp_name = tempfile.mkstemp(prefix=".checkpoint-", suffix=".tmp", dir=run_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"format": FORMAT, "version": VERSION, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, target)
        _fsync_dir(run_dir)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return target


def load_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """The saved state, or None if this run directory has none yet."""
    path = checkpoint_path(run_dir)
    if not path.exists():
        return None
    try:
        # weights_only: a checkpoint file must never be able to run code.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # torch's own message advises turning weights_only off, which would run whatever the file holds.
        reason = "not a dilocod checkpoint, or it holds objects other than tensors and plain data"
        raise CheckpointError(
            f"checkpoint {path} is unreadable ({reason}); move it away to start fresh"
        ) from None
    except Exception as e:
        reason = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip().split("\n")[0][:200] or type(e).__name__
        raise CheckpointError(
            f"checkpoint {path} is unreadable ({reason}); move it away to start fresh"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a dilocod checkpoint; move it away to start fresh")
    if state.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint {path} has version {state.get('version')}, this dilocod reads {VERSION}"
        )
    return state


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
