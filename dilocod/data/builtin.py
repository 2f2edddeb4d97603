"""The built-in corpus: the running Python's standard library sources (no download, on every machine).

What it holds depends on the Python version, so it is prepared like any dataset and pinned by its hash: a
peer on another Python takes the run's copy instead of its own (`dilocod/data/localcopy.py`).
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from dilocod.data.sources import Document

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"})


def _python_files(root: Path) -> list[Path]:
    """The .py files under `root` in sorted relative-path order, skipping hidden and excluded directories."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith(".")]
        found += [Path(dirpath, n) for n in filenames if n.endswith(".py") and not n.startswith(".")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def builtin_documents(max_bytes: int) -> Iterator[Document]:
    """The standard library's UTF-8 .py files as documents (key: the path relative to the library), until
    `max_bytes` of text; the last one is cut to fit, and reading stops there."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    budget = max_bytes
    for path in _python_files(stdlib):
        try:
            data = path.read_bytes()
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not data:
            continue
        if len(data) >= budget:
            cut = data[:budget].decode("utf-8", errors="ignore")
            if cut:
                yield Document(path.relative_to(stdlib).as_posix(), cut)
            return
        budget -= len(data)
        yield Document(path.relative_to(stdlib).as_posix(), text)
