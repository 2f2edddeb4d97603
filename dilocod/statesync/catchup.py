"""Getting back in step with the run: download θ_global and the outer momentum from a peer, verified
against the hashes the run reports, and publish our own for peers that need them.

The round machine (`dilocod/rounds/machine.py`) decides *when* to re-sync (the run is ahead of us, our
round failed while it moved on, we diverged); this is *how*. A donor's word buys nothing: its state is
adopted only if it decodes, has our shapes, is finite, matches its own hash, and that hash is the one most
other peers report for its step (`ledger.py`). Adopting another peer's θ_global forgets our
error-feedback residual, but not (`outer.rebase_on_resync`, on by default, up to `REBASE_MAX_GAP` outer
steps behind) our inner progress that no round has averaged yet: the working copy becomes θ_global' − Δ,
so the tokens of a peer the run left behind still count in its next round.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from dilocod.diloco import OuterConfig, OuterOptimizer, global_sha256, keeps_progress, rebase
from dilocod.statesync.ledger import (
    declared_lie,
    expected_hash,
    minority_holders,
    remember_hashes,
    served_verdict,
)
from dilocod.statesync.parts import PartsSource
from dilocod.trainer import InnerTrainer
from dilocod.trust.hooks import Tampering
from peers.group import DownloadedState, GroupAverager
from proto import ProtoError, decode_state_meta, encode_state_meta

log = logging.getLogger("dilocod.statesync")

DOWNLOAD_ATTEMPTS = 3
CATCH_UP_PASSES = 3  # downloads in a row while the run keeps moving ahead of the state we adopted
RECORD_WAITS = 3  # status intervals to wait for the records of a donor's step
# How often to look for them meanwhile: records land any time, and every second spent here is a second
# the run goes on without us (a re-sync that waited whole intervals often arrived a round late).
RECORD_POLL_SECONDS = 0.25

T = TypeVar("T")
InTrainer = Callable[[Callable[[], T]], Awaitable[T]]
Records = Callable[[], Awaitable[list[dict[str, Any]]]]
Punish = Callable[[list[tuple[str, str]]], Awaitable[None]]
Announce = Callable[[int], Awaitable[None]]
Snapshot = tuple[bytes, list[torch.Tensor]]


@dataclass(frozen=True)
class SyncSettings:
    """What re-syncing reads of the run's settings (built from the config by the node that wires it)."""

    status_interval: float  # net.status_interval: how often the records a state is checked against change
    state_timeout: float  # averaging.state_timeout: how long a download may take
    outer: OuterConfig  # whether an adoption keeps our progress not yet averaged (`rebase_on_resync`)


@dataclass(frozen=True)
class SyncResult:
    adopted: bool
    step: int  # our outer step afterwards
    from_step: int
    kept_progress: bool = False
    donor: str | None = None
    # overlap: the average of the round the donor had in flight at `step` (applied at our next close)
    pending: list[torch.Tensor] | None = None


@dataclass(frozen=True)
class SyncPorts:
    """What re-syncing asks of the rest of the node, as plain functions (the node wires them)."""

    in_trainer: InTrainer[Any]  # run a function on the trainer's thread (adopting writes its weights)
    records: Records  # the run's status records: the θ hashes a donor's state is checked against
    punish: Punish  # ban the peers found lying, with the reason
    banned: Callable[[], list[str]]  # the peers we ban (never asked for the state)
    on_adopted: Callable[[], None]  # a state was adopted: the round pipeline forgets its buffers
    count_bytes: Callable[[int, int], None]  # bytes (sent, received) for the metrics


