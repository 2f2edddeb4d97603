"""The run's chunk schedule: every token of the training split trained once per epoch, and a record of who
trained which part.

The training split (the concatenated train shards) is cut into chunks of `data.chunk_tokens` tokens (the
last one shorter). Each epoch visits the chunks in its own order, a permutation seeded by the dataset's hash
and the epoch number, so the order is the run's, not one node's. The run's coordinator (the bootstrap, or
the node that started the run) keeps this book; trainers hold *leases*:

- a trainer asks for leases (at most `MAX_LEASES` at once: the chunk it trains and the next one, so it
  never waits on the network) and gets the first chunk nobody holds: a chunk that came back first, then the
  next in the epoch's order; when the epoch has none left, the next epoch opens;
- it reports how far into each chunk it has trained; every report renews its leases, and the book records
  the part trained as a segment (who, from, to) of that chunk;
- a chunk reported to its end is done;
- a lease not renewed for `lease_seconds` (its trainer died or left) expires and the chunk goes back to the
  run *from the offset reported last*: what the trainer reported is never handed out again, and what it
  trained without reporting is lost rather than trained twice;
- a trainer that restarts reports the leases its checkpoint holds; those still its own are kept, with the
  furthest offset either side knows (it skips what it trained after its checkpoint: it was trained once).

Only the lessee's own reports move a lease, and a report can only move forward. Pure bookkeeping: time is
passed in, nothing here does I/O; `to_json`/`from_json` carry the book across a coordinator restart.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_LEASES = 2  # the chunk being trained and the next one
FORMAT = 1  # of to_json


@dataclass(frozen=True)
class Grant:
    """A lease as a trainer sees it: chunk `chunk` of epoch `epoch` covers [lo, lo + size) of the train
    stream; `offset` tokens of it are trained."""

    epoch: int
    chunk: int
    lo: int
    size: int
    offset: int


@dataclass
class _Lease:
    peer: str
    offset: int
    expires: float


@dataclass
class _Epoch:
    order: np.ndarray  # chunk ids in the order this epoch hands them out
    cursor: int = 0  # order[cursor:] were never handed out
    returned: list[tuple[int, int]] = field(default_factory=list)  # (chunk, offset) back from a lease
    leases: dict[int, _Lease] = field(default_factory=dict)  # chunk → its lease
    done: int = 0  # chunks trained to their end
    covered: int = 0  # tokens of this epoch reported trained
    segments: dict[int, list[list[Any]]] = field(default_factory=dict)  # chunk → [[peer, lo, hi], ...]

    def available(self) -> bool:
        return bool(self.returned) or self.cursor < len(self.order)


def epoch_order(n_chunks: int, dataset: str, epoch: int) -> np.ndarray:
    """The order in which `epoch` hands out the chunks: the same on every machine for one dataset."""
    seed = int.from_bytes(hashlib.sha256(f"chunks:{dataset}:{epoch}".encode()).digest()[:8], "big")
    return np.random.default_rng(seed).permutation(n_chunks)


class ChunkBook:
    """The coordinator's record of the run's chunks. Not thread-safe: one owner calls it."""

    def __init__(self, train_tokens: int, chunk_tokens: int, dataset: str, lease_seconds: float) -> None:
        if train_tokens < 1 or chunk_tokens < 1:
            raise ValueError("a chunk schedule needs a training split and a chunk size of at least 1 token")
        self.train_tokens, self.chunk_tokens = train_tokens, chunk_tokens
        self.dataset, self.lease_seconds = dataset, lease_seconds
        self.n_chunks = -(-train_tokens // chunk_tokens)
        self.epochs: dict[int, _Epoch] = {0: self._open(0)}
        self.tokens_trained = 0  # over every epoch
        self.chunks_trained = 0

    # ---- geometry --------------------------------------------------------------------------------------
    def size(self, chunk: int) -> int:
        return min(self.chunk_tokens, self.train_tokens - chunk * self.chunk_tokens)

    def _open(self, epoch: int) -> _Epoch:
        return _Epoch(order=epoch_order(self.n_chunks, self.dataset, epoch))

    def _grant(self, epoch: int, chunk: int, lease: _Lease) -> Grant:
        return Grant(epoch, chunk, chunk * self.chunk_tokens, self.size(chunk), lease.offset)

    # ---- the rules -------------------------------------------------------------------------------------
    def sync(self, peer: str, held: list[tuple[int, int, int]], want: int, now: float) -> list[Grant]:
        """`peer` reports (epoch, chunk, offset) for the leases it holds and wants `want` leases: returns
        every lease it holds afterwards. Expired leases are returned to the run first."""
        self.expire(now)
        for epoch, chunk, offset in held:
            self._report(peer, epoch, chunk, offset)
        mine = self._leases_of(peer)
        for _, _, lease in mine:
            lease.expires = now + self.lease_seconds
        while len(mine) < min(want, MAX_LEASES):
            mine.append(self._claim(peer, now))
        return [self._grant(epoch, chunk, lease) for epoch, chunk, lease in mine]

    def _report(self, peer: str, epoch: int, chunk: int, offset: int) -> None:
        book = self.epochs.get(epoch)
        lease = book.leases.get(chunk) if book is not None else None
        if book is None or lease is None or lease.peer != peer:
            return  # not its lease (any more): nothing it says about the chunk counts
        offset = min(offset, self.size(chunk))
        if offset > lease.offset:
            self._trained(book, chunk, peer, lease.offset, offset)
            lease.offset = offset
        if lease.offset == self.size(chunk):
            del book.leases[chunk]
            book.done += 1
            self.chunks_trained += 1
            self._drop_finished_epochs()

    def _trained(self, book: _Epoch, chunk: int, peer: str, lo: int, hi: int) -> None:
        """Record [lo, hi) of `chunk` as trained by `peer`: extends its last segment when contiguous."""
        segments = book.segments.setdefault(chunk, [])
        if segments and segments[-1][0] == peer and segments[-1][2] == lo:
            segments[-1][2] = hi
        else:
            segments.append([peer, lo, hi])
        book.covered += hi - lo
        self.tokens_trained += hi - lo

    def _claim(self, peer: str, now: float) -> tuple[int, int, _Lease]:
        epoch = next((e for e in sorted(self.epochs) if self.epochs[e].available()), None)
        if epoch is None:  # every chunk of every open epoch is held or done: the next epoch opens
            epoch = max(self.epochs) + 1
            self.epochs[epoch] = self._open(epoch)
        book = self.epochs[epoch]
        if book.returned:
            chunk, offset = book.returned.pop(0)
        else:
            chunk, offset = int(book.order[book.cursor]), 0
            book.cursor += 1
        lease = _Lease(peer, offset, now + self.lease_seconds)
        book.leases[chunk] = lease
        return epoch, chunk, lease

    def _leases_of(self, peer: str) -> list[tuple[int, int, _Lease]]:
        return [
            (epoch, chunk, lease)
            for epoch in sorted(self.epochs)
            for chunk, lease in self.epochs[epoch].leases.items()
            if lease.peer == peer
        ]

    def expire(self, now: float) -> list[tuple[str, int, int]]:
        """Return every lease not renewed in time to the run; (peer, epoch, chunk) of each."""
        gone = []
        for epoch, book in self.epochs.items():
            for chunk, lease in list(book.leases.items()):
                if lease.expires <= now:
                    del book.leases[chunk]
                    book.returned.append((chunk, lease.offset))
                    gone.append((lease.peer, epoch, chunk))
        return gone

    def _drop_finished_epochs(self) -> None:
        """An epoch whose every chunk is done leaves the book (its totals stay), unless it is the last."""
        for epoch in sorted(self.epochs)[:-1]:
            if self.epochs[epoch].done == self.n_chunks:
                del self.epochs[epoch]

    # ---- what the run shows ----------------------------------------------------------------------------
    def progress(self) -> dict[str, Any]:
        """`/api/run`'s `dataset`: the epoch in progress (the oldest open one) and the run's totals."""
        epoch = min(self.epochs)
        book = self.epochs[epoch]
        return {
            "epoch": epoch,
            "epoch_fraction": book.covered / self.train_tokens,
            "tokens_trained": self.tokens_trained,
            "chunks_trained": self.chunks_trained,
            "chunks_total": self.n_chunks,
            "chunk_tokens": self.chunk_tokens,
            "leases": sum(len(b.leases) for b in self.epochs.values()),
        }

    def segments(self) -> list[dict[str, Any]]:
        """Every recorded segment of the open epochs: who trained which part of which chunk."""
        return [
            {"epoch": epoch, "chunk": chunk, "peer": peer, "lo": lo, "hi": hi}
            for epoch in sorted(self.epochs)
            for chunk, parts in sorted(self.epochs[epoch].segments.items())
            for peer, lo, hi in parts
        ]

    # ---- persistence -----------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "dataset": self.dataset,
            "train_tokens": self.train_tokens,
            "chunk_tokens": self.chunk_tokens,
            "tokens_trained": self.tokens_trained,
            "chunks_trained": self.chunks_trained,
            "epochs": {
                str(epoch): {
                    "cursor": book.cursor,
                    "returned": [list(r) for r in book.returned],
                    "leases": {str(c): [lease.peer, lease.offset] for c, lease in book.leases.items()},
                    "done": book.done,
                    "covered": book.covered,
                    "segments": {str(c): parts for c, parts in book.segments.items()},
                }
                for epoch, book in self.epochs.items()
            },
        }

    def restore(self, saved: dict[str, Any], now: float) -> None:
        """Take a saved book's state. Leases get a full `lease_seconds` from `now`: a coordinator that was
        down could not be reached, which is no sign that its trainers died. Raises ValueError when the
        saved book is of another dataset or chunk size (the caller then starts afresh)."""
        if saved.get("format") != FORMAT:
            raise ValueError(f"chunk book format {saved.get('format')!r}, expected {FORMAT}")
        mine = (self.dataset, self.train_tokens, self.chunk_tokens)
        theirs = (saved.get("dataset"), saved.get("train_tokens"), saved.get("chunk_tokens"))
        if theirs != mine:
            raise ValueError("the saved chunk book is of another dataset or chunk size")
        epochs = {}
        for key, raw in saved["epochs"].items():
            book = self._open(int(key))
            book.cursor, book.done, book.covered = int(raw["cursor"]), int(raw["done"]), int(raw["covered"])
            book.returned = [(int(c), int(o)) for c, o in raw["returned"]]
            book.leases = {
                int(c): _Lease(str(p), int(o), now + self.lease_seconds)
                for c, (p, o) in raw["leases"].items()
            }
            book.segments = {int(c): [[str(p), int(lo), int(hi)] for p, lo, hi in parts]
                             for c, parts in raw["segments"].items()}  # fmt: skip
            epochs[int(key)] = book
        if not epochs:
            raise ValueError("the saved chunk book has no epoch")
        self.epochs = epochs
        self.tokens_trained, self.chunks_trained = int(saved["tokens_trained"]), int(saved["chunks_trained"])
