"""The part plan of a state download from several donors at once (issue 27, item 3): pure bookkeeping.

Whole, θ_global and the momentum (8 bytes a parameter, 8 GB for a 1B model) come from one donor at a
time. Split into parts, the same state comes from every donor at once, so its time is
about its size ÷ the donors' summed upload rates, and a cut download keeps the parts it has. Each part is
checked against its expected sha256 as it arrives:

- the expected digests are the list most donors declare, the newest state on a tie (`agreed_digests`):
  a donor that declares another list is not asked (it may hold another state; the whole θ_global is still checked
  against the run's reported hash once every part is in);
- a part whose bytes do not match is a lie (the donor declared one digest and sent other bytes): the
  donor is banned, every part it was fetching goes back to the queue, and the part is fetched from
  another donor;
- a part that does not arrive (a timeout, a cut stream) goes back to the queue and counts against its
  donor, which is dropped (not banned) after `max_failures`;
- a resumed download keeps the parts whose stored bytes still match (`resumed_parts`).

No I/O here: the downloader (`peers/state/download.py`) asks the plan what to fetch from whom, and tells it
what happened. `tests/test_stateparts.py` covers the cases.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

DEFAULT_PART_BYTES = 64 << 20  # large enough to amortize a request, small enough to retry cheaply


@dataclass(frozen=True)
class Part:
    index: int
    start: int  # byte offset in the flat state (θ_global, then the momentum, fp32)
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start


def split_parts(total_bytes: int, part_bytes: int = DEFAULT_PART_BYTES) -> list[Part]:
    """Contiguous parts of at most `part_bytes` covering `total_bytes` (the last may be shorter)."""
    if total_bytes < 0 or part_bytes <= 0:
        raise ValueError(f"bad part plan: {total_bytes} bytes in parts of {part_bytes}")
    starts = range(0, total_bytes, part_bytes)
    return [Part(i, start, min(start + part_bytes, total_bytes)) for i, start in enumerate(starts)]


def agreed_digests(
    declared: Mapping[str, Sequence[str]], newness: Mapping[str, tuple[int, ...]] | None = None
) -> tuple[tuple[str, ...] | None, list[str]]:
    """The part digests most donors declare, and the donors that declared them. On a tie in donors the
    newest state wins (`newness[donor]`: its outer step, then its tensors of the round in flight): in a
    moving run two honest donors a round apart declare different states, and the newer is the one the
    run's records will ask for. None on a tie at equal newness or with no donor: there is nothing to
    hold a donor to, so the plan cannot start."""
    counts = Counter(tuple(digests) for digests in declared.values())
    if not counts:
        return None, []
    rank = {tuple(digests): (newness or {}).get(donor, ()) for donor, digests in declared.items()}
    top = max(counts.values())
    tied = sorted((rank[d], d) for d, n in counts.items() if n == top)
    if len(tied) > 1 and tied[-1][0] == tied[-2][0]:
        return None, []
    winner = tied[-1][1]
    return winner, sorted(donor for donor, digests in declared.items() if tuple(digests) == winner)


def resumed_parts(stored: Mapping[int, str], expected: Sequence[str]) -> set[int]:
    """Parts of a cut download that can be kept: those whose stored bytes still hash to the expected."""
    return {i for i, digest in stored.items() if 0 <= i < len(expected) and digest == expected[i]}


@dataclass
class PartPlan:
    """Which donor fetches which part, what is done, and who lied. One part per donor at a time."""

    parts: Sequence[Part]
    expected: Sequence[str]  # sha256 of each part, as `agreed_digests` found them
    donors: list[str]  # donors that declared `expected`, best first
    max_failures: int = 3  # parts a donor may fail to deliver before it is no longer asked
    done: set[int] = field(default_factory=set)
    banned: set[str] = field(default_factory=set)
    failures: Counter[str] = field(default_factory=Counter)
    in_flight: dict[str, int] = field(default_factory=dict)  # donor -> the part it is fetching
    failed_by: dict[int, set[str]] = field(default_factory=dict)  # part -> donors it failed with

    def __post_init__(self) -> None:
        if len(self.parts) != len(self.expected):
            raise ValueError(f"{len(self.parts)} parts but {len(self.expected)} digests")

    # ---- what to do next -------------------------------------------------------------------------------
    def usable(self, donor: str) -> bool:
        return donor not in self.banned and self.failures[donor] < self.max_failures

    def pending(self) -> list[int]:
        """Parts neither done nor being fetched, in order."""
        fetching = set(self.in_flight.values())
        return [p.index for p in self.parts if p.index not in self.done and p.index not in fetching]

    def eligible(self, donor: str, index: int) -> bool:
        """A donor may fetch a part it has not failed; one it failed, only once every usable donor has
        (a lone donor's timeout is retried, until its `max_failures`)."""
        failed = self.failed_by.get(index, set())
        return donor not in failed or all(d in failed for d in self.donors if self.usable(d))

    def assign(self) -> list[tuple[str, Part]]:
        """Give every idle usable donor the first pending part it is eligible for."""
        given: list[tuple[str, Part]] = []
        queue = self.pending()
        for donor in self.donors:
            if donor in self.in_flight or not self.usable(donor):
                continue
            index = next((i for i in queue if self.eligible(donor, i)), None)
            if index is None:
                continue
            queue.remove(index)
            self.in_flight[donor] = index
            given.append((donor, self.parts[index]))
        return given

    # ---- what happened ---------------------------------------------------------------------------------
    def received(self, donor: str, index: int, digest: str) -> bool:
        """A part arrived from `donor` with this sha256: True if it is kept. Bytes other than the digest
        the donor declared are a lie: the donor is banned and its part goes back to the queue."""
        self._release(donor, index)
        if digest == self.expected[index]:
            self.done.add(index)
            return True
        self.banned.add(donor)
        self.failed_by.setdefault(index, set()).add(donor)
        return False

    def failed(self, donor: str, index: int) -> None:
        """A part did not arrive (timeout, cut stream): back to the queue, for another donor first."""
        self._release(donor, index)
        self.failures[donor] += 1
        self.failed_by.setdefault(index, set()).add(donor)

    def lost(self, donors: Iterable[str]) -> None:
        """Donors gone (left the run, refused us): their parts go back to the queue."""
        for donor in donors:
            self.in_flight.pop(donor, None)
            self.failures[donor] = self.max_failures

    def _release(self, donor: str, index: int) -> None:
        if self.in_flight.get(donor) == index:
            del self.in_flight[donor]

    # ---- where it stands -------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.parts)

    @property
    def stuck(self) -> bool:
        """Parts remain and no donor is left to fetch them (each banned or out of tries): start over with
        other donors, keeping the parts done."""
        return not self.finished and not self.in_flight and not any(self.usable(d) for d in self.donors)

    def progress(self) -> tuple[int, int]:
        """(bytes verified, bytes in all), for the joiner's status and log."""
        return sum(self.parts[i].size for i in self.done), sum(p.size for p in self.parts)
