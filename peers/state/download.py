"""A state download from several donors at once, driven by the part plan (peers/state/parts.py).

Every donor is asked for the head of the snapshot it serves (proto/state.py); the heads most donors agree
on (the same metadata apart from its time, the same tensor shapes and part digests) set the plan, and the
donors that declared them fetch its parts in parallel, one part per donor at a time, straight into one
buffer (the downloaded state is a view of it: no second copy). Each part's sha256 is checked as it
arrives: bytes other than the agreed digest are a lie (the donor is named in `liars` and asked nothing
more; the part comes from another donor), a part that does not come in time or breaks off goes back to
the queue. A download that ends unfinished (its deadline passed, every donor failed) keeps its buffer:
the next one, if its heads describe the same layout, keeps the parts whose bytes still match.

The whole θ_global is not checked here: the caller holds it to the run's reported hash, as for any state.
The transport is passed in (`peers.state.share.P2PStateClient` on the wire; tests give in-process fakes).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from peers.state.parts import PartPlan, agreed_digests, resumed_parts, split_parts
from proto import ProtoError, decode_state_meta
from proto.state import parse_shape

log = logging.getLogger("peers.state.download")

HEAD_TIMEOUT = 10.0  # seconds a donor has to describe its snapshot
MIN_PART_TIMEOUT = 15.0  # the least a part is given, however small
MAX_DONORS = 8  # donors asked at once; more add requests, not bandwidth
# Parts each donor sends at once: with one, its link idles for a round trip between parts, and on a long
# link one stream's flow-control window caps it (bench/statedonors.py: 256 MB over 100 Mbit/s, 20 ms: 0.72
# of the bound with 2, 0.89 with 4). The plan gives each donor this many slots ("<donor>#<k>"); a lie by
# one slot bans them all, and a failure counts against all of them.
IN_FLIGHT = 4


class StateTransport(Protocol):
    async def head(self, donor: str, timeout: float) -> dict[str, Any]: ...

    async def part(self, donor: str, snapshot: str, index: int, into: memoryview) -> None: ...


@dataclass(frozen=True)
class Layout:
    """How a snapshot's bytes are laid out: what two heads must share for their parts to be the same."""

    total: int
    part_bytes: int
    shapes: tuple[tuple[int, ...], ...]


@dataclass
class _Partial:
    """A download's buffer and the digests of the parts stored in it (kept across a cut for a resume)."""

    layout: Layout
    buffer: bytearray
    stored: dict[int, str] = field(default_factory=dict)


@dataclass
class PartsResult:
    """What a download brought: the state (None if unfinished) and who did what."""

    meta: bytes | None = None
    tensors: list[torch.Tensor] = field(default_factory=list)
    donors: list[str] = field(default_factory=list)  # the donors that declared the agreed snapshot
    parts_from: Counter[str] = field(default_factory=Counter)  # donor → parts it delivered that were kept
    liars: list[tuple[str, str]] = field(default_factory=list)  # (donor, why)
    # donors whose head most others contradict → the metadata they declared (the caller holds it to the
    # run's records: a θ hash nobody reported is a lie; one round behind or ahead is not)
    outvoted: dict[str, bytes] = field(default_factory=dict)
    resumed: int = 0  # parts kept from an earlier, cut download
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.meta is not None


Progress = Callable[[dict[str, Any]], None]


