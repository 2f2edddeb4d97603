"""This peer's ban list: who it refuses to average with or download from, why, and until when.

Local and persistent (`<run dir>/bans.json`, rewritten atomically): a restart does not forgive a
peer that lied. Bans expire, because a peer id can change hands and honest peers can have one bad
round (a crash mid-reduction looks like garbage to its group).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dilocod.files import atomic_write

log = logging.getLogger("dilocod.trust.bans")

FILENAME = "bans.json"
DEFAULT_SECONDS = 3600.0
MAX_BANS = 10_000  # bounded, whatever strangers do


@dataclass(frozen=True)
class Ban:
    peer_id: str
    reason: str
    since: float
    until: float


class BanList:
    def __init__(self, run_dir: Path | None) -> None:
        self.path = run_dir / FILENAME if run_dir is not None else None
        self._bans: dict[str, Ban] = {}
        self._load()

    def _load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            entries = json.loads(self.path.read_text())
            for entry in entries[:MAX_BANS]:
                ban = Ban(
                    str(entry["peer_id"]), str(entry["reason"]), float(entry["since"]), float(entry["until"])
                )
                self._bans[ban.peer_id] = ban
        except (OSError, ValueError, KeyError, TypeError) as e:
            # A damaged ban list must not stop a peer from training; it is set aside, not deleted.
            log.warning(
                "ignoring unreadable ban list %s (%s); it was renamed to %s.bad", self.path, e, FILENAME
            )
            self.path.replace(self.path.with_suffix(".json.bad"))
            self._bans = {}

    def _save(self) -> None:
        if self.path is None:
            return
        atomic_write(self.path, [json.dumps([asdict(b) for b in self._bans.values()], indent=1).encode()])

    def ban(self, peer_id: str, reason: str, seconds: float = DEFAULT_SECONDS) -> bool:
        """Ban (or extend the ban of) `peer_id`; True if it was not banned before."""
        now = time.time()
        new = not self.is_banned(peer_id)
        if new and len(self._bans) >= MAX_BANS:
            self._expire(now)
            if len(self._bans) >= MAX_BANS:
                return False
        self._bans[peer_id] = Ban(peer_id, reason[:200], now, now + seconds)
        self._save()
        if new:
            log.warning("banned %s for %.0f s: %s", peer_id, seconds, reason)
        return new

    def is_banned(self, peer_id: str) -> bool:
        ban = self._bans.get(peer_id)
        return ban is not None and ban.until > time.time()

    def active(self) -> list[Ban]:
        now = time.time()
        return sorted((b for b in self._bans.values() if b.until > now), key=lambda b: b.since)

    def peer_ids(self) -> list[str]:
        return [b.peer_id for b in self.active()]

    def _expire(self, now: float) -> None:
        self._bans = {k: b for k, b in self._bans.items() if b.until > now}