class StateSync:
    """Serves our θ_global to peers that re-sync, and re-syncs us; everything it needs is passed in."""

    def __init__(
        self,
        settings: SyncSettings,
        outer: OuterOptimizer,
        trainer: InnerTrainer,
        group: GroupAverager,
        tampering: Tampering,
        ports: SyncPorts,
        parts: PartsSource | None = None,
    ) -> None:
        self.settings, self.outer, self.trainer, self.group = settings, outer, trainer, group
        self.tampering, self.ports = tampering, ports
        self.parts = parts  # the download in parts from several donors (None: whole, from one donor)
        self.seen: dict[int, dict[str, str]] = {}  # outer step → peer id → the θ hash it reported there
        self.snapshot: Snapshot | None = None
        self._judging: set[asyncio.Task[None]] = set()  # heads judged once the records cover their step

    # ---- serving ours --------------------------------------------------------------------------------
    def share(self) -> None:
        """Publish a snapshot of θ_global and momentum for peers that need to re-sync from us."""
        # The live tensors, not a copy (8 bytes a parameter): an outer step or an adoption replaces them
        # with new ones (`OuterOptimizer.apply`), so these stay what the snapshot's hash says.
        step, tensors = self.tampering.served_state(self.outer.step, self.outer.state_tensors())
        self.snapshot = (self._meta(tensors, 0), tensors)
        self.group.set_state_step(step)

    def withdraw(self) -> None:
        """Stop offering our state, until the next `share`: the outer step replaces θ_global and the
        momentum tensor by tensor, and each old one is freed at once if the snapshot no longer holds it
        (8 bytes a parameter at the close). A download in progress keeps its snapshot (the state server
        holds what a joiner asked for); a new one meanwhile asks another donor, or us a moment later."""
        self.snapshot = None

    def share_pending(self, step: int, averaged: list[torch.Tensor]) -> None:
        """Overlap: the round we launched at `step` completed; serve its average with our state, so that a
        joiner can apply it at the next close with us instead of missing the group it needed."""
        if self.snapshot is None or step != self.outer.step:
            return
        _, tensors = self.snapshot
        state = tensors[: self._state_count()]
        pending = [a.detach().clone() for a in averaged]
        self.snapshot = (self._meta(state, len(pending)), [*state, *pending])

    def _state_count(self) -> int:
        """How many tensors our state is (θ_global, momentum, and second moments with an adaptive step)."""
        return self.outer.state_width * len(self.outer.params)

    def _meta(self, tensors: list[torch.Tensor], pending: int) -> bytes:
        return encode_state_meta(
            {
                "outer_step": self.outer.step,
                # self-consistent even when poisoned: only the run's published hashes can expose a liar
                "global_sha256": global_sha256(tensors[: len(self.outer.params)]),
                "num_tensors": self._state_count() + pending,
                "param_count": len(self.outer.params),
                "time": time.time(),
                "pending_tensors": pending,
            }
        )

    def current(self) -> Snapshot:
        """What a peer downloading our state gets (called from hivemind's thread)."""
        if self.snapshot is None:
            raise RuntimeError("no state to share yet")
        return self.snapshot

    # ---- catching up ---------------------------------------------------------------------------------
    async def catch_up(self, min_step: int, announce: Announce | None = None) -> SyncResult:
        """Download θ_global from a peer at `min_step` or later (our own step when we diverged).

        `announce(step)` is awaited before each download with the run's outer step (the state we expect),
        so that the run's clock can wait for us (`joining` in our record)."""
        start = self.outer.step
        result = SyncResult(False, start, start)
        # Short rounds can end while a state downloads: go again while the records show the run ahead.
        for attempt in range(CATCH_UP_PASSES):
            wanted = min_step if attempt == 0 else self.outer.step + 1
            once = await self._catch_up_once(wanted, announce)
            if once is None:
                break
            kept, donor, pending = once
            result = SyncResult(True, self.outer.step, start, result.kept_progress or kept, donor, pending)
        return result

    async def _catch_up_once(
        self, min_step: int, announce: Announce | None
    ) -> tuple[bool, str, list[torch.Tensor] | None] | None:
        """One download at `min_step` or later; (progress kept, donor, its round in flight) when adopted."""
        best = max((r["outer_step"] for r in await self.others()), default=-1)
        if best < min_step:  # nobody has what we need (with force, min_step is our own step)
            return None
        if announce is not None:
            await announce(best)
        tried: list[str] = [*self.ports.banned(), *minority_holders(self.seen)]
        for _ in range(DOWNLOAD_ATTEMPTS):
            # The run moves on while a state downloads; the records read meanwhile say what θ the peers
            # held at the step the donor sends, which the donor's state is checked against.
            watcher = asyncio.create_task(self._watch_records())
            try:
                downloaded, donors, again = await self._download(tried, min_step)
            finally:
                watcher.cancel()
            if downloaded is None:
                if again:  # a cut download in parts: the next try keeps the parts that arrived
                    continue
                break
            tried.extend(donors)
            self.ports.count_bytes(0, GroupAverager.payload_bytes(downloaded))
            verdict = await self._verify(downloaded, min_step)
            if verdict is None:
                kept = await self._adopt(downloaded)
                return kept, downloaded.donor, self._pending(downloaded)
            problem, lie = verdict
            log.warning("refused state from %s: %s", ", ".join(donors), problem)
            if lie:  # only evidence of lying is punished; a donor ahead of the records is merely early
                await self.ports.punish(
                    [
                        (d, f"served state that was refused: {problem}")
                        for d in self._liars(downloaded, donors)
                    ]
                )
        log.warning("could not re-sync from peers (best known outer step %d); training on", best)
        return None

    async def _download(
        self, tried: list[str], min_step: int
    ) -> tuple[DownloadedState | None, list[str], bool]:
        """(the state, the donors that declared it, whether a cut download is worth another try). In parts
        from several donors at once; whole from one donor when no donor serves parts."""
        timeout = self.group.state_timeout(self.settings.state_timeout)
        if self.parts is not None:
            fetched = await self.parts.fetch(await self.others(), tried, min_step, timeout)
            if fetched.liars:  # a part whose bytes miss the digest its donor declared: banned at once
                await self.ports.punish(fetched.liars)
                tried.extend(d for d, _ in fetched.liars)
            await self._hold_outvoted(fetched.outvoted, tried)
            if fetched.state is not None or fetched.resumable:
                return fetched.state, fetched.donors, fetched.resumable
        downloaded = await self.group.download_state(
            exclude=tried,
            min_step=min_step,
            max_elements=3 * self.outer.num_elements,  # θ_global, momentum, a round in flight
            timeout=timeout,
        )
        return downloaded, [] if downloaded is None else [downloaded.donor], False

    def _liars(self, downloaded: DownloadedState, donors: list[str]) -> list[str]:
        """Of the donors that declared a refused state, those whose own record does not report it (one that
        does holds a minority θ_global: no lie, see `served_verdict`)."""
        if len(donors) < 2:
            return donors  # the whole-state path's one donor: `_verify` judged it
        meta = decode_state_meta(downloaded.meta)  # decoded by the downloader already: valid
        reports = self.seen.get(meta["outer_step"], {})
        return [d for d in donors if reports.get(d) != meta["global_sha256"]]

    async def _watch_records(self) -> None:
        while True:
            await asyncio.sleep(self.settings.status_interval)
            await self.others()

    async def _hold_outvoted(self, outvoted: dict[str, bytes], tried: list[str]) -> None:
        """Donors whose head most others contradict are not asked for parts; one that declared a θ_global
        the run's records contradict at its step lies (a `bad_donor`), and is refused and punished as if
        its whole state had been downloaded. One a round ahead or behind, or of a split group, is not.
        A head at a step the records do not cover yet (a donor that just closed a round) is judged once
        they arrive, in the background: the download goes on without it meanwhile."""
        liars: list[tuple[str, str]] = []
        undecided: dict[str, bytes] = {}
        for donor, blob in outvoted.items():
            problem = self._outvoted_lie(donor, blob)
            if problem is None and self._awaits_records(donor, blob):
                undecided[donor] = blob
            elif problem is not None:
                liars.append(self._refuse(donor, problem))
                tried.append(donor)
        if liars:
            await self.ports.punish(liars)
        if undecided:
            task = asyncio.create_task(self._judge_when_recorded(undecided))
            self._judging.add(task)
            task.add_done_callback(self._judging.discard)

    async def _judge_when_recorded(self, heads: dict[str, bytes]) -> None:
        """Punish the donors among `heads` whose declared θ_global the records contradict, as the records
        for their steps arrive (for as long as `_verify` waits for a downloaded state's)."""
        deadline = time.monotonic() + RECORD_WAITS * self.settings.status_interval
        while heads and time.monotonic() < deadline:
            await asyncio.sleep(min(RECORD_POLL_SECONDS, self.settings.status_interval))
            await self.others()
            liars = [
                self._refuse(d, p) for d, b in heads.items() if (p := self._outvoted_lie(d, b)) is not None
            ]
            heads = {d: b for d, b in heads.items() if self._awaits_records(d, b)}
            if liars:
                await self.ports.punish(liars)

    @staticmethod
    def _refuse(donor: str, problem: str) -> tuple[str, str]:
        log.warning("refused state from %s: %s", donor, problem)
        return donor, f"served state that was refused: {problem}"

    def _awaits_records(self, donor: str, blob: bytes) -> bool:
        """Whether no record judges the head yet (its step is newer than the records we read)."""
        try:
            step = decode_state_meta(blob)["outer_step"]
        except ProtoError:
            return False
        return expected_hash(self.seen, step, donor) is None

    def _outvoted_lie(self, donor: str, blob: bytes) -> str | None:
        try:
            meta = decode_state_meta(blob)
        except ProtoError as e:
            return f"bad metadata: {e}"
        return declared_lie(self.seen, meta["outer_step"], donor, meta["global_sha256"])

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
        # The donor's own record only counts when nobody else reports that step (a run of two cannot tell
        # who lies anyway). Records can lag a donor that just finished a round: wait a little for them.
        deadline = time.monotonic() + RECORD_WAITS * self.settings.status_interval
        while True:
            await self.others()
            agreed = expected_hash(self.seen, step, downloaded.donor)
            if agreed is not None:
                return served_verdict(self.seen, step, downloaded.donor, meta["global_sha256"], agreed)
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(min(RECORD_POLL_SECONDS, self.settings.status_interval))
        return f"no θ_global for outer step {step} is reported by more peers than any other", False

    def _check_content(self, tensors: list[torch.Tensor], meta: dict[str, Any]) -> str | None:
        """Shapes, dtype, finiteness, and the donor's hash of what it actually sent."""
        n, state = len(self.outer.params), self._state_count()
        pending = meta.get("pending_tensors") or 0
        if len(tensors) != state + pending or meta["param_count"] != n or pending > n:
            return f"expected {state + pending} tensors, got {len(tensors)}"
        for own, new in zip(self.outer.state_tensors(), tensors):
            if new.shape != own.shape or new.dtype != torch.float32 or not bool(torch.isfinite(new).all()):
                return "a tensor has the wrong shape, dtype or non-finite values"
        # the shapes of a round's average depend on its fragment: the pipeline checks them before use
        for new in tensors[state:]:
            if new.dtype != torch.float32 or not bool(torch.isfinite(new).all()):
                return "its round in flight has the wrong dtype or non-finite values"
        if global_sha256(tensors[:n]) != meta["global_sha256"]:
            return "its θ_global does not match its own hash"
        return None

    def _pending(self, downloaded: DownloadedState) -> list[torch.Tensor] | None:
        """The donor's round in flight, if it sent one (checked for dtype and finiteness already)."""
        return list(downloaded.tensors[self._state_count() :]) or None

    async def _adopt(self, downloaded: DownloadedState) -> bool:
        """Adopt the state; whether our progress not yet averaged was kept (rebased onto it)."""
        meta = decode_state_meta(downloaded.meta)
        state = downloaded.tensors[: self._state_count()]
        kept = await self.ports.in_trainer(lambda: self.adopt_in_trainer(meta["outer_step"], state))
        self.share()
        log.info(
            "re-synced to outer step %d from %s (θ %s)%s%s",
            self.outer.step, downloaded.donor, self.outer.sha256[:12],
            "" if kept is None else f", keeping our progress not yet averaged (‖Δ‖ = {kept:.4g})",
            ", with the round it had in flight" if meta.get("pending_tensors") else "",
        )  # fmt: skip
        return kept is not None

    def adopt_in_trainer(self, step: int, tensors: list[torch.Tensor]) -> float | None:
        """Adopt a donor's θ_global and momentum; returns ‖Δ‖ of the progress kept, or None if dropped."""
        keep = keeps_progress(self.settings.outer, self.outer.step, step)
        local = self.trainer.working_params_fp32() if keep else None
        old_global = [p.clone() for p in self.outer.params] if keep else None
        self.outer.load_state(step, tensors)
        self.ports.on_adopted()
        if local is None or old_global is None:
            self.trainer.load_params(self.outer.params)
            return None
        # θ_local' = θ_global' − Δ: the next round sends this progress with what follows it
        self.trainer.load_params(rebase(local, old_global, self.outer.params))
        return math.sqrt(sum(float((g - t).square().sum()) for g, t in zip(old_global, local)))

    async def others(self) -> list[dict[str, Any]]:
        """The other trainers' records (remembered in the ledger); [] when the DHT cannot be read."""
        try:
            records = await self.ports.records()
        except Exception as e:
            log.debug("could not read the run's records: %r", e)
            return []
        remember_hashes(self.seen, records)
        return records
