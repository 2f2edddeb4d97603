"""What a peer tells the world and the disk: its status record in the DHT, and its checkpoint.

This is the round driver's `Publisher` port. Status records go out every `net.status_interval` seconds
(the heartbeat, which also reads the run for the dashboard's history) and at once whenever the round
driver asks (a new θ_global: the others' clocks should know). A checkpoint is due at the end of a round
once `checkpoint.every` seconds have passed since the last (`checkpoint_due`); its payload is taken in
the trainer thread and written to disk in the background while training goes on. Only what an inner step
changes (the working copy, the inner optimizer's moments) is copied; θ_global, the outer momentum and
the error-feedback residual are written from the live tensors, because only the trainer thread's other
jobs change them and those wait for the write (`guard`). A second checkpoint waits for the first, and
the last one, written whether due or not, is awaited at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dilocod.observability.history import RunHistory
from dilocod.observability.metrics import Metrics
from dilocod.observability.peerstate import PeerState
from dilocod.observability.runview import STATUS_KEY, read_run
from dilocod.statesync.checkpoint import checkpoint_due, save_checkpoint
from peers import heap
from peers.node import Node
from proto import ProtoError, encode_status

log = logging.getLogger("dilocod.publishing")

REJOIN_EVERY = 10.0  # seconds between two rejoins of a peer that still sees nobody


class CheckpointWriter:
    def __init__(
        self,
        run_dir: Path,
        payload: Callable[[], dict[str, Any]],
        in_trainer: Callable[[Callable[[], dict[str, Any]]], Any],
        metrics: Metrics,
        every: float = 0.0,
    ) -> None:
        self.run_dir, self._payload, self._in_trainer, self.metrics = run_dir, payload, in_trainer, metrics
        self.every = every  # checkpoint.every: seconds between checkpoints (0: every round)
        self._writing: asyncio.Task[None] | None = None
        self._last: float | None = None  # monotonic time the last checkpoint began
        self._reading: asyncio.Future[None] | None = None  # done once the write has read the live tensors

    async def checkpoint(self, *, force: bool = False) -> None:
        """Take the state now (trainer thread) and write it in the background, if one is due (or forced)."""
        if not force and not checkpoint_due(time.monotonic(), self._last, self.every):
            return
        await self.flush()
        self._last = time.monotonic()
        payload = await self._in_trainer(self._trimmed_payload)
        loop = asyncio.get_running_loop()
        self._reading = loop.create_future()
        self._writing = asyncio.create_task(self._write(payload, self._last, self._reading))

    def _trimmed_payload(self) -> dict[str, Any]:
        # The round just settled freed its Δ, its average and the old θ_global and momentum into malloc's
        # free lists (peers/heap.py): give those pages back before the payload clones the working copy and
        # the moments, or the clones come on top of them (the checkpoint was each round's peak).
        heap.trim()
        return self._payload()

    async def _write(self, payload: dict[str, Any], started: float, reading: asyncio.Future[None]) -> None:
        loop = asyncio.get_running_loop()

        def serialized() -> None:  # in the writing thread: the live tensors are no longer read
            loop.call_soon_threadsafe(_settle, reading)

        try:
            path = await loop.run_in_executor(None, save_checkpoint, self.run_dir, payload, serialized)
            # The clones of the working copy and the moments (12 bytes a parameter) go back to the system,
            # not to malloc's free lists.
            payload.clear()
            await loop.run_in_executor(None, heap.trim)
            seconds = time.monotonic() - started
            self.metrics.checkpoint_seconds.observe(seconds)
            log.debug("checkpoint written: %.0f MB in %.1f s", path.stat().st_size / 1e6, seconds)
        except Exception as e:  # a full disk must not stop training; the next checkpoint tries again
            log.error("could not write a checkpoint: %s", e)
        finally:
            _settle(reading)

    async def guard(self) -> None:
        """Wait until a write in progress has read the live tensors (its fsync may go on): for any
        trainer-thread job that may change θ_global, the outer momentum or the residual."""
        if self._reading is not None and not self._reading.done():
            await asyncio.shield(self._reading)

    async def flush(self) -> None:
        """Wait for a checkpoint being written."""
        if self._writing is not None:
            await self._writing
            self._writing = None


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class StatusPublisher:
    def __init__(
        self,
        node: Node,
        state: PeerState,
        metrics: Metrics,
        history: RunHistory,
        interval: float,
        checkpoints: CheckpointWriter,
    ) -> None:
        self.node, self.state, self.metrics, self.history = node, state, metrics, history
        self.interval, self.checkpoints = interval, checkpoints
        self.unseen_since: float | None = None  # since when our DHT view has held no other node's record
        self.rejoined_at = -float("inf")

    async def publish(self) -> None:
        ttl = max(3 * self.interval, 15.0)
        record = self.state.record()
        try:
            blob = encode_status(record)
        except ProtoError:  # a sample of many-byte characters beside many addresses: the sample goes
            blob = encode_status({**record, "sample": None, "sample_step": None})
        await self.node.publish(STATUS_KEY, blob, ttl=ttl)

    async def checkpoint(self) -> None:
        await self.checkpoints.checkpoint()

    async def heartbeat(self) -> None:
        """Publish our record and read the run's, every interval, until cancelled."""
        while True:
            try:
                await self.publish()
                records = await read_run(self.node, self.metrics, self.history)
                others = [
                    r for r in records if r["peer_id"] != self.state.peer_id and r["role"] != "bootstrap"
                ]
                self.state.swarm.peers_known = len(others)
                self.metrics.peers_known.set(len(others))
                await self._rejoin_if_isolated(any(r["peer_id"] != self.state.peer_id for r in records))
                self.state.swarm.dht_records = await self.node.dht_records()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the DHT being briefly unreachable must not stop the heartbeat
                log.debug("status publish failed: %r", e)
            await asyncio.sleep(self.interval)

    async def _rejoin_if_isolated(self, seen: bool) -> None:
        """Dial the initial peers again once our DHT has shown no other node (not even the bootstrap) for
        two intervals, and at most every REJOIN_EVERY seconds after: a peer stopped past the DHT's timeouts
        loses every contact, and then trains alone for good (`Node.rejoin`)."""
        now = time.monotonic()
        if seen or not self.node.joins_others:
            self.unseen_since = None
            return
        self.unseen_since = now if self.unseen_since is None else self.unseen_since
        if now - self.unseen_since < 2 * self.interval or now - self.rejoined_at < REJOIN_EVERY:
            return
        self.rejoined_at = now
        nodes = await self.node.rejoin()
        log.info(
            "no other node of the run in our DHT view for %.0fs: dialled the initial peers again (%d in our "
            "routing table now)", now - self.unseen_since, nodes,
        )  # fmt: skip
