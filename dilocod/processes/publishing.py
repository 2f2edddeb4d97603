"""What a peer tells the world and the disk: its status record in the DHT, and its checkpoint.

This is the round driver's `Publisher` port. Status records go out every `net.status_interval` seconds
(the heartbeat, which also reads the run for the dashboard's history) and at once whenever the round
driver asks (a new θ_global: the others' clocks should know). A checkpoint's tensors are copied in the
trainer thread, then written to disk in the background while training goes on; a second checkpoint
waits for the first, and the last one is awaited at shutdown.
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
from dilocod.statesync.checkpoint import save_checkpoint
from peers.node import Node
from proto import ProtoError, encode_status

log = logging.getLogger("dilocod.publishing")


class CheckpointWriter:
    def __init__(
        self,
        run_dir: Path,
        payload: Callable[[], dict[str, Any]],
        in_trainer: Callable[[Callable[[], dict[str, Any]]], Any],
        metrics: Metrics,
    ) -> None:
        self.run_dir, self._payload, self._in_trainer, self.metrics = run_dir, payload, in_trainer, metrics
        self._writing: asyncio.Task[None] | None = None

    async def checkpoint(self) -> None:
        """Copy the state now (trainer thread), write it in the background."""
        await self.flush()
        payload = await self._in_trainer(self._payload)
        self._writing = asyncio.create_task(self._write(payload, time.monotonic()))

    async def _write(self, payload: dict[str, Any], started: float) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(None, save_checkpoint, self.run_dir, payload)
            self.metrics.checkpoint_seconds.observe(time.monotonic() - started)
        except Exception as e:  # a full disk must not stop training; the next checkpoint tries again
            log.error("could not write a checkpoint: %s", e)

    async def flush(self) -> None:
        """Wait for a checkpoint being written."""
        if self._writing is not None:
            await self._writing
            self._writing = None


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
                self.state.peers_known = len(others)
                self.metrics.peers_known.set(self.state.peers_known)
                self.state.dht_records = await self.node.dht_records()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the DHT being briefly unreachable must not stop the heartbeat
                log.debug("status publish failed: %r", e)
            await asyncio.sleep(self.interval)
