"""Getting back in step with the run: download θ_global and the outer momentum from a peer, verified
against the hashes the run reports, and publish our own for peers that need them.

`RoundKeeper` (`dilocod/rounds.py`) decides *when* to re-sync (a failed round, the minority of a group,
a run that went on without us); this mixin is *how*. A donor's word buys nothing: its state is adopted
only if it decodes, has our shapes, is finite, matches its own hash, and that hash is the one most other
peers report for its step. Adopting another peer's θ_global forgets our error-feedback residual, but not
(`outer.rebase_on_resync`, up to `REBASE_MAX_GAP` outer steps behind) our inner progress that no round
has averaged yet: the working copy becomes θ_global' − Δ, so a straggler's H steps are sent, not lost.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from dilocod.adversary import Adversary
from dilocod.bans import BanList
from dilocod.codecs import ErrorFeedback
from dilocod.config import Config
from dilocod.diloco import OuterOptimizer, global_sha256, keeps_progress, rebase
from dilocod.metrics import Metrics
from dilocod.peerstate import PeerState
from dilocod.trainer import InnerTrainer
from peers.group import DownloadedState, GroupAverager
from proto import ProtoError, decode_state_meta, encode_state_meta

if TYPE_CHECKING:
    from dilocod.daemon import PeerDaemon

log = logging.getLogger("dilocod.catchup")

DOWNLOAD_ATTEMPTS = 3
CATCH_UP_PASSES = 3  # downloads in a row while the run keeps moving ahead of the state we adopted
RECORD_WAITS = 3  # status intervals to wait for the records of a donor's step


class CatchUp:
    """Mixed into `RoundKeeper`: uses its attributes and its round bookkeeping."""

    cfg: Config
    state: PeerState
    metrics: Metrics
    trainer: InnerTrainer
    outer: OuterOptimizer
    group: GroupAverager
    daemon: PeerDaemon
    bans: BanList
    adversary: Adversary
    feedback: ErrorFeedback | None
    _seen_hashes: dict[int, dict[str, str]]  # outer step → peer id → the θ hash it reported there
    _others_seen_at: float  # monotonic time we last read another peer's record (-inf: never)

    if TYPE_CHECKING:  # defined by RoundKeeper

        @property
        def sync_every(self) -> int: ...

        def _count_bytes(self, sent: int, received: int) -> None: ...
        async def _punish(self, caught: list[tuple[str, str]]) -> None: ...
        def _record(
            self, result: str, group_size: int, seconds: float, eval_loss: float | None = None
        ) -> None: ...
        def _after_new_global(self) -> None: ...
        async def _in_trainer(self, fn: Any) -> Any: ...

    # ---- serving ours --------------------------------------------------------------------------------
    def share_state(self) -> None:
        """Publish a snapshot of θ_global and momentum for peers that need to re-sync from us."""
        tensors = self.adversary.poison_state([t.clone() for t in self.outer.state_tensors()])
        meta = encode_state_meta(
            {
                "outer_step": self.outer.step,
                # self-consistent even when poisoned: only the run's published hashes can expose a liar
                "global_sha256": global_sha256(tensors[: len(self.outer.params)]),
                "num_tensors": 2 * len(self.outer.params),
                "param_count": len(self.outer.params),
                "time": time.time(),
            }
        )
        self.daemon.set_snapshot((meta, tensors))
        self.group.set_state_step(self.adversary.declared_state_step(self.outer.step))

    # ---- catching up -----------------------------------------------------------------------------------
    async def catch_up(self, *, force: bool = False) -> bool:
        """Download θ_global from a peer if the run is ahead of us (or, with `force`, if we diverged)."""
        adopted = False
        # Short rounds can end while a state downloads: looking for a group at the step we adopted would
        # then cost a whole matchmaking timeout, so go again while the records show the run ahead.
        for _ in range(CATCH_UP_PASSES):
            if not await self._catch_up_once(force=force and not adopted):
                break
            adopted = True
        return adopted

    async def _catch_up_once(self, *, force: bool) -> bool:
        others = await self._other_peers()
        best = max((r["outer_step"] for r in others), default=-1)
        if best < self.outer.step or (best == self.outer.step and not force):
            return False
        self.state.phase = "syncing"
        min_step = self.outer.step if force else self.outer.step + 1
        tried: list[str] = self.bans.peer_ids()
        for _ in range(DOWNLOAD_ATTEMPTS):
            # The run moves on while a state downloads; the records read meanwhile say what θ the peers
            # held at the step the donor sends, which the donor's state is checked against.
            watcher = asyncio.create_task(self._watch_records())
            try:
                downloaded = await self.group.download_state(
                    exclude=tried,
                    min_step=min_step,
                    max_elements=2 * self.outer.num_elements,
                    timeout=self.cfg.averaging.state_timeout,
                )
            finally:
                watcher.cancel()
            if downloaded is None:
                break
            tried.append(downloaded.donor)
            self._count_bytes(0, GroupAverager.payload_bytes(downloaded))
            verdict = await self._verify(downloaded, min_step)
            if verdict is None:
                await self._adopt(downloaded)
                return True
            problem, lie = verdict
            log.warning("refused state from %s: %s", downloaded.donor, problem)
            if lie:  # only evidence of lying is punished; a donor ahead of the records is merely early
                await self._punish([(downloaded.donor, f"served state that was refused: {problem}")])
        log.warning("could not re-sync from peers (best known outer step %d); training on", best)
        return False

    async def _watch_records(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.net.status_interval)
            await self._other_peers()

    async def _verify(self, downloaded: DownloadedState, min_step: int) -> tuple[str, bool] | None:
        """None if the state may be adopted, else (why not, whether that proves the donor lied)."""
        try:
            meta = decode_state_meta(downloaded.meta)
        except ProtoError as e:
            return f"bad metadata: {e}", True
        problem = self._check_content(downloaded.tensors, meta)
        if problem is not None:
            return problem, True
        step = meta["outer_step"]
        if step < min_step:
            return f"it is at outer step {step}, we need {min_step}", False
        # The hash a step's θ must have is what the *other* peers report; the donor's own record only counts
        # when nobody else reports that step (a run of two cannot tell who lies anyway). Records can lag a
        # donor that just finished a round, so wait a little for them; and the run can move on while a
        # large state downloads, so what peers reported for earlier steps is kept (`_seen_hashes`).
        for attempt in range(RECORD_WAITS + 1):
            await self._other_peers()  # records only say where peers are now: the ledger remembers
            agreed = expected_hash(self._seen_hashes, step, downloaded.donor)
            if agreed is not None:
                if agreed != meta["global_sha256"]:
                    return "its θ_global is not the one most peers report for that step", True
                return None
            if attempt < RECORD_WAITS:
                await asyncio.sleep(self.cfg.net.status_interval)
        return f"no peer reports a θ_global for outer step {step}", False

    def _check_content(self, tensors: list[torch.Tensor], meta: dict[str, Any]) -> str | None:
        """Shapes, dtype, finiteness, and the donor's hash of what it actually sent."""
        n = len(self.outer.params)
        if len(tensors) != 2 * n or meta["param_count"] != n:
            return f"expected {2 * n} tensors, got {len(tensors)}"
        for own, new in zip(self.outer.state_tensors(), tensors):
            if new.shape != own.shape or new.dtype != torch.float32 or not bool(torch.isfinite(new).all()):
                return "a tensor has the wrong shape, dtype or non-finite values"
        if global_sha256(tensors[:n]) != meta["global_sha256"]:
            return "its θ_global does not match its own hash"
        return None

    async def _adopt(self, downloaded: DownloadedState) -> None:
        meta = decode_state_meta(downloaded.meta)
        kept = await self._in_trainer(lambda: self._adopt_in_trainer(meta["outer_step"], downloaded.tensors))
        self.state.resyncs += 1
        self.metrics.resyncs.inc()
        self.state.alone = False
        self._record("resynced", 0, 0.0)
        self._after_new_global()
        self.state.round_steps = await self._run_phase()
        log.info(
            "re-synced to outer step %d from %s (θ %s)%s; joining the round at inner step %d of %d",
            self.outer.step,
            downloaded.donor,
            self.outer.sha256[:12],
            "" if not kept else f", keeping our progress not yet averaged (‖Δ‖ = {kept:.4g})",
            self.state.round_steps,
            self.sync_every,
        )
        await self.daemon.publish_status()

    async def _run_phase(self) -> int:
        """Where the peers at our new outer step are in their round. Training all H steps after a re-sync
        would bring us to the next matchmaking a whole re-sync late, after the group formed without us,
        and so on every round; training only the rest of the round brings us there with them."""
        if not self.cfg.outer.join_in_phase:
            return 0
        others = await self._other_peers()
        return run_phase(
            others,
            self.outer.step,
            now=time.time(),
            tokens_per_step=self.trainer.tokens_per_step,
            sync_every=self.sync_every,
            max_age=2 * self.cfg.net.status_interval,
        )

    def _adopt_in_trainer(self, step: int, tensors: list[torch.Tensor]) -> float | None:
        """Adopt a donor's θ_global and momentum; returns ‖Δ‖ of the progress kept, or None if dropped."""
        keep = keeps_progress(self.cfg.outer, self.outer.step, step)
        local = self.trainer.working_params_fp32() if keep else None
        old_global = [p.clone() for p in self.outer.params] if keep else None
        self.outer.load_state(step, tensors)
        if self.feedback is not None:  # the residual belonged to the θ_global we just left
            self.feedback.reset()
        if local is None or old_global is None:
            self.trainer.load_params(self.outer.params)
            return None
        # θ_local' = θ_global' − Δ: the next round sends this progress with what follows it
        self.trainer.load_params(rebase(local, old_global, self.outer.params))
        return math.sqrt(sum(float((g - t).square().sum()) for g, t in zip(old_global, local)))

    async def _other_peers(self) -> list[dict[str, Any]]:
        try:
            records = await self.daemon.run_view()
        except Exception as e:
            log.debug("could not read the run's records: %r", e)
            return []
        others = [r for r in records if r["peer_id"] != self.state.peer_id and r["role"] == "peer"]
        remember_hashes(self._seen_hashes, others)
        if others:
            self._others_seen_at = time.monotonic()
        return others


