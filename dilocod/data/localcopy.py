"""This machine's copy of a dataset: where it is, whether it is the run's, and the corpus the trainer reads.

- The node that starts a run turns `data.source` into a prepared dataset (`source_dataset`): a prepared
  directory as it is; `builtin` (the running Python's standard library) or text/JSONL/Parquet files prepared
  once into this machine's cache (`machine_cache()`), where later runs find them.
- Every node checks the copy it trains on against the run's index hash (`data.dataset`), and every shard's
  sha256 against the index the first time it opens the copy (a marker records what was verified, so a
  restart does not hash gigabytes again; a file whose size or time changed is hashed again).
- A joining peer's copy may be *partial*: the index, the tokenizer and the eval split, and of the training
  split only the shards of the chunks it trains (fetched as it needs them, dilocod/node/shardfetch.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from dilocod.data.builtin import builtin_documents
from dilocod.data.corpus import Corpus
from dilocod.data.errors import DataError, MissingFile
from dilocod.data.prepare import prepare
from dilocod.data.settings import DataConfig
from dilocod.data.shards import (
    INDEX_FILE,
    TOKENIZER_FILE,
    DatasetIndex,
    TokenStream,
    load_index,
    verify_dataset,
)
from dilocod.data.tokenizer import BYTE, tokenizer_json
from dilocod.files import fsync_dir

VERIFIED_FILE = ".verified.json"


def machine_cache() -> Path:
    """Where this machine keeps datasets it prepared for itself: $DILOCOD_CACHE, else the XDG cache."""
    if os.environ.get("DILOCOD_CACHE"):
        return Path(os.environ["DILOCOD_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dilocod"


def is_prepared(directory: Path) -> bool:
    return (directory / INDEX_FILE).is_file() and (directory / TOKENIZER_FILE).is_file()


def source_dataset(cfg: DataConfig) -> Path:
    """The prepared dataset directory `data.source` names, prepared into the machine's cache if it is not
    one (once: a later call finds it there)."""
    if cfg.source == "builtin":
        return _prepared_once(_builtin_dir(cfg), lambda out: _prepare_builtin(cfg, out))
    path = Path(cfg.source).expanduser()
    if not path.exists():
        raise DataError(f"data.source {cfg.source!r}: no such file or directory")
    if path.is_dir() and (path / INDEX_FILE).exists():
        return path.resolve()
    key = hashlib.sha256(
        json.dumps(
            [str(path.resolve()), hashlib.sha256(tokenizer_json(cfg.tokenizer)).hexdigest(), cfg.text_field,
             cfg.eval_fraction]
        ).encode()
    ).hexdigest()[:16]  # fmt: skip
    where = machine_cache() / "prepared" / f"{path.name}-{key}"
    return _prepared_once(where, lambda out: _prepare_source(cfg, path, out))


def _prepare_builtin(cfg: DataConfig, out: Path) -> None:
    prepare(
        [], BYTE, out, eval_fraction=cfg.eval_fraction, progress=False,
        documents=lambda: builtin_documents(cfg.max_bytes),
    )  # fmt: skip


def _prepare_source(cfg: DataConfig, path: Path, out: Path) -> None:
    prepare([path], cfg.tokenizer, out, text_field=cfg.text_field, eval_fraction=cfg.eval_fraction)


def _prepared_once(where: Path, make: object) -> Path:
    """`where` once it holds a finished dataset: made by `make(tmp)` in a fresh directory beside it, then
    renamed into place (several processes starting at once each make one; the first rename wins)."""
    if is_prepared(where):
        return where
    where.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{where.name}-", dir=where.parent))
    try:
        make(tmp)  # type: ignore[operator]
        try:
            os.rename(tmp, where)
            fsync_dir(where.parent)
        except OSError:
            if not is_prepared(where):  # not another process's finished copy: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return where


def open_dataset(directory: Path, expected: str = "", *, partial: bool = False) -> DatasetIndex:
    """The index of the dataset in `directory`, checked to be `expected` (the run's index hash, when given)
    and its files against the index; DataError naming the file and the hashes otherwise (MissingFile for a
    file that is not there). With `partial`, shards of the training split may be missing."""
    index = load_index(directory)
    if expected and index.hash != expected:
        raise DataError(f"{directory / INDEX_FILE}: dataset {index.hash} is not the run's {expected}")
    _verify_once(directory, index, partial)
    return index


def missing_train_shards(directory: Path, index: DatasetIndex) -> list[int]:
    """Numbers of the training split's shards not in `directory` (a partial copy's)."""
    return [n for n, info in enumerate(index.train.shards) if not (directory / info.file).is_file()]


def _file_marks(directory: Path, index: DatasetIndex, partial: bool) -> dict[str, list[int]]:
    marks = {}
    optional = {info.file for info in index.train.shards} if partial else set()
    for name in [TOKENIZER_FILE, *(info.file for info in index.files())]:
        try:
            st = (directory / name).stat()
        except FileNotFoundError:
            if name in optional:
                continue
            raise MissingFile(f"{directory / name}: missing (the dataset's index lists it)") from None
        marks[name] = [st.st_size, st.st_mtime_ns]
    return marks


def _verify_once(directory: Path, index: DatasetIndex, partial: bool = False) -> None:
    """Hash every file the first time; again only those whose size or time changed since."""
    marker = directory / VERIFIED_FILE
    marks = _file_marks(directory, index, partial)
    try:
        seen = json.loads(marker.read_text())
    except (OSError, ValueError):
        seen = {}
    if seen.get("index") == index.hash and seen.get("files") == marks:
        return
    verify_dataset(directory, index, only=set(marks))
    with contextlib.suppress(OSError):  # a read-only copy is verified at every start instead
        marker.write_text(json.dumps({"index": index.hash, "files": marks}))


def open_corpus(cfg: DataConfig, *, partial: bool = False) -> Corpus:
    """The corpus of this machine's copy of the run's dataset (`data.path`, checked against `data.dataset`);
    with no path set, the dataset `data.source` gives (tests, benchmarks, a node starting its run). With
    `partial`, training shards may be missing (a joiner fetches them as its chunks need them)."""
    directory = Path(cfg.path).expanduser() if cfg.path else source_dataset(cfg)
    index = open_dataset(directory, cfg.dataset, partial=partial)
    split = index.eval
    per_byte = split.tokens / split.text_bytes if split.text_bytes > 0 else 1.0
    return Corpus(
        train=TokenStream(directory, index, "train"),
        eval=TokenStream(directory, index, "eval"),
        name=f"{directory.name} ({index.hash[:12]})",
        eval_tokens_per_byte=per_byte,
    )


def run_data_dir(cfg: DataConfig, run_dir: Path | None) -> Path | None:
    """Where this machine keeps the run's dataset: `data.path`, else `<run dir>/data`."""
    if cfg.path:
        return Path(cfg.path).expanduser()
    return None if run_dir is None else run_dir / "data"


