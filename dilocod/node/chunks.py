"""The run's chunk schedule over the network: the coordinator's side (`ChunkService`) and a trainer's
(`ChunkSync`). The rules are dilocod/data/schedule.py's; the trainer's place is dilocod/data/cursor.py's.

The coordinator is the run's bootstrap, or the node that started the run without one; it keeps its book in
`<run dir>/chunks.json` so a restart forgets nothing. A trainer reports to the coordinator it was given
(its initial peers, in order) every `SYNC_SECONDS`, and at once when it moves on to its next chunk, so it
holds the next lease before it needs it. A trainer whose coordinator does not answer trains on: its leases
still hold windows, and when they run out it draws random windows (`unscheduled`), said once in its log and
in `/api/status` (`data_schedule`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from dilocod.data.cursor import ChunkCursor
from dilocod.data.schedule import MAX_LEASES, ChunkBook, Grant
from peers.node import Node
from proto import ProtoError
from proto.chunks import (
    HELD_GROUP,
    LEASE_GROUP,
    decode_chunk_reply,
    decode_chunk_request,
    encode_chunk_reply,
    encode_chunk_request,
    groups,
)

log = logging.getLogger("dilocod.chunks")

CHUNK_PROTOCOL = "/dilocod/chunks/1.0.0"
SYNC_SECONDS = 5.0
ASK_TIMEOUT = 5.0
SAVE_SECONDS = 10.0
BOOK_FILE = "chunks.json"
MAX_MESSAGE = 4096
NO_SCHEDULE = "this run keeps no chunk schedule"


class NoSchedule(Exception):
    """The run's coordinator says the run has no chunk schedule (`data.chunk_tokens = 0`)."""


async def serve_no_schedule(node: Node) -> None:
    """A coordinator of a run without a schedule says so, so that trainers stop asking (and do not warn)."""

    async def handle(peer: str, request: bytes) -> bytes:
        return encode_chunk_reply({"error": NO_SCHEDULE})

    await node.serve_unary(CHUNK_PROTOCOL, handle, max_request=MAX_MESSAGE)


PROGRESS = ("epoch", "epoch_fraction", "tokens_trained", "chunks_trained", "chunks_total")

# (held, want) → (the leases held now, the run's progress through its dataset)
Exchange = Callable[[list[tuple[int, int, int]], int], Awaitable[tuple[list[Grant], dict[str, Any]]]]


# ---- the coordinator ---------------------------------------------------------------------------------------


class ChunkService:
    """The run's chunk book, answering trainers; saved to `path` (None: kept in memory only)."""

    def __init__(self, book: ChunkBook, path: Path | None) -> None:
        self.book, self.path = book, path
        self.requests = 0
        self.refused = 0
        self._dirty = False
        if path is not None and path.exists():
            self._load(path)

    def _load(self, path: Path) -> None:
        try:
            self.book.restore(json.loads(path.read_text()), time.time())
            log.info("chunk schedule resumed from %s: %s", path, self.book.progress())
        except (OSError, ValueError, KeyError, TypeError) as e:
            # The run's record of its data is worth keeping: set it aside rather than overwrite it.
            aside = path.with_suffix(f".{int(time.time())}.json")
            with contextlib.suppress(OSError):
                path.replace(aside)
            log.warning(
                "chunk schedule %s not resumed (%s); kept it as %s and started afresh", path, e, aside
            )

    def sync(self, peer: str, held: list[tuple[int, int, int]], want: int) -> list[Grant]:
        self._dirty = True
        return self.book.sync(peer, held, want, time.time())

    async def handle(self, peer: str, request: bytes) -> bytes:
        """One trainer's request (a stranger's bytes): its leases, or a one-line error."""
        self.requests += 1
        try:
            record = decode_chunk_request(request)
            held = [(e, c, o) for e, c, o in groups(record["held"], HELD_GROUP)]
            grants = self.sync(peer, held, record["want"])
        except ProtoError as e:
            self.refused += 1
            return encode_chunk_reply({"error": f"bad request: {str(e)[:150]}"})
        flat = [v for g in grants for v in (g.epoch, g.chunk, g.lo, g.size, g.offset)]
        progress = {k: v for k, v in self.book.progress().items() if k in PROGRESS}
        return encode_chunk_reply({"leases": flat, "lease_seconds": self.book.lease_seconds, **progress})

    def save(self) -> None:
        if self.path is None or not self._dirty:
            return
        self._dirty = False
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.book.to_json()))
        tmp.replace(self.path)  # a reader, or a crash, never sees half a book

    async def keep_saved(self, stopping: asyncio.Event) -> None:
        """Expire dead leases and save the book every SAVE_SECONDS, and once more when stopping."""
        try:
            while not stopping.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), SAVE_SECONDS)
                for peer, epoch, chunk in self.book.expire(time.time()):
                    self._dirty = True
                    log.info(
                        "chunk %d of epoch %d goes back to the run: %s stopped reporting", chunk, epoch, peer
                    )
                self._save_quietly()
        finally:
            self._save_quietly()

    def _save_quietly(self) -> None:
        try:
            self.save()
        except OSError as e:
            log.warning("could not save the chunk schedule: %s", e)

    def progress(self) -> dict[str, Any]:
        return self.book.progress()


