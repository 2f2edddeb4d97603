"""Files that survive a crash: written whole or not at all, and hashed in blocks.

Every file the daemon keeps across restarts (checkpoints, the manifest, the ban list, dataset shards and
their index) is written through `atomic_file`: a temporary file in the same directory, synced, renamed
over the old one, and the directory synced, so that a crash or a power cut at any moment leaves either
the old file or the new one, never half of one. Imports nothing of the daemon: every layer may use it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

BLOCK = 1 << 22  # checkpoints and shards can be gigabytes: hash them 4 MB at a time


def file_sha256(path: Path) -> str:
    """sha256 (hex) of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(BLOCK):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (where the platform lets a directory be synced)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename is still atomic
    finally:
        os.close(fd)


def temp_prefix(path: Path) -> str:
    """How `atomic_file`'s temporary files for `path` begin (they end in `.tmp`): a sweep after a crash
    finds what a cut write left by it."""
    return f".{path.stem}-"


@contextlib.contextmanager
def atomic_file(path: Path, *, previous: Path | None = None) -> Iterator[BinaryIO]:
    """A binary file that becomes `path` when the block ends without an error (and is removed if it
    does not). `previous`: where the file `path` held so far goes, just before the new one takes its place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if previous is not None and path.exists():
            os.replace(path, previous)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: Path, parts: Iterable[bytes | memoryview]) -> str:
    """Write `parts` to `path` through `atomic_file`; the sha256 (hex) of what was written."""
    digest = hashlib.sha256()
    with atomic_file(path) as f:
        for part in parts:
            f.write(part)
            digest.update(part)
    return digest.hexdigest()
