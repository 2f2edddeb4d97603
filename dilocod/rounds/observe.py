"""Reading the run for a decision: the run's status records, turned into the facts the machine needs.

Records are advisory (anyone may lie in them, see `facts.py`); a DHT that cannot be read gives no
records, which the machine treats as "nobody in sight", and `seen_recently` keeps a hiccup from looking
like the end of the run.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from dilocod.diloco import OuterOptimizer
from dilocod.observability.peerstate import PeerState
from dilocod.rounds.events import RunFacts
from dilocod.rounds.facts import Us, run_facts, trainers
from dilocod.rounds.ports import RunView

log = logging.getLogger("dilocod.rounds")


class RunObserver:
    def __init__(
        self,
        state: PeerState,
        outer: OuterOptimizer,
        view: RunView,
        *,
        previous: Callable[[], tuple[int, str] | None],
        alone_after: float,
        private: bool,
    ) -> None:
        self.state, self.outer, self.view = state, outer, view
        self._previous, self.alone_after, self.private = previous, alone_after, private
        self.others_seen_at = -float("inf")  # monotonic time we last read another trainer's record

    async def facts(self) -> RunFacts:
        try:
            records = await self.view.records()
        except Exception as e:
            log.debug("could not read the run's records: %r", e)
            records = []
        if trainers(records, self.state.peer_id):
            self.others_seen_at = time.monotonic()
        us = Us(
            self.state.peer_id,
            self.outer.step,
            self.outer.sha256,
            self.state.facts.manifest_hash,
            self._previous(),
        )
        reducers = await self._reducers(records) if self.private else 1
        seen = time.monotonic() - self.others_seen_at < self.alone_after
        facts = run_facts(records, us, now=time.time(), seen_recently=seen, reducers=reducers)
        if facts.other_settings is not None:
            keys = await self.view.manifest_differences(facts.other_settings)
            facts = dataclasses.replace(facts, other_settings_keys=keys)
        return facts

    async def _reducers(self, records: list[dict[str, object]]) -> int:
        """Nodes that can reduce for a private peer: public trainers and helpers."""
        public = [r for r in trainers(records, self.state.peer_id) if r.get("reachability") == "public"]
        return len(await self.view.helpers()) + len(public)
