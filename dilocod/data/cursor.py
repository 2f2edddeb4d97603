"""A trainer's place in the run's chunk schedule: the chunks it holds leases on, how far into each it has
trained, and the parts it trained that no round ticket has named yet.

The trainer thread takes training windows from it (`windows`); the event loop keeps it in step with the
run's coordinator (`held` to report, `adopt` the answer; dilocod/processes/chunks.py) and drains the parts
trained into the token ledger, which puts them in round tickets (`drain`). A window is `seq_len + 1` tokens
of one chunk and the next window starts `seq_len` tokens later, so every token of a chunk is a target once;
the last few tokens of a chunk that cannot fill a window are skipped (the chunk counts as done).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from dilocod.data.schedule import Grant


@dataclass(frozen=True)
class Segment:
    """[lo, hi) of chunk `chunk` (offsets within the chunk) of epoch `epoch`, trained."""

    epoch: int
    chunk: int
    lo: int
    hi: int


class ChunkCursor:
    def __init__(self, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError("seq_len must be >= 1")
        self.seq_len = seq_len
        self._leases: list[Grant] = []  # in training order; offsets are ours
        self._trained: list[Segment] = []  # since the last drain
        self._lock = threading.Lock()
        self.windows_taken = 0
        # Called on the trainer thread when a chunk is finished or the leases run dry: the sync should
        # report at once (and fetch the lease after next).
        self.on_finished: Callable[[], None] = lambda: None

    # ---- the trainer thread ----------------------------------------------------------------------------
    def windows(self, n: int) -> list[int] | None:
        """Start positions (in the train stream) of the next `n` windows, or None (nothing taken) when the
        leases held do not have `n` windows left."""
        with self._lock:
            plan: list[tuple[int, int]] = []
            leases = list(self._leases)
            for i, lease in enumerate(leases):
                offset = lease.offset
                while len(plan) < n and lease.size - offset >= self.seq_len + 1:
                    plan.append((i, lease.lo + offset))
                    offset += self.seq_len
                if len(plan) == n:
                    break
            finished = len(plan) == n and self._advance(plan)
        if len(plan) < n or finished:
            self.on_finished()
        if len(plan) < n:
            return None
        self.windows_taken += n
        return [start for _, start in plan]

    def _advance(self, plan: list[tuple[int, int]]) -> bool:
        """Move the leases' offsets past `plan`; True when a lease was trained to its end."""
        last, finished = plan[-1][0], False
        for i in range(last + 1):
            lease = self._leases[i]
            starts = [start for j, start in plan if j == i]
            end = starts[-1] - lease.lo + self.seq_len if starts else lease.offset
            # A chunk left behind (we moved on to the next) is trained to its end: its tail is too short.
            if i < last or lease.size - end < self.seq_len + 1:
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
