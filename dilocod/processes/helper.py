"""An auxiliary reducer: a public node that reduces parts of the all-reduce without training.

Peers behind NAT run in client mode: they send and receive but accept no connections, so they
cannot reduce, and a group of clients alone cannot average. A public node that joins each round as an
auxiliary member (it reduces its share of the parts and contributes no weight) makes their rounds
possible; the bootstrap is one by default. It follows the run's outer steps from the status records
and publishes a small record under `<run>.helpers` so that private peers know reducers exist.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

import torch

from dilocod import __version__
from dilocod.config import Config
from dilocod.diloco.fragments import fragment_of, split_fragments
from dilocod.groupoptions import averaging_options
from dilocod.trainer.model import PRESETS, Transformer
from peers.group import GroupAverager
from peers.node import Node
from proto import encode_status, encode_ticket

log = logging.getLogger("dilocod.helper")

HELPERS_KEY = "helpers"
IDLE_SECONDS = 1.0


def parameter_shapes(preset: str) -> list[torch.Size]:
    """The shapes of the preset's parameters, in state_dict order, without allocating them."""
    with torch.device("meta"):
        model = Transformer(PRESETS[preset])
    return [p.shape for p in model.parameters()]


class AuxReducer:
    def __init__(self, node: Node, cfg: Config) -> None:
        self.node, self.cfg = node, cfg
        shapes = parameter_shapes(cfg.model.preset)
        self.num_elements = sum(s.numel() for s in shapes)
        self.template = [torch.zeros(s) for s in shapes]
        options = averaging_options(cfg, "aux")  # as the peers', but taking no trainer's seat
        self.group = GroupAverager(node, self.template, options, state_provider=None)
        # Streaming DiLoCo: each round averages one fragment, split exactly as the peers split it.
        self.fragments = (
            split_fragments([s.numel() for s in shapes], cfg.outer.fragments)
            if cfg.outer.overlap == "streaming"
            else None
        )
        self.rounds_reduced = 0
        self.last_step = -1
        self.reduced_at = 0.0  # monotonic time of the last round reduced for ≥ 2 trainers
        # How long peers' records may still show a step after its round ended (published every interval).
        self.record_lag = max(10.0, 3 * cfg.net.status_interval)
        self.bytes_sent = self.bytes_received = 0  # tensor payload bytes of every round it reduced in

    def start(self) -> None:
        """Fork the averager (from the main thread: hivemind requires it)."""
        self.group.start()

    def stop(self) -> None:
        self.group.stop()

    async def serve(self, stopping: asyncio.Event, run_view: Any) -> None:
        """Join every round the run's peers are about to run, until stopped."""
        while not stopping.is_set():
            try:
                await self._publish()
                step = self._target(await run_view())
                if step is None:
                    await asyncio.wait_for(stopping.wait(), IDLE_SECONDS)
                    continue
                subset = self._fragment(step)
                tensors = self.template if subset is None else [self.template[i] for i in subset]
                outcome = await self.group.average(step, self._ticket(step), tensors, subset=subset)
                self.bytes_sent += outcome.bytes_sent
                self.bytes_received += outcome.bytes_received
                if outcome.found_group and outcome.error is None:
                    self.rounds_reduced += 1
                    # A round with one trainer does not count for it (rounds.py: it retries the same
                    # step), so we stay at that step too; moving on would leave private peers with no
                    # reducer at the step they retry, for ever.
                    if outcome.contributors > 1:
                        self.last_step, self.reduced_at = step, time.monotonic()
                    log.info("reduced round %d for a group of %d", step, outcome.group_size)
            except TimeoutError:
                continue
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bad round must never stop the helper
                log.warning("aux reducer round failed: %r", e)
                await asyncio.sleep(IDLE_SECONDS)

    def _target(self, records: list[dict[str, Any]], now: float | None = None) -> int | None:
        """The outer step most live peers are at, or the next one after the round we just reduced: their
        records lag a round that just ended. Once that lag is over, where they are wins even if it is a step
        we reduced already: peers that stepped back (dilocod/stepback.py) retry it, and need a reducer."""
        steps = Counter(r["outer_step"] for r in records if r["role"] == "peer")
        if not steps:
            return None
        common = steps.most_common(1)[0][0]
        if self.last_step < 0 or common > self.last_step:
            return common
        now = time.monotonic() if now is None else now
        return self.last_step + 1 if now - self.reduced_at < self.record_lag else common

    def _fragment(self, step: int) -> list[int] | None:
        return None if self.fragments is None else self.fragments[fragment_of(step, len(self.fragments))]

    def _ticket(self, step: int) -> bytes:
        return encode_ticket(
            {"outer_step": step, "global_sha256": "0" * 64, "num_params": self.num_elements, "role": "helper"}
        )

    async def _publish(self) -> None:
        record = {
            "peer_id": self.node.peer_id,
            "run_id": self.cfg.run.id,
            "role": "helper",
            "reachability": "public",
            "outer_step": max(self.last_step, 0),
            "inner_step": 0,
            "tokens_per_second": 0.0,
            "global_sha256": "0" * 64,
            "group_size": 0,
            "alone": False,
            "rounds_ok": self.rounds_reduced,
            "rounds_failed": 0,
            "time": time.time(),
            "version": __version__,
            "maddrs": self.node.visible_maddrs()[:4],
        }
        await self.node.publish(HELPERS_KEY, encode_status(record), ttl=30.0)
