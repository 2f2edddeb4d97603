"""The multi-donor state download as a re-syncing peer uses it: donors from the run's records, progress to
`/api/status` (`state_fetch`) and the log. The download itself is peers/state/download.py."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from peers.group import DownloadedState
from peers.state.download import MAX_DONORS, PartsDownload

log = logging.getLogger("dilocod.statesync")

LOG_EVERY = 5.0  # seconds between progress lines of one download


def pick_donors(
    records: Sequence[Mapping[str, Any]], min_step: int, exclude: set[str], rng: random.Random | None = None
) -> list[str]:
    """The peers to ask, most advanced first (equal steps in random order, so joiners spread over donors):
    those whose record is at `min_step` or later and that are not excluded (banned, refused, minority)."""
    found = [(r["outer_step"], r["peer_id"]) for r in records if r["outer_step"] >= min_step]
    found = [pair for pair in found if pair[1] not in exclude]
    (rng or random).shuffle(found)
    found.sort(key=lambda pair: pair[0], reverse=True)
    return [peer for _, peer in found][:MAX_DONORS]


@dataclass
class Fetched:
    state: DownloadedState | None = None
    donors: list[str] = field(default_factory=list)  # the donors that declared the state we got
    liars: list[tuple[str, str]] = field(default_factory=list)
    resumable: bool = False  # donors described a state but it did not all arrive: the next try resumes it
    outvoted: dict[str, bytes] = field(default_factory=dict)  # donor → the metadata most others contradict


class PartsSource:
    """Runs one download at a time; `on_status(dict)` gets its progress for `/api/status`."""

    def __init__(self, download: PartsDownload, on_status: Callable[[dict[str, Any]], None]) -> None:
        self.download, self.on_status = download, on_status
        self._started = self._logged = 0.0
        download.on_progress = self._progress

    async def fetch(
        self, records: Sequence[Mapping[str, Any]], exclude: Sequence[str], min_step: int, timeout: float
    ) -> Fetched:
        donors = pick_donors(records, min_step, set(exclude))
        if not donors:
            return Fetched()
        self._started = self._logged = time.monotonic()
        result = await self.download.download(donors, timeout)
        seconds = time.monotonic() - self._started
        self.on_status({"active": False, "seconds": round(seconds, 3), "error": result.error})
        if result.meta is None:
            log.warning("state download from %d donors unfinished: %s", len(result.donors), result.error)
            return Fetched(liars=result.liars, resumable=bool(result.donors), outvoted=result.outvoted)
        log.info(
            "downloaded the state (%d bytes) in %.1f s from %d donors: %s%s",
            sum(t.numel() * 4 for t in result.tensors), seconds, len(result.donors),
            ", ".join(f"{d[-8:]} {n} parts" for d, n in result.parts_from.most_common()),
            f" ({result.resumed} parts kept from a cut download)" if result.resumed else "",
        )  # fmt: skip
        state = DownloadedState(result.donors[0], -1.0, result.meta, result.tensors)
        return Fetched(state, result.donors, result.liars, outvoted=result.outvoted)

    def _progress(self, progress: dict[str, Any]) -> None:
        now = time.monotonic()
        self.on_status({**progress, "active": True, "seconds": round(now - self._started, 3)})
        if now - self._logged >= LOG_EVERY:
            self._logged = now
            log.info(
                "state download: %d of %d parts (%.1f of %.1f MB) from %d donors",
                progress["parts_done"], progress["parts_total"], progress["bytes_done"] / 1e6,
                progress["bytes_total"] / 1e6, len(progress["donors"]),
            )  # fmt: skip