def find_local_copy(cfg: DataConfig, run_dir: Path | None, *, may_prepare: bool) -> Path | None:
    """A verified copy of the run's dataset (`data.dataset`) on this machine, or None (fetch it).

    `data.path`, when set, is where it is (a copy of another dataset there is refused in one line; an
    empty directory is where it will be fetched to); else
    `<run dir>/data`, then the dataset `data.source` gives on this machine: prepared now when `may_prepare`
    (the node that started the run), else only a builtin corpus already in the machine's cache (a peer on
    the same Python has the run's builtin corpus without a download)."""
    if cfg.path:  # an empty or new directory is where the download goes; another dataset there is refused
        path = Path(cfg.path).expanduser()
        found = (path / INDEX_FILE).exists() and _holds(
            path, cfg.dataset, strict=True, partial=not may_prepare
        )
        return path if found else None
    own = run_data_dir(cfg, run_dir)
    if own is not None and _holds(own, cfg.dataset, strict=False, partial=not may_prepare):
        return own
    if may_prepare:
        directory = source_dataset(cfg)
        return directory if _holds(directory, cfg.dataset, strict=True) else None
    if cfg.source == "builtin":
        cached = _cached_builtin(cfg)
        if cached is not None and _holds(cached, cfg.dataset, strict=False):
            return cached
    return None


def _builtin_dir(cfg: DataConfig) -> Path:
    """Where this machine's builtin corpus is prepared (it differs by Python version and by the cut)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return machine_cache() / "builtin" / f"python{version}-{cfg.max_bytes}-{cfg.eval_fraction}"


def _cached_builtin(cfg: DataConfig) -> Path | None:
    where = _builtin_dir(cfg)
    return where if is_prepared(where) else None


def _is_index_of(directory: Path, expected: str) -> bool:
    """Whether `directory` holds the index of dataset `expected` (a download that stopped half way)."""
    try:
        return (
            bool(expected) and hashlib.sha256((directory / INDEX_FILE).read_bytes()).hexdigest() == expected
        )
    except OSError:
        return False


def _holds(directory: Path, expected: str, *, strict: bool, partial: bool = False) -> bool:
    """Whether `directory` holds the dataset `expected`, verified (with `partial`, its training shards may be
    missing: a joiner fetches them as it needs them). Strict: a directory that holds another dataset, or a
    damaged one, is an error (the user pointed us there); else it is only not the one. A copy of the run's
    dataset that misses files is never an error: the download completes it."""
    if not is_prepared(directory):
        if strict and not _is_index_of(directory, expected):
            raise DataError(f"{directory}: no prepared dataset there (no {INDEX_FILE} and {TOKENIZER_FILE})")
        return False
    try:
        open_dataset(directory, expected, partial=partial)
    except MissingFile:
        return False
    except DataError:
        if strict:
            raise
        return False
    return True