class PartsDownload:
    """Downloads states; holds the buffer of a cut one until the next download resumes or replaces it."""

    def __init__(
        self,
        transport: StateTransport,
        *,
        max_bytes: int,
        head_timeout: float = HEAD_TIMEOUT,
        min_part_timeout: float = MIN_PART_TIMEOUT,
        max_failures: int = 3,
        on_progress: Progress | None = None,
    ) -> None:
        self.transport = transport
        self.max_bytes = max_bytes  # a donor declaring a larger state is not asked (our model bounds it)
        self.head_timeout, self.min_part_timeout = head_timeout, min_part_timeout
        self.max_failures = max_failures
        self.on_progress = on_progress
        self.partial: _Partial | None = None

    async def download(self, donors: Sequence[str], timeout: float) -> PartsResult:
        """The state most of `donors` serve, within `timeout` seconds (a cut download can be resumed)."""
        deadline = time.monotonic() + timeout
        heads = await self._heads(list(donors)[:MAX_DONORS])
        if not heads:
            return PartsResult(error="no donor described its state")
        described = {donor: _describe(head) for donor, (head, _) in heads.items()}
        declared = {donor: (key, *heads[donor][0]["digests"]) for donor, (key, _) in described.items()}
        agreed, agreeing = agreed_digests(declared, {donor: new for donor, (_, new) in described.items()})
        if agreed is None:
            return PartsResult(error=f"the {len(heads)} donors do not agree on a state")
        outvoted = {donor: heads[donor][0]["meta"] for donor in heads if donor not in agreeing}
        head, layout = heads[agreeing[0]]
        expected = tuple(agreed[1:])
        partial = self._buffer(layout, expected)
        plan = PartPlan(
            split_parts(layout.total, layout.part_bytes), expected, _slots(agreeing),
            max_failures=self.max_failures, done=resumed_parts(partial.stored, expected),
        )  # fmt: skip
        result = PartsResult(donors=list(agreeing), resumed=len(plan.done), outvoted=outvoted)
        snapshots = {donor: heads[donor][0]["snapshot"] for donor in agreeing}
        # Twice a part's share of the whole download's time (each donor sends IN_FLIGHT at once), but at
        # most half of it: a stalled part must leave time to fetch it again from another donor.
        share = IN_FLIGHT * timeout * layout.part_bytes * len(agreeing) / max(layout.total, 1)
        part_timeout = max(self.min_part_timeout, min(timeout / 2, 2 * share))
        self._report(plan, head, result)
        await self._fetch(plan, partial, snapshots, part_timeout, deadline, head, result)
        for donor in sorted({_donor(slot) for slot in plan.banned}):
            result.liars.append((donor, "sent a state part whose bytes do not match the digest it declared"))
        if not plan.finished:
            result.error = f"{len(plan.done)} of {len(plan.parts)} parts arrived" + (
                " before the deadline" if time.monotonic() >= deadline else ": no donor left to ask"
            )
            return result
        self.partial = None  # the state is the caller's now (views of the buffer)
        result.meta, result.tensors = head["meta"], _tensors(partial.buffer, layout)
        return result

    async def _heads(self, donors: list[str]) -> dict[str, tuple[dict[str, Any], Layout]]:
        """Each donor's head and layout; a donor that fails, refuses, or declares more than we can hold is left out."""

        async def one(donor: str) -> tuple[dict[str, Any], Layout] | None:
            try:
                head = await asyncio.wait_for(
                    self.transport.head(donor, self.head_timeout), self.head_timeout
                )
                layout = Layout(
                    head["total_bytes"], head["part_bytes"], tuple(parse_shape(s) for s in head["shapes"])
                )
                decode_state_meta(head["meta"])
            except Exception as e:  # TimeoutError included
                log.info("state head from %s failed: %r", donor, e)
                return None
            if layout.total > self.max_bytes:
                log.info(
                    "donor %s declares a state of %d bytes (we hold at most %d)",
                    donor,
                    layout.total,
                    self.max_bytes,
                )
                return None
            return head, layout

        found = await asyncio.gather(*(one(d) for d in donors))
        return {donor: got for donor, got in zip(donors, found) if got is not None}

    def _buffer(self, layout: Layout, expected: Sequence[str]) -> _Partial:
        """The buffer of a cut download of this layout (its matching parts kept), or a new one."""
        if self.partial is None or self.partial.layout != layout:
            self.partial = _Partial(layout, bytearray(layout.total))
        kept = resumed_parts(self.partial.stored, expected)
        self.partial.stored = {i: d for i, d in self.partial.stored.items() if i in kept}
        return self.partial

    async def _fetch(
        self,
        plan: PartPlan,
        partial: _Partial,
        snapshots: dict[str, str],
        part_timeout: float,
        deadline: float,
        head: dict[str, Any],
        result: PartsResult,
    ) -> None:
        view = memoryview(partial.buffer)
        running: dict[asyncio.Task[str | None], tuple[str, int]] = {}
        try:
            while not plan.finished:
                for slot, part in plan.assign():
                    donor = _donor(slot)
                    task = asyncio.ensure_future(
                        self._one_part(
                            donor, snapshots[donor], part.index, view[part.start : part.end], part_timeout
                        )
                    )
                    running[task] = (slot, part.index)
                left = deadline - time.monotonic()
                if not running or left <= 0:
                    return
                done, _ = await asyncio.wait(running, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    slot, index = running.pop(task)
                    digest, donor = task.result(), _donor(slot)
                    if digest is None:  # counts against the donor, every slot of it
                        for sibling in _slots([donor]):
                            plan.failed(sibling, index)
                    elif plan.received(slot, index, digest):
                        partial.stored[index] = digest
                        result.parts_from[donor] += 1
                    else:
                        log.warning("state part %d from %s does not match its digest: a lie", index, donor)
                        plan.banned.update(_slots([donor]))  # its other slots too: asked nothing more
                self._report(plan, head, result)
        finally:
            for task in running:
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)

    async def _one_part(
        self, donor: str, snapshot: str, index: int, into: memoryview, timeout: float
    ) -> str | None:
        """The sha256 of the part as it arrived, or None if it did not."""
        try:
            await asyncio.wait_for(self.transport.part(donor, snapshot, index, into), timeout)
        except Exception as e:  # TimeoutError included
            log.info("state part %d from %s failed: %r", index, donor, e)
            return None
        return await asyncio.to_thread(lambda: hashlib.sha256(into).hexdigest())

    def _report(self, plan: PartPlan, head: dict[str, Any], result: PartsResult) -> None:
        if self.on_progress is None:
            return
        done, total = plan.progress()
        self.on_progress(
            {
                "outer_step": decode_state_meta(head["meta"])["outer_step"],
                "bytes_done": done,
                "bytes_total": total,
                "parts_done": len(plan.done),
                "parts_total": len(plan.parts),
                "donors": sorted({_donor(d) for d in plan.donors if plan.usable(d)}),
                "parts_from": dict(result.parts_from),
                "resumed_parts": result.resumed,
                "banned": sorted({_donor(d) for d in plan.banned}),
            }
        )