def remember_hashes(seen: dict[int, dict[str, str]], records: list[dict[str, Any]], keep: int = 32) -> None:
    """Add each record's (outer step, θ hash) to `seen` (step → peer id → hash), for the `keep` latest steps."""
    for record in records:
        seen.setdefault(record["outer_step"], {})[record["peer_id"]] = record["global_sha256"]
    for step in sorted(seen)[:-keep]:
        del seen[step]


def expected_hash(seen: dict[int, dict[str, str]], step: int, donor: str) -> str | None:
    """The θ hash most peers other than `donor` reported for `step`; the donor's own report only when
    nobody else reported that step; None when nobody did."""
    reports = seen.get(step, {})
    others = Counter(h for peer, h in reports.items() if peer != donor)
    if others:
        return others.most_common(1)[0][0]
    return reports.get(donor)


def run_phase(
    records: list[dict[str, Any]],
    step: int,
    *,
    now: float,
    tokens_per_step: int,
    sync_every: int,
    max_age: float,
) -> int:
    """Inner steps into the current round that the peers at `step` have reached by `now`: the median of
    their `round_steps`, each moved on at its throughput for the age of its record (at most `max_age`:
    clocks differ), and at most `sync_every` − 1 so that we take at least one step. 0 if none says."""
    places = []
    for record in records:
        if record["outer_step"] != step or record.get("round_steps") is None:
            continue
        age = min(max(0.0, now - record["time"]), max_age)
        places.append(record["round_steps"] + age * record["tokens_per_second"] / max(tokens_per_step, 1))
    if not places:
        return 0
    return max(0, min(int(statistics.median(places)), sync_every - 1))
