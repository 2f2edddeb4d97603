"""Byte-level corpus loading, the train/eval split, and per-peer data sharding.

Everything here is a pure function of the source files and the config, so every peer of a run
derives the same corpus, the same eval set, and a reproducible stream of batches without any
coordination or on-disk cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

# One NUL byte between documents: it never occurs in ordinary text, so it acts as a dedicated
# end-of-document token (like GPT-2's <|endoftext|>) without leaving the 256-byte vocabulary.
DOC_SEPARATOR = b"\x00"

BUILTIN_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"})


class DataError(Exception):
    """A data source that cannot be used; the message is one line naming the problem."""


@dataclass(frozen=True)
class DataConfig:
    """The ``[data]`` section of the config file."""

    source: str = "builtin"
    text_field: str = "text"
    eval_fraction: float = 0.02
    num_shards: int = 16
    max_bytes: int = 64 * 2**20

    def validate(self) -> None:
        if not self.source:
            raise ValueError("data.source must be 'builtin' or a path")
        if not self.text_field:
            raise ValueError("data.text_field must be a non-empty string")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.num_shards < 1:
            raise ValueError(f"data.num_shards must be >= 1, got {self.num_shards}")
        if self.max_bytes < 2:
            raise ValueError(f"data.max_bytes must be >= 2, got {self.max_bytes}")


@dataclass(frozen=True)
class Corpus:
    """Byte tokens (1-D uint8 CPU tensors) of the training and the held-out evaluation split."""

    train: torch.Tensor
    eval: torch.Tensor
    name: str

    def digest(self) -> str:
        """Short content hash, so peers can check they are training on the same data."""
        h = hashlib.sha256()
        h.update(self.train.numpy().tobytes())
        h.update(b"|")
        h.update(self.eval.numpy().tobytes())
        return h.hexdigest()[:16]


@dataclass(frozen=True)
class _Document:
    key: str  # stable identity used for the train/eval assignment
    data: bytes


# ---------------------------------------------------------------- sources


def _regular_files_under(root: Path, excluded_dirs: frozenset[str]) -> Iterator[Path]:
    """Regular files under ``root`` in sorted (relative path) order, skipping hidden entries."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in excluded_dirs and not d.startswith(".")]
        for name in filenames:
            path = Path(dirpath, name)
            if not name.startswith(".") and path.is_file():
                found.append(path)
    yield from sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _builtin_documents() -> Iterator[_Document]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in _regular_files_under(stdlib, BUILTIN_EXCLUDED_DIRS):
        if path.suffix == ".py":
            data = path.read_bytes()
            if _is_utf8(data):
                yield _Document(path.relative_to(stdlib).as_posix(), data)


def _directory_documents(root: Path) -> Iterator[_Document]:
    for path in _regular_files_under(root, frozenset()):
        data = path.read_bytes()
        if _is_utf8(data):
            yield _Document(path.relative_to(root).as_posix(), data)


def _text_file_documents(path: Path) -> Iterator[_Document]:
    data = path.read_bytes()
    if not _is_utf8(data):
        raise DataError(f"data.source {str(path)!r} is not UTF-8 text")
    yield _Document(path.name, data)


def _jsonl_documents(path: Path, field: str) -> Iterator[_Document]:
    with path.open("rb") as lines:
        for lineno, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(raw)
            except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are both ValueError
                detail = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
                raise DataError(f"{where}: not valid JSON ({detail})") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
            text = record.get(field)
            if not isinstance(text, str):
                raise DataError(f"{where}: missing string field {field!r}")
            yield _Document(f"line {lineno}", text.encode("utf-8"))


def _documents(cfg: DataConfig) -> tuple[str, Iterator[_Document]]:
    """(corpus name, documents in sorted order) for the configured source."""
    if cfg.source == "builtin":
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        return f"builtin:python{version}-stdlib", _builtin_documents()
    path = Path(cfg.source).expanduser()
    if not path.exists():
        raise DataError(f"data.source {cfg.source!r}: no such file or directory")
    if path.is_dir():
        return str(path), _directory_documents(path)
    if not path.is_file():
        raise DataError(f"data.source {cfg.source!r} is neither a regular file nor a directory")
    if path.suffix == ".jsonl":
        return str(path), _jsonl_documents(path, cfg.text_field)
    return str(path), _text_file_documents(path)


# ---------------------------------------------------------------- assembly


def _capped(docs: Iterator[_Document], max_bytes: int) -> list[_Document]:
    """Non-empty documents in order until ``max_bytes`` (separators included) is reached.

    The last document is truncated to fit; reading stops there, so a huge source costs no more
    than the cap.
    """
    kept: list[_Document] = []
    budget = max_bytes
    for doc in docs:
        if not doc.data:
            continue
        cost = len(doc.data) + (len(DOC_SEPARATOR) if kept else 0)
        if cost >= budget:
            room = budget - (len(DOC_SEPARATOR) if kept else 0)
            if room > 0:
                kept.append(_Document(doc.key, doc.data[:room]))
            break
        kept.append(doc)
        budget -= cost
    return kept