def _slots(donors: Sequence[str]) -> list[str]:
    """The plan's donors: IN_FLIGHT slots of each, first slots first (so every donor starts at once)."""
    return [f"{donor}#{k}" for k in range(IN_FLIGHT) for donor in donors]


def _donor(slot: str) -> str:
    return slot.rsplit("#", 1)[0]


def _describe(head: dict[str, Any]) -> tuple[str, tuple[int, ...]]:
    """What two donors' heads must share to be the same state (the metadata but its time, and the layout),
    and how new that state is (its outer step, then whether it holds the round in flight)."""
    try:
        meta = decode_state_meta(head["meta"])
        newness = (int(meta.get("outer_step", -1)), int(meta.get("pending_tensors", 0)))
    except (ProtoError, TypeError, ValueError):
        return "bad metadata", (-1,)
    meta.pop("time", None)
    fields = sorted((k, repr(v)) for k, v in meta.items())
    return repr((fields, head["part_bytes"], head["total_bytes"], tuple(head["shapes"]))), newness


def _tensors(buffer: bytearray, layout: Layout) -> list[torch.Tensor]:
    """The state's tensors as fp32 views of the downloaded bytes."""
    tensors, offset = [], 0
    for shape in layout.shapes:
        count = 1
        for d in shape:
            count *= d
        if count == 0:
            tensors.append(torch.zeros(shape))
        else:
            tensors.append(
                torch.frombuffer(buffer, dtype=torch.float32, count=count, offset=offset).view(shape)
            )
        offset += 4 * count
    return tensors
