"""An auxiliary reducer: a public node that reduces parts of the all-reduce without training.

Peers behind NAT run in client mode: they send and receive but accept no connections, so they
cannot reduce, and a group of clients alone cannot average. A public node that joins each round as an
auxiliary member (it reduces its share of the parts and contributes no weight) makes their rounds
possible; the bootstrap is one by default. It follows the run's clock like every trainer
(`dilocod/rounds/clock.py`): from the trainers' status records it knows the round they train and when
it closes, and enters matchmaking with them at that close, or with overlap at the launch that follows it,
under the trainers' outer step (`dilocod/rounds/helperclock.py`). It publishes a small record under
`<run>.helpers` so that private peers know reducers exist.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from dilocod import __version__
from dilocod.config import Config
from dilocod.diloco.fragments import fragment_of, split_fragments
from dilocod.node.autodeadlines import resolve_deadlines
from dilocod.node.groupsettings import averaging_settings
from dilocod.observability.runview import HELPERS_KEY, NodeRunView
from dilocod.rounds import clock, helperclock
from dilocod.trainer.lm import lm_skeleton
from dilocod.trainer.model import ModelConfig
from peers.group import GroupAverager
from peers.node import Node
from proto import encode_status, encode_ticket

log = logging.getLogger("dilocod.helper")

IDLE_SECONDS = 1.0


def parameter_shapes(model_cfg: ModelConfig) -> list[torch.Size]:
    """The shapes of the run's model's parameters, in state_dict order, without allocating them."""
    return [p.shape for p in lm_skeleton(model_cfg).parameters()]


class AuxReducer:
    def __init__(self, node: Node, cfg: Config, manifest_hash: str) -> None:
        cfg, link = resolve_deadlines(cfg)  # the run's auto deadlines, for this node's link
        self.node, self.cfg, self.manifest_hash = node, cfg, manifest_hash
        shapes = parameter_shapes(cfg.model)
        self.num_elements = sum(s.numel() for s in shapes)
        self.template = [torch.zeros(s) for s in shapes]
        # As the peers', but taking no trainer's seat; only the run's manifest's trainers meet us.
        options = averaging_settings(cfg, "aux", run_tag=manifest_hash, link=link)
        self.group = GroupAverager(node, self.template, options, state_provider=None)
        # Streaming DiLoCo: each round averages one fragment, split exactly as the peers split it.
        self.fragments = (
            split_fragments([s.numel() for s in shapes], cfg.outer.fragments)
            if cfg.outer.overlap == "streaming"
            else None
        )
        count = 1 if self.fragments is None else len(self.fragments)
        t = cfg.trainer
        self.clock = clock.ClockSettings(
            target_tokens=cfg.round.tokens // count,
            reference_tokens=t.inner_steps * t.batch_size * t.seq_len // count,
            max_seconds=cfg.round.max_seconds / count,
            stale_after=max(3 * cfg.net.status_interval, 3.0),
            join_wait=cfg.averaging.state_timeout,
        )
        self.view = NodeRunView(node)
        self.rounds_reduced = 0
        self.last_round = -1
        # The round instance we joined last: the same round opened again after that (a round that failed, or
        # peers that stepped back) is a new instance to join (dilocod/rounds/helperclock.py).
        self.overlapped = cfg.outer.overlap in ("delayed", "streaming")
        self._last: helperclock.Joined | None = None
        self.bytes_sent = self.bytes_received = 0  # tensor payload bytes of every round it reduced in

    def start(self) -> None:
        """Fork the averager (from the main thread: hivemind requires it)."""
        self.group.start()

    def stop(self) -> None:
        self.group.stop()

    async def serve(self, stopping: asyncio.Event) -> None:
        """Join every round of the run at its close, until stopped."""
        while not stopping.is_set():
            try:
                started = time.monotonic()
                await self._publish()
                if time.monotonic() - started > 1.0:
                    log.debug("publishing our helper record took %.1fs", time.monotonic() - started)
                wait = await self._round_or_wait()
                if wait > 0:
                    await asyncio.wait_for(stopping.wait(), wait)
            except TimeoutError:
                continue
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bad round must never stop the helper
                log.warning("aux reducer round failed: %r", e)
                await asyncio.sleep(IDLE_SECONDS)

    async def _round_or_wait(self) -> float:
        """Join the run's round if its group forms now; else how long to wait before looking again."""
        now = time.time()
        # Trainers of another manifest never meet us: their rounds are not ours to follow.
        records = [
            r for r in await self.view.records() if r.get("manifest_hash") in (None, self.manifest_hash)
        ]
        due = helperclock.next_round(records, self.clock, now)
        if due is None:
            log.debug("no live trainer in %d records (%.2fs to read)", len(records), time.time() - now)
            return IDLE_SECONDS
        close = due.close
        log.debug(
            "round %d (key %d, opened %s, %d trainers): closes at %.2f (%s, %.0f of %d tokens at %.0f/s); last joined %s",
            due.round, due.key, due.opened, due.trainers, close.at, close.by, close.expected, close.target,
            close.rate, self._last,
        )  # fmt: skip
        if self.overlapped:
            # The group forms at the launch that opened the trainers' round, under their outer step.
            window = self.cfg.averaging.matchmaking_timeout
            ready, key = helperclock.due_at_launch(self._last, due, now, window), due.key
        else:
            ready, key = helperclock.due_at_close(self._last, due, now), due.round
        if not ready:
            wait = clock.refresh_interval(close, now, self.cfg.net.status_interval)
            return min(wait, close.at - now) if close.at > now else wait
        self._last = helperclock.Joined(due.round, key, now)
        helpers = max(1, len(await self.view.helpers()))  # other reducers of the run join too (we are one)
        await self._reduce(key, due.trainers + helpers)
        return 0.0

    async def _reduce(self, step: int, group_target: int) -> None:
        """Reduce in the group of the trainers' outer step `step` (with streaming, its fragment)."""
        subset = self._fragment(step)
        tensors = self.template if subset is None else [self.template[i] for i in subset]
        outcome = await self.group.average(
            step, self._ticket(step), tensors, subset=subset, group_target=group_target
        )
        self.bytes_sent += outcome.bytes_sent
        self.bytes_received += outcome.bytes_received
        if outcome.found_group and outcome.error is None:
            self.rounds_reduced += 1
            self.last_round = step
            log.info("reduced round %d for a group of %d", step, outcome.group_size)

    def _fragment(self, step: int) -> list[int] | None:
        return None if self.fragments is None else self.fragments[fragment_of(step, len(self.fragments))]

    def _ticket(self, step: int) -> bytes:
        return encode_ticket(
            {
                "outer_step": step, "global_sha256": "0" * 64, "num_params": self.num_elements, "role": "helper",
                "tokens": 0, "tokens_per_second": 0.0, "train_seconds": 0.0, "manifest_hash": self.manifest_hash,
            }
        )  # fmt: skip

    async def _publish(self) -> None:
        record = {
            "peer_id": self.node.peer_id,
            "run_id": self.cfg.run.id,
            "role": "helper",
            "reachability": "public",
            "outer_step": max(self.last_round, 0),
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
            "manifest_hash": self.manifest_hash,
        }
        await self.node.publish(HELPERS_KEY, encode_status(record), ttl=30.0)
