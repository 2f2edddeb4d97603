"""`dilocod data prepare`'s state file: what a rerun continues from, what marks a finished prepare, and
which directories a prepare may write into."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dilocod.data.errors import DataError
from dilocod.data.preppass import STATE_VERSION, PreparePass
from dilocod.data.prepsplit import REMAINDER_PREFIX, PrepareSettings
from dilocod.data.shards import INDEX_FILE, TOKENIZER_FILE, DatasetIndex, load_index
from dilocod.files import atomic_write

STATE_FILE = ".prepare-state.json"


def save_state(out: Path, state: dict[str, Any]) -> None:
    atomic_write(out / STATE_FILE, [json.dumps(state, sort_keys=True).encode("utf-8")])


def save_pass(out: Path, p: PreparePass) -> None:
    """Save the pass's state: remainders first, then the state file, then drop the remainders it replaced
    (a kill at any point leaves a state file whose remainder files are all there)."""
    state = p.state()
    save_state(out, state)
    drop_remainders(out, keep={split["remainder"]["file"] for split in state["splits"].values()})


def drop_remainders(out: Path, keep: frozenset[str] | set[str] = frozenset()) -> None:
    for path in out.glob(f"{REMAINDER_PREFIX}*.rem"):
        if path.name not in keep:
            path.unlink()


def read_state(out: Path) -> dict[str, Any] | None:
    path = out / STATE_FILE
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_bytes())
    except ValueError:
        return None
    return state if isinstance(state, dict) and state.get("version") == STATE_VERSION else None


def clean(out: Path) -> None:
    """Remove what a prepare writes (only that), for a fresh start in a directory of the same arguments."""
    for pattern in ("train-*.bin", "eval-*.bin", "*.tmp", ".prepare-*.rem", INDEX_FILE, TOKENIZER_FILE):
        for path in out.glob(pattern):
            path.unlink()


def finished(cfg: PrepareSettings, state: dict[str, Any]) -> DatasetIndex | None:
    """The index of a finished prepare of these arguments whose files are all still in place."""
    if not state.get("done"):
        return None
    try:
        index = load_index(cfg.out)
    except DataError:
        return None
    if index.hash != state.get("index") or not (cfg.out / TOKENIZER_FILE).is_file():
        return None
    for info in index.files():
        path = cfg.out / info.file
        if not path.is_file() or path.stat().st_size != info.bytes:
            return None
    return index


def start_state(cfg: PrepareSettings) -> dict[str, Any] | None:
    """The saved state to continue from (None: start afresh); DataError for a directory that is not ours."""
    out = cfg.out
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: exists and is not a directory")
    if not out.exists() or not any(out.iterdir()):
        return None
    state = read_state(out)
    if state is None:
        raise DataError(f"{out}: not empty and holds no prepare; give an empty or new directory")
    if state.get("args") != cfg.args_hash:
        raise DataError(f"{out}: holds a prepare of other arguments; give an empty or new directory")
    return state