async def start_service(
    node: Node, train_tokens: int, dataset: str, chunk_tokens: int, lease_seconds: float,
    run_dir: Path | None, *, serve: bool,
) -> ChunkService:  # fmt: skip
    """The coordinator of a run whose training split holds `train_tokens`, served on `node` when `serve`."""
    book = ChunkBook(train_tokens, chunk_tokens, dataset, lease_seconds)
    service = ChunkService(book, run_dir / BOOK_FILE if run_dir is not None else None)
    if serve:
        await node.serve_unary(CHUNK_PROTOCOL, service.handle, max_request=MAX_MESSAGE)
    log.info(
        "coordinating the run's chunk schedule: %d chunks of %d tokens, epoch %d",
        book.n_chunks, chunk_tokens, book.progress()["epoch"],
    )  # fmt: skip
    return service


# ---- a trainer ---------------------------------------------------------------------------------------------


def local_exchange(service: ChunkService, peer: str) -> Exchange:
    """A trainer in the coordinator's own process asks the book directly."""

    async def exchange(held: list[tuple[int, int, int]], want: int) -> tuple[list[Grant], dict[str, Any]]:
        return service.sync(peer, held, want), service.progress()

    return exchange


def remote_exchange(node: Node, coordinators: Sequence[str]) -> Exchange:
    """Ask the first of `coordinators` (multiaddrs) that answers; the one that did is asked first next time."""
    order = list(coordinators)

    async def exchange(held: list[tuple[int, int, int]], want: int) -> tuple[list[Grant], dict[str, Any]]:
        request = encode_chunk_request({"held": [v for h in held for v in h], "want": want})
        errors = []
        for maddr in list(order):
            try:
                raw = await node.ask_unary(
                    maddr, CHUNK_PROTOCOL, request, timeout=ASK_TIMEOUT, max_reply=MAX_MESSAGE
                )
                reply = decode_chunk_reply(raw)
            except Exception as e:
                errors.append(f"{maddr[-12:]}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
                continue
            if reply.get("error") == NO_SCHEDULE:
                raise NoSchedule(NO_SCHEDULE)
            if reply.get("error"):
                errors.append(f"{maddr[-12:]}: {reply['error']}")
                continue
            order.remove(maddr)
            order.insert(0, maddr)
            progress = {k: reply[k] for k in PROGRESS if reply.get(k) is not None}
            return [Grant(*g) for g in groups(reply["leases"], LEASE_GROUP)], progress
        raise ConnectionError("; ".join(errors) or "no coordinator given")

    return exchange


class ChunkSync:
    """Keeps a trainer's cursor in step with the run's coordinator."""

    def __init__(self, cursor: ChunkCursor, exchange: Exchange) -> None:
        self.cursor, self.exchange = cursor, exchange
        self.wake = asyncio.Event()  # set (thread-safely) when the trainer moves on to its next chunk
        self.error: str | None = None
        self.syncs = 0
        self.last_sync: float | None = None
        self.progress: dict[str, Any] | None = None  # the run's, as the coordinator last told us
        self.on_synced: Callable[[], None] = lambda: None  # after each answer (new leases may need shards)
        self.off = False  # the run keeps no schedule: we sample random windows and stop asking

    async def once(self, want: int = MAX_LEASES, *, quiet: bool = False) -> bool:
        """One report and request; False (and `error` says why) when no coordinator answered."""
        try:
            grants, progress = await self.exchange(self.cursor.held(), want)
        except NoSchedule:
            if not self.off:
                log.info(
                    "the run keeps no chunk schedule: training on random windows of our part of the data"
                )
            self.off = True
            return False
        except Exception as e:
            if self.error is None and not quiet:
                log.warning(
                    "no chunk coordinator answers (%s): training on the chunks leased, then on random windows",
                    e,
                )
            self.error = str(e)[:200] or type(e).__name__
            return False
        if self.error is not None:
            log.info("the chunk coordinator answers again")
        self.error = None
        self.syncs += 1
        self.last_sync = time.time()
        self.progress = progress or self.progress
        self.cursor.adopt(grants)
        self.on_synced()
        if self.syncs == 1:  # what we train first (after a restart: the leases still ours, where they stand)
            log.info(
                "chunk leases: %s",
                ", ".join(
                    f"epoch {g.epoch} chunk {g.chunk} from token {g.offset} of {g.size}" for g in grants
                )
                or "none",
            )
        return True

    async def keep_in_step(self, stopping: asyncio.Event) -> None:
        """Sync every SYNC_SECONDS or when woken, until `stopping`; then report once more, wanting nothing
        new (our leases stay ours for a restart within the lease)."""
        try:
            while not stopping.is_set() and not self.off:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), SYNC_SECONDS)
                self.wake.clear()
                if not stopping.is_set() and not await self.once():
                    with contextlib.suppress(TimeoutError):  # no answer: ask again later, not every step
                        await asyncio.wait_for(stopping.wait(), SYNC_SECONDS)
        finally:
            if not self.off:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.once(want=0, quiet=True), ASK_TIMEOUT)

    def status(self) -> dict[str, Any]:
        return {
            "leases": [
                {"epoch": g.epoch, "chunk": g.chunk, "offset": g.offset, "size": g.size}
                for g in self.cursor.leases()
            ],
            "syncs": self.syncs,
            "last_sync": self.last_sync,
            "error": self.error,
            "off": self.off,
        }
