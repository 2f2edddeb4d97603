"""`dilocod data prepare`'s token streams: one split's tokens cut into fixed-size shards as they come,
and the not yet full remainder saved with the prepare's state so that a rerun continues from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dilocod.data.shards import (
    ShardInfo,
    SplitInfo,
    shard_name,
    write_shard,
)
from dilocod.files import atomic_write, file_sha256

REMAINDER_PREFIX = ".prepare-"


@dataclass(frozen=True)
class PrepareSettings:
    out: Path
    dtype: str
    eos: int
    vocab_size: int
    shard_tokens: int
    eval_fraction: float
    tokenizer_raw: bytes
    args_hash: str


@dataclass
class SplitWriter:
    """One split's counts, its written shards and the tokens waiting for the next shard."""

    name: str
    cfg: PrepareSettings
    documents: int = 0
    tokens: int = 0
    text_bytes: int = 0
    shards: list[ShardInfo] = field(default_factory=list)
    pending: list[np.ndarray] = field(default_factory=list)
    pending_tokens: int = 0

    def add(self, tokens: np.ndarray, documents: int, text_bytes: int) -> int:
        """Append a batch's tokens; write every shard they complete. Returns how many were written."""
        self.documents += documents
        self.text_bytes += text_bytes
        self.tokens += tokens.size
        self.pending.append(tokens)
        self.pending_tokens += tokens.size
        if self.pending_tokens < self.cfg.shard_tokens:
            return 0
        joined = self.remainder()
        size = self.cfg.shard_tokens
        full = joined.size // size
        for i in range(full):
            self._write(joined[i * size : (i + 1) * size])
        rest = joined[full * size :].copy()  # a copy: the view would keep the whole batch alive
        self.pending, self.pending_tokens = [rest], rest.size
        return full

    def remainder(self) -> np.ndarray:
        if not self.pending:
            return np.empty(0, dtype=self.cfg.dtype)
        return self.pending[0] if len(self.pending) == 1 else np.concatenate(self.pending)

    def _write(self, tokens: np.ndarray) -> None:
        path = self.cfg.out / shard_name(self.name, len(self.shards))
        self.shards.append(write_shard(path, tokens, self.cfg.dtype))

    def finish(self) -> SplitInfo:
        if self.pending_tokens:
            self._write(self.remainder())
            self.pending, self.pending_tokens = [], 0
        return SplitInfo(self.documents, self.tokens, self.text_bytes, tuple(self.shards))

    def state(self, generation: int) -> dict[str, Any]:
        """The counts for the state file, after writing the remainder to a file of its own: named by
        ``generation``, so that the previous state's remainder survives until the new state is saved."""
        rem = self.remainder()
        path = self.cfg.out / f"{REMAINDER_PREFIX}{self.name}-{generation}.rem"
        digest = atomic_write(path, [le_bytes(rem, self.cfg.dtype)])
        return {
            "documents": self.documents,
            "tokens": self.tokens,
            "text_bytes": self.text_bytes,
            "shards": [s.to_json() for s in self.shards],
            "remainder": {"file": path.name, "tokens": int(rem.size), "sha256": digest},
        }

    def restore(self, saved: dict[str, Any]) -> bool:
        """Take over a saved state; False when its files are not (any more) what it recorded."""
        shards = [ShardInfo(**s) for s in saved["shards"]]
        for info in shards:
            path = self.cfg.out / info.file
            if not path.is_file() or path.stat().st_size != info.bytes:
                return False
        rem_path = self.cfg.out / saved["remainder"]["file"]
        if not rem_path.is_file() or file_sha256(rem_path) != saved["remainder"]["sha256"]:
            return False
        rem = np.fromfile(rem_path, dtype=np.dtype(self.cfg.dtype).newbyteorder("<")).astype(self.cfg.dtype)
        self.documents, self.tokens, self.text_bytes = (
            saved["documents"],
            saved["tokens"],
            saved["text_bytes"],
        )
        self.shards = shards
        self.pending, self.pending_tokens = [rem], rem.size
        return True


def le_bytes(tokens: np.ndarray, dtype: str) -> memoryview:
    return np.ascontiguousarray(tokens, dtype=np.dtype(dtype).newbyteorder("<")).data.cast("B")
