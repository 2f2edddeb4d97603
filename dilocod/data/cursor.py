"""A trainer's place in the run's chunk schedule: the chunks it holds leases on, how far into each it has
trained, and the parts it trained that no round ticket has named yet.

The trainer thread takes training windows from it (`windows`); the event loop keeps it in step with the
run's coordinator (`held` to report, `adopt` the answer; dilocod/node/chunks.py) and drains the parts
trained into the token ledger, which puts them in round tickets (`drain`). A chunk's windows are `seq_len + 1`
tokens starting every `seq_len` tokens, so every token of a chunk is a target once, trained in a seeded order
(`_order`); an offset counts windows done × seq_len in that order, and a part [lo, hi) is the windows
lo/seq_len … hi/seq_len of it. The last tokens of a chunk that cannot fill a window are skipped (the chunk
counts as done).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dilocod.data.schedule import Grant


@dataclass(frozen=True)
class Segment:
    """[lo, hi) of chunk `chunk` (offsets within the chunk) of epoch `epoch`, trained."""

    epoch: int
    chunk: int
    lo: int
    hi: int


def window_order(seed: str, epoch: int, chunk: int, size: int, seq_len: int) -> np.ndarray:
    """The order in which a chunk of `size` tokens has its windows trained (see `ChunkCursor._order`); a
    scorer uses it to find the windows a ticket's part [lo, hi) names."""
    windows = max(0, (size - 1) // seq_len)
    digest = hashlib.sha256(f"windows:{seed}:{epoch}:{chunk}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "big")).permutation(windows)


def part_windows(
    seed: str, part: tuple[int, int, int, int], chunk_tokens: int, train_tokens: int, seq_len: int
) -> list[int]:
    """Start positions (in the train stream) of the windows trained in a ticket's part (epoch, chunk, lo,
    hi) of the run's chunk schedule; [] for a part outside the stream."""
    epoch, chunk, lo, hi = part
    start = chunk * chunk_tokens
    size = min(chunk_tokens, train_tokens - start)
    if size <= seq_len or lo >= hi:
        return []
    order = window_order(seed, epoch, chunk, size, seq_len)
    first, last = lo // seq_len, min(len(order), -(-hi // seq_len))
    return [start + int(order[i]) * seq_len for i in range(first, last)]


class ChunkCursor:
    def __init__(self, seq_len: int, seed: str = "") -> None:
        if seq_len < 1:
            raise ValueError("seq_len must be >= 1")
        self.seq_len, self.seed = seq_len, seed
        self._orders: dict[tuple[int, int, int], np.ndarray] = {}
        self._leases: list[Grant] = []  # in training order; offsets are ours
        self._trained: list[Segment] = []  # since the last drain
        self._lock = threading.Lock()
        self.windows_taken = 0
        # Called on the trainer thread when a chunk is finished or the leases run dry: the sync should
        # report at once (and fetch the lease after next).
        self.on_finished: Callable[[], None] = lambda: None
        # Whether a lease's tokens are on this machine (a joiner fetches the shards of its chunks as it goes):
        # windows stop at the first lease that is not.
        self.ready: Callable[[Grant], bool] = lambda grant: True

    # ---- the trainer thread ----------------------------------------------------------------------------
    def windows(self, n: int) -> list[int] | None:
        """Start positions (in the train stream) of the next `n` windows, or None (nothing taken) when the
        leases held do not have `n` windows left."""
        with self._lock:
            plan: list[tuple[int, int]] = []
            for i, lease in enumerate(self._leases):
                if not self.ready(lease):
                    break
                order, done = self._order(lease), self._done(lease)
                while len(plan) < n and done < len(order):
                    plan.append((i, lease.lo + int(order[done]) * self.seq_len))
                    done += 1
                if len(plan) == n:
                    break
            finished = len(plan) == n and self._advance(plan)
        if len(plan) < n or finished:
            self.on_finished()
        if len(plan) < n:
            return None
        self.windows_taken += n
        return [start for _, start in plan]

    def _order(self, lease: Grant) -> np.ndarray:
        """The order in which the chunk's windows are trained: seeded by the chunk, the same on every machine,
        so that a batch mixes the chunk's text (its documents lie in the order they were prepared) and an
        offset means the same windows to everyone (offset = windows done × seq_len)."""
        key = (lease.epoch, lease.chunk, lease.size)
        if key not in self._orders:
            if len(self._orders) > 8:
                self._orders.pop(next(iter(self._orders)))
            self._orders[key] = window_order(self.seed, lease.epoch, lease.chunk, lease.size, self.seq_len)
        return self._orders[key]

    def _done(self, lease: Grant) -> int:
        return len(self._order(lease)) if lease.offset >= lease.size else lease.offset // self.seq_len

    def _advance(self, plan: list[tuple[int, int]]) -> bool:
        """Move the leases' offsets past `plan`; True when a lease was trained to its end."""
        last, finished = plan[-1][0], False
        for i in range(last + 1):
            lease = self._leases[i]
            done = self._done(lease) + sum(1 for j, _ in plan if j == i)
            end = done * self.seq_len
            # A chunk left behind (we moved on to the next) or out of windows is done: its tail is short.
            if i < last or done >= len(self._order(lease)):
                end = lease.size
            if end > lease.offset:
                self._trained.append(Segment(lease.epoch, lease.chunk, lease.offset, end))
                self._leases[i] = replace(lease, offset=end)
                finished = finished or end == lease.size
        return finished

    # ---- the event loop --------------------------------------------------------------------------------
    def held(self) -> list[tuple[int, int, int]]:
        """(epoch, chunk, offset) of every lease, finished ones too: the coordinator learns of the end."""
        with self._lock:
            return [(g.epoch, g.chunk, g.offset) for g in self._leases]

    def adopt(self, grants: list[Grant]) -> int:
        """Take the coordinator's answer: the leases we hold now. A lease it no longer lists is dropped
        (finished and recorded, or expired and handed on); for one we share, the further offset wins.
        Returns how many windows are left to train in the leases held."""
        with self._lock:
            granted = {(g.epoch, g.chunk): g for g in grants}
            leases = []
            for mine in self._leases:  # ours first, in the order we train them
                grant = granted.pop((mine.epoch, mine.chunk), None)
                if grant is not None:
                    leases.append(grant if grant.offset > mine.offset else mine)
            leases += granted.values()
            self._leases = leases
            return sum(max(0, (g.size - g.offset - 1) // self.seq_len) for g in leases)

    def drain(self) -> list[Segment]:
        """The parts trained since the last drain, contiguous parts of one chunk merged."""
        with self._lock:
            parts, self._trained = self._trained, []
        merged: list[Segment] = []
        for part in parts:
            last = merged[-1] if merged else None
            if last is not None and (last.epoch, last.chunk, last.hi) == (part.epoch, part.chunk, part.lo):
                merged[-1] = replace(last, hi=part.hi)
            else:
                merged.append(part)
        return merged

    def leases(self) -> list[Grant]:
        with self._lock:
            return list(self._leases)

    # ---- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return {"leases": [[g.epoch, g.chunk, g.lo, g.size, g.offset] for g in self._leases]}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Resume the leases a checkpoint holds (the coordinator confirms them on the first sync)."""
        leases = []
        for item in saved.get("leases", []):
            epoch, chunk, lo, size, offset = (int(v) for v in item)
            if not (0 <= offset <= size and size > 0 and lo >= 0):
                raise ValueError(f"checkpoint's chunk lease {item!r} is not valid")
            leases.append(Grant(epoch, chunk, lo, size, offset))
        with self._lock:
            self._leases = leases
