"""What the trainer reads: a corpus of token streams, the per-peer sampling of training windows, the eval set.

The streams are a prepared dataset's splits, memory-mapped from disk (`dilocod.data.shards.TokenStream`,
opened by `dilocod.data.localcopy`), or token tensors for tests and benchmarks. A batch is a pure function of the
run's seed, the peer's identity and a position in its stream, so every peer derives a reproducible stream of
batches without coordination, and the eval windows are the same on every peer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from dilocod.data.corpus import Corpus as Corpus
from dilocod.data.corpus import TensorTokens, TokenSource, as_source
from dilocod.data.errors import DataError as DataError  # one error type for every data input
from dilocod.data.localcopy import open_corpus
from dilocod.data.settings import DataConfig as DataConfig  # the `[data]` section lives with the data

# ---------------------------------------------------------------- sampling


def _stable_int(*parts: object) -> int:
    """A 63-bit integer derived from ``parts`` with hashlib (Python's hash() is salted per process)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _at_least(source: TokenSource, length: int) -> TokenSource:
    """``source``, cyclically repeated if shorter than ``length`` (only tiny corpora need this)."""
    n = len(source)
    if n == 0:
        raise ValueError("cannot sample windows from an empty token stream")
    if n >= length:
        return source
    tokens = torch.from_numpy(source.read(0, n))
    return TensorTokens(tokens.repeat(-(-length // n)))


def _read_windows(source: TokenSource, starts: torch.Tensor, seq_len: int) -> torch.Tensor:
    if isinstance(source, TensorTokens):  # one gather instead of a read per window
        return source.tokens[starts.unsqueeze(1) + torch.arange(seq_len + 1)].long()
    return torch.from_numpy(np.stack([source.read(s, s + seq_len + 1) for s in starts.tolist()]))


def inputs_and_targets(windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of int64 windows [n, seq_len + 1]: y[:, i] == x[:, i + 1]."""
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def windows_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The windows [n, seq_len + 1] that (x, y) were cut from."""
    return torch.cat([x, y[:, -1:]], dim=1)


def _windows(source: TokenSource, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    return inputs_and_targets(_read_windows(source, starts, seq_len))


def windows_at(source: TokenSource, starts: list[int], seq_len: int) -> torch.Tensor:
    """The windows of `seq_len + 1` tokens starting at `starts`, int64 [len(starts), seq_len + 1]."""
    return _read_windows(source, torch.tensor(starts, dtype=torch.long), seq_len)


def batch_at(source: TokenSource, starts: list[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of the windows of `seq_len + 1` tokens starting at `starts` (the chunk schedule's batches)."""
    return inputs_and_targets(windows_at(source, starts, seq_len))


class _Range:
    """A contiguous part [lo, hi) of a stream, as a stream."""

    def __init__(self, source: TokenSource, lo: int, hi: int) -> None:
        self.source, self.lo, self.hi = source, lo, hi

    def __len__(self) -> int:
        return self.hi - self.lo

    def read(self, start: int, stop: int) -> np.ndarray:
        return self.source.read(self.lo + start, self.lo + stop)


class ShardSampler:
    """Random training windows from this peer's contiguous part (shard) of the train stream.

    A batch is a pure function of (seed, peer_key, stream, position), so a restarted peer resumes its
    exact data stream from one integer, and peers with different keys see different streams. The local
    workers of one multi-device peer share its shard and differ by ``stream`` (their rank): rank 0 draws
    exactly what a single-device peer would. Only the windows drawn are read: memory does not grow with
    the dataset.
    """

    def __init__(
        self,
        tokens: TokenSource | torch.Tensor,
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
        self.tokens = self._shard(as_source(tokens))

    def _shard(self, source: TokenSource) -> TokenSource:
        size = len(source) // self.num_shards
        if size < self.seq_len + 1:
            return _at_least(source, self.seq_len + 1)  # tiny corpus: every peer samples from everything
        lo = self.shard_index * size
        if isinstance(source, TensorTokens):
            return TensorTokens(source.tokens[lo : lo + size])
        return _Range(source, lo, lo + size)

    @property
    def shard_range(self) -> tuple[int, int]:
        """Where our shard lies in the train stream (what a peer must hold of the dataset)."""
        return (self.tokens.lo, self.tokens.hi) if isinstance(self.tokens, _Range) else (0, len(self.tokens))

    def batch(self, position: int, stream: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) int64 [batch_size, seq_len] with y[:, i] == x[:, i + 1] (next-token targets), of our own
        stream or of `stream` (rank 0 of a local group draws every rank's batch)."""
        stream = self.stream if stream is None else stream
        # Stream 0 keeps the historical key, so a single-device peer's data order is unchanged.
        parts = (
            (self.seed, self.peer_key, position)
            if stream == 0
            else (self.seed, self.peer_key, stream, position)
        )
        gen = torch.Generator().manual_seed(_stable_int("batch", *parts))
        high = len(self.tokens) - self.seq_len  # exclusive; keeps the +1 target inside
        starts = torch.randint(0, high, (self.batch_size,), generator=gen)
        return _windows(self.tokens, starts, self.seq_len)


class Sampler(Protocol):
    def batch(self, position: int, stream: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) int64 [batch_size, seq_len], the batch at `position` of this peer's stream, or of its
        local rank `stream`."""
        ...


class PresentSampler:
    """Random windows from the parts of the train stream this machine holds (`ranges()`: token ranges
    [lo, hi)), for a joiner whose copy is partial when the chunk schedule gives it no window. Batch `position`
    is a pure function of (seed, peer, local rank, position, the ranges held)."""

    def __init__(
        self, tokens: TokenSource, ranges: Callable[[], list[tuple[int, int]]], *, seed: int, peer_key: str,
        batch_size: int, seq_len: int,
    ) -> None:  # fmt: skip
        self.tokens, self.ranges = tokens, ranges
        self.seed, self.peer_key, self.batch_size, self.seq_len = seed, peer_key, batch_size, seq_len

    def batch(self, position: int, stream: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        spans = [(lo, hi) for lo, hi in self.ranges() if hi - lo > self.seq_len]
        if not spans:
            raise DataError("no training shard of the run's dataset is on this machine yet")
        sizes = torch.tensor([hi - lo - self.seq_len for lo, hi in spans], dtype=torch.float64)
        key = (
            (self.seed, self.peer_key, position)
            if not stream
            else (self.seed, self.peer_key, stream, position)
        )
        gen = torch.Generator().manual_seed(_stable_int("present", *key))
        picks = torch.multinomial(sizes, self.batch_size, replacement=True, generator=gen).tolist()
        starts = [spans[i][0] + int(torch.randint(0, int(sizes[i]), (1,), generator=gen)) for i in picks]
        return batch_at(self.tokens, starts, self.seq_len)


def eval_batches(
    tokens: TokenSource | torch.Tensor, *, seed: int, n_batches: int, batch_size: int, seq_len: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of eval windows, identical for every peer of a run (depends on seed only)."""
    source = _at_least(as_source(tokens), seq_len + 1)
    gen = torch.Generator().manual_seed(_stable_int("eval", seed))
    high = len(source) - seq_len
    return [
        _windows(source, torch.randint(0, high, (batch_size,), generator=gen), seq_len)
        for _ in range(n_batches)
    ]


def load_corpus(cfg: DataConfig, *, partial: bool = False) -> Corpus:
    """The corpus of this machine's copy of the run's dataset (`data.path`, checked against `data.dataset`);
    without a run (`data.dataset` unset: tests, benchmarks) the one `data.source` prepares to. With
    `partial`, training shards may be missing."""
    try:
        return open_corpus(cfg, partial=partial)
    except OSError as e:
        raise DataError(f"data.source {cfg.source!r}: cannot read ({e})") from None
