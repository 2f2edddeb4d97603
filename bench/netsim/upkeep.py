"""What every simulated peer does on timers beside its round, as the daemon does: publish its status record
every `net.status_interval`, read the run's clock (`dilocod.rounds.clock`) and stop training at the close
it estimates, and report its chunks to the coordinator every `SYNC_SECONDS` (the coordinator returning
dead leases every `SAVE_SECONDS`). A mixin of `run.Simulation`, which holds the state named below.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from bench.netsim import costs
from bench.netsim.population import Peer
from dilocod.node.chunks import SAVE_SECONDS, SYNC_SECONDS
from dilocod.rounds import clock, facts
from dilocod.rounds.events import RunFacts

if TYPE_CHECKING:
    from bench.netsim.coordinator import Coordinator
    from bench.netsim.queue import EventQueue
    from bench.netsim.report import Tally
    from bench.netsim.settings import RunParams


class Upkeep:
    params: RunParams
    queue: EventQueue
    coordinator: Coordinator
    tally: Tally
    peers: dict[str, Peer]
    records: dict[str, dict[str, Any]]
    record_bytes: int
    live: int
    joined: int
    _parsed: dict[str, tuple[clock.Progress | None, clock.Joiner | None]]
    _version: int
    _fresh_at: tuple[float, int, list[dict[str, Any]]]
    _reducers_at: tuple[tuple[int, int], int]

    def _closed(self, peer: Peer, steps: int) -> None:
        raise NotImplementedError

    # ---- records ---------------------------------------------------------------------------------------
    def _tokens_now(self, peer: Peer, now: float) -> int:
        if peer.training_since is None:
            return peer.round_tokens
        steps = math.floor(
            (now - peer.training_since) * peer.traits.tokens_per_second / self.params.step_tokens
        )
        return peer.round_tokens + steps * self.params.step_tokens

    def _publish(self, peer: Peer) -> None:
        if not peer.alive:
            return
        now = self.queue.now
        self.records[peer.peer_id] = {
            "role": "peer", "peer_id": peer.peer_id, "outer_step": peer.machine.step, "round": peer.machine.round,
            "round_tokens": self._tokens_now(peer, now), "tokens_per_second": peer.traits.tokens_per_second,
            "time": now, "round_opened": peer.round_opened, "reference_tokens": self.params.clock.reference_tokens,
            "training": peer.training_since is not None, "global_sha256": peer.sha, "joining": peer.joining,
            "joining_since": peer.joining_since, "reachability": "private" if peer.traits.private else "public",
        }  # fmt: skip
        self._wrote(peer.peer_id)
        self.tally.dht(
            peer.peer_id,
            costs.store_messages(self._size()),
            costs.store_bytes(self._size(), self.record_bytes),
        )
        self.queue.after(self.params.cfg.net.status_interval, lambda: self._publish(peer))

    def _size(self) -> int:
        return self.live

    def _fresh(self) -> list[dict[str, Any]]:
        now, stale = self.queue.now, self.params.clock.stale_after
        at, version, fresh = self._fresh_at
        if (at, version) != (now, self._version):
            fresh = [r for r in self.records.values() if now - r["time"] <= stale]
            self._fresh_at = (now, self._version, fresh)
        return fresh

    def _facts(self, peer: Peer, records: list[dict[str, Any]]) -> RunFacts:
        us = facts.Us(peer.peer_id, peer.machine.step, peer.sha, previous=peer.previous)
        key, reducers = self._reducers_at
        if key != (self.live, self.joined):  # who is alive changed
            public = sum(not p.traits.private for p in self.peers.values() if p.alive)
            reducers = public + 1  # and the bootstrap
            self._reducers_at = ((self.live, self.joined), reducers)
        return facts.run_facts(records, us, now=self.queue.now, seen_recently=True, reducers=reducers)

    # ---- the run's clock -------------------------------------------------------------------------------
    def _tick(self) -> None:
        """Every peer reads the records and re-estimates its round's close (`clock.estimate_close`); a
        trainer stops at the first inner step `clock.should_stop` says not to take."""
        now, settings = self.queue.now, self.params.clock
        records = self._fresh()
        parsed = [self._parsed[r["peer_id"]] for r in records]
        progress = [p for p, _ in parsed if p is not None]
        joiners = [j for _, j in parsed if j is not None]
        soonest = math.inf
        size = self._size()
        for index in sorted(
            {p.machine.round for p in self.peers.values() if p.alive and p.training_since is not None}
        ):
            trainers = clock.in_round(progress, index, now, settings.stale_after)
            opened = clock.round_opened(trainers, fallback=now)
            waiting = clock.joining(joiners, index, now, settings.stale_after)
            close = clock.estimate_close(trainers, settings, now, opened, joiners=waiting)
            self._stop_trainers(index, close.at)
            soonest = min(soonest, clock.refresh_interval(close, now, self.params.cfg.net.status_interval))
        for peer in self.peers.values():
            if peer.alive and peer.training_since is not None:
                read = costs.read_bytes(size, len(records), self.record_bytes)
                self.tally.dht(peer.peer_id, costs.read_messages(size), read)
                self.tally.status_reads += 1
        # nobody trains (the run is between rounds): look again soon, as a peer's timer does when it starts
        interval = soonest if math.isfinite(soonest) else clock.UNMEASURED_REFRESH
        self.queue.after(interval, self._tick)

    def _stop_trainers(self, index: int, close_at: float) -> None:
        now = self.queue.now
        for peer in self.peers.values():
            if not peer.alive or peer.training_since is None or peer.machine.round != index or peer.stopping:
                continue
            step = self.params.step_tokens / peer.traits.tokens_per_second
            done = max(1, math.ceil((now - peer.training_since) / step))  # at least one inner step a round
            while not clock.should_stop(close_at, peer.training_since + done * step, step):
                done += 1
                if peer.training_since + done * step > now + self.params.cfg.net.status_interval:
                    break
            else:
                peer.stopping = True
                self.queue.at(peer.training_since + done * step, lambda p=peer, s=done: self._closed(p, s))

    def _publish_now(self, peer: Peer) -> None:
        """The machine's `Publish`: the record is refreshed at once (without a second publishing loop)."""
        if peer.peer_id in self.records:
            record = self.records[peer.peer_id]
            record.update(outer_step=peer.machine.step, round=peer.machine.round, time=self.queue.now,
                          round_tokens=self._tokens_now(peer, self.queue.now), global_sha256=peer.sha,
                          training=peer.training_since is not None, joining=peer.joining,
                          joining_since=peer.joining_since, round_opened=peer.round_opened)  # fmt: skip
            self._wrote(peer.peer_id)

    def _wrote(self, peer_id: str) -> None:
        """A record changed: the clock's reading of it is taken once here, not at every peer's read."""
        record = self.records[peer_id]
        self._parsed[peer_id] = (clock.progress_from_record(record), clock.joiner_from_record(record))
        self._version += 1

    def _run_opened(self, peer: Peer, index: int) -> float:
        """`RoundTimer.run_opened`: when the run opened `index`, as the other trainers in it say (now if
        none says). A joiner that published its own arrival instead would pull the round's median opening
        later with every join, and under churn the run's `max_seconds` would never come."""
        now, records = self.queue.now, self._fresh()
        progress = [
            p for r in records if r["peer_id"] != peer.peer_id and (p := self._parsed[r["peer_id"]][0]) is not None
        ]  # fmt: skip
        live = clock.in_round(progress, index, now, self.params.clock.stale_after)
        return clock.round_opened(live, fallback=now) if live else now

    # ---- data ------------------------------------------------------------------------------------------
    def _expire(self) -> None:
        self.coordinator.expire(self.queue.now)
        self.queue.after(SAVE_SECONDS, self._expire)

    def _chunk_sync(self, peer: Peer) -> None:
        """`ChunkSync`: report how far into each lease we trained, renew, ask for two."""
        if not peer.alive:
            return
        trained = peer.trained_total + self._tokens_now(peer, self.queue.now) - peer.round_tokens
        fresh, peer.reported = trained - peer.reported, trained
        held: list[tuple[int, int, int]] = []
        for epoch, chunk, offset in peer.leases:
            size = peer.chunk_sizes[(epoch, chunk)]
            moved = min(size - offset, fresh)
            fresh -= moved
            held.append((epoch, chunk, offset + moved))
        grants = self.coordinator.sync(peer.peer_id, held, 2, self.queue.now)
        peer.leases = [(g.epoch, g.chunk, g.offset) for g in grants]
        peer.chunk_sizes = {(g.epoch, g.chunk): g.size for g in grants}
        self.tally.data_bytes(
            peer.peer_id, sum(g.size for g in grants if (g.epoch, g.chunk) not in peer.seen_chunks)
        )
        peer.seen_chunks.update((g.epoch, g.chunk) for g in grants)
        self.queue.after(SYNC_SECONDS, lambda: self._chunk_sync(peer))