def _unit_hash(text: str) -> float:
    """A stable value in [0, 1) for ``text`` (hashlib, so identical across processes and hosts)."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _split_documents(docs: list[_Document], eval_fraction: float) -> tuple[list[bytes], list[bytes]]:
    """Assign whole documents to (train, eval) by hash, guaranteeing both sides are non-empty."""
    if len(docs) == 1:
        data = docs[0].data
        n_eval = min(max(1, round(len(data) * eval_fraction)), len(data) - 1)
        if n_eval < 1:
            raise DataError("corpus is a single byte; need at least two to form train and eval splits")
        return [data[:-n_eval]], [data[-n_eval:]]
    scores = [_unit_hash(doc.key) for doc in docs]
    is_eval = [score < eval_fraction for score in scores]
    if not any(is_eval):
        is_eval[min(range(len(docs)), key=scores.__getitem__)] = True
    if all(is_eval):
        is_eval[max(range(len(docs)), key=scores.__getitem__)] = False
    train = [doc.data for doc, ev in zip(docs, is_eval, strict=True) if not ev]
    evals = [doc.data for doc, ev in zip(docs, is_eval, strict=True) if ev]
    return train, evals


def _to_tokens(parts: list[bytes]) -> torch.Tensor:
    joined = bytearray(DOC_SEPARATOR.join(parts))
    return torch.frombuffer(joined, dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8)


def load_corpus(cfg: DataConfig) -> Corpus:
    """Load, cap and split the configured source. Raises DataError for an unusable source."""
    cfg.validate()
    name, docs = _documents(cfg)
    try:
        kept = _capped(docs, cfg.max_bytes)
    except OSError as exc:
        raise DataError(f"data.source {cfg.source!r}: cannot read ({exc})") from None
    if not kept:
        raise DataError(f"data.source {cfg.source!r}: no text found (corpus is empty)")
    train, evals = _split_documents(kept, cfg.eval_fraction)
    return Corpus(train=_to_tokens(train), eval=_to_tokens(evals), name=name)


# ---------------------------------------------------------------- sampling


def _stable_int(*parts: object) -> int:
    """A 63-bit integer derived from ``parts`` with hashlib (Python's hash() is salted per process)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _at_least(tokens: torch.Tensor, length: int) -> torch.Tensor:
    """``tokens``, cyclically repeated if shorter than ``length`` (only tiny corpora need this)."""
    if tokens.numel() == 0:
        raise ValueError("cannot sample windows from an empty token tensor")
    if tokens.numel() >= length:
        return tokens
    return tokens.repeat(-(-length // tokens.numel()))


def _windows(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.arange(seq_len + 1)
    windows = tokens[starts.unsqueeze(1) + offsets].long()
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class ShardSampler:
    """Random training windows from this peer's contiguous shard of the train tokens.

    A batch is a pure function of (seed, peer_key, stream, position), so a restarted peer resumes its
    exact data stream from one integer, and peers with different keys see different streams. The local
    workers of one multi-device peer share its shard and differ by ``stream`` (their rank): rank 0 draws
    exactly what a single-device peer would.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        *,
        seed: int,
        peer_key: str,
        num_shards: int,
        batch_size: int,
        seq_len: int,
        stream: int = 0,
    ) -> None:
        if num_shards < 1 or batch_size < 1 or seq_len < 1:
            raise ValueError("num_shards, batch_size and seq_len must all be >= 1")
        self.seed = seed
        self.peer_key = peer_key
        self.num_shards = num_shards
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.stream = stream
        self.shard_index = _stable_int("shard", seed, peer_key) % num_shards
        self.tokens = self._shard(tokens)

    def _shard(self, tokens: torch.Tensor) -> torch.Tensor:
        size = tokens.numel() // self.num_shards
        shard = tokens[self.shard_index * size : (self.shard_index + 1) * size]
        if shard.numel() < self.seq_len + 1:
            shard = tokens  # tiny corpus: every peer samples from everything
        return _at_least(shard, self.seq_len + 1)

    def batch(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) int64 [batch_size, seq_len] with y[:, i] == x[:, i + 1] (next-byte targets)."""
        # Stream 0 keeps the historical key, so a single-device peer's data order is unchanged.
        parts = (
            (self.seed, self.peer_key, position)
            if self.stream == 0
            else (self.seed, self.peer_key, self.stream, position)
        )
        gen = torch.Generator().manual_seed(_stable_int("batch", *parts))
        high = self.tokens.numel() - self.seq_len  # exclusive; keeps the +1 target inside
        starts = torch.randint(0, high, (self.batch_size,), generator=gen)
        return _windows(self.tokens, starts, self.seq_len)


def eval_batches(
    tokens: torch.Tensor, *, seed: int, n_batches: int, batch_size: int, seq_len: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of eval windows, identical for every peer of a run (depends on seed only)."""
    tokens = _at_least(tokens, seq_len + 1)
    gen = torch.Generator().manual_seed(_stable_int("eval", seed))
    high = tokens.numel() - seq_len
    return [
        _windows(tokens, torch.randint(0, high, (batch_size,), generator=gen), seq_len)
        for _ in range(n_batches)
    ]
