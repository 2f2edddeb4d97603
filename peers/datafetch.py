"""Fetching a prepared dataset's files over p2p (the server side and the wire are in peers/datashare.py):
from whichever peers hold a file, resuming cut downloads, checking every file's hash, naming who lied.

Who lied? A file is checked once, whole, against its sha256. Every run of bytes this call received is
recorded with the server that sent it. On a mismatch:
- all the bytes came from one server in this call → that server is bad;
- several servers (or bytes of an earlier, cut call) made the file → nobody can be blamed yet: the file
  is set aside as `<dest>.suspect`, and from then on every attempt downloads the whole file from one
  server (a server that fails midway loses its bytes), so a later mismatch names its one sender. Once a
  good file arrived, each server's run in the suspect file is compared with the good bytes at the same
  place: whoever sent different bytes is bad too.
A bad server is not asked again in this call; nor is one that failed (error, refusal, timeout, stall),
except a stream that ended short: a cut (a relay or a link that dropped, a daemon that reset the stream) is
the network's more often than the server's, and the only server of a file would otherwise fail the
whole fetch. Such a server is asked again from the bytes held, after the others, `CUT_RETRIES` times.

Given `routes` (peers/databulk.py), each server is asked over its HTTP path first, when it has one: the
same bytes, cheaper per byte. When that path fails (refused, cut, firewalled), the download goes on over
p2p from the bytes held, and that server's HTTP path is left alone for a while. Bytes that came over HTTP
count as their server's, like any others: a mismatch bans it the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from hivemind.p2p import P2P, PeerID

from peers.databulk import BulkRoutes, bulk_chunks
from peers.datashare import DATA_PROTOCOL, LEN, DataFetchError, frame
from proto.data import (
    DATA_REPLY,
    decode_data_reply,
    encode_data_request,
    name_problem,
)

log = logging.getLogger("peers.datafetch")


FETCH_TIMEOUT = 30.0
CUT_RETRIES = 2  # times a server whose stream ended short is asked again in one call
READ_SIZE = 1 << 20

# ---- the client --------------------------------------------------------------------------------------------


@dataclass
class FetchResult:
    """How a file came: `served_by` delivered its last bytes (None: `dest` was already complete), `sources`
    every server whose bytes are in it, `bad` servers that sent bytes that do not match, `failed` the others
    that could not deliver (with the reason)."""

    path: Path
    served_by: PeerID | None
    received: int  # bytes that came over the network in this call
    sources: list[PeerID] = field(default_factory=list)
    bad: list[PeerID] = field(default_factory=list)
    failed: dict[PeerID, str] = field(default_factory=dict)


class _Failed(Exception):
    """A server could not deliver (its fault or the network's, not a lie)."""


class _Cut(_Failed):
    """The stream ended before the bytes its header announced: asked again later (`CUT_RETRIES`)."""


class _Lied(Exception):
    """A server broke the protocol in a way only a liar does."""


@dataclass
class _Run:
    start: int
    end: int
    peer: PeerID | None  # None: bytes of an earlier call (a .part we found)


class _Part:
    """`<dest>.part`: the bytes held so far, their running sha256, and who sent which.

    Writing and hashing run on one worker thread, in order, while the event loop receives the next bytes
    (hashlib and file writes release the GIL): a 200 MB file is 0.5 s of sha256 on a slow core that must
    neither block the node's loop nor hold back the transfer. At most PENDING chunks wait for it."""

    PENDING = 8

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size
        self.runs: list[_Run] = []
        self.hasher = hashlib.sha256()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="datashare")
        self._pending: deque[asyncio.Future[None]] = deque()
        held = path.stat().st_size if path.exists() else 0
        self.file: BinaryIO = open(path, "ab")  # noqa: SIM115 (closed by aclose())
        if held > size:  # not the file we want: start over
            self.file.truncate(0)
            held = 0
        if held:
            self._hash_existing()
            self.runs.append(_Run(0, held, None))
        self.held = held

    def _hash_existing(self) -> None:
        with open(self.path, "rb") as f:
            while chunk := f.read(READ_SIZE):
                self.hasher.update(chunk)

    async def append(self, chunk: bytes, peer: PeerID) -> None:
        last = self.runs[-1] if self.runs else None
        if last is not None and last.peer == peer and last.end == self.held:
            last.end += len(chunk)
        else:
            self.runs.append(_Run(self.held, self.held + len(chunk), peer))
        self.held += len(chunk)
        loop = asyncio.get_running_loop()
        self._pending.append(loop.run_in_executor(self._worker, self._write, chunk))
        while len(self._pending) > self.PENDING:
            await self._pending.popleft()

    def _write(self, chunk: bytes) -> None:
        try:
            self.file.write(chunk)
        except OSError as e:
            raise DataFetchError(f"cannot write {self.path}: {e}") from None
        self.hasher.update(chunk)

    async def settle(self) -> None:
        """Waits until every byte received is written and hashed (raises the first write error)."""
        while self._pending:
            await self._pending.popleft()

    async def matches(self, sha256: str) -> bool:
        await self.settle()
        return self.held == self.size and self.hasher.hexdigest() == sha256

    async def discard(self) -> None:
        await self.settle()
        self.file.truncate(0)
        self.runs, self.hasher, self.held = [], hashlib.sha256(), 0

    async def set_aside(self, suspect: Path) -> list[_Run]:
        """Moves the bytes to `suspect` for a later comparison, and starts empty; returns their runs."""
        await self.settle()
        self.file.close()
        os.replace(self.path, suspect)
        runs = self.runs
        self.file = open(self.path, "ab")  # noqa: SIM115
        self.runs, self.hasher, self.held = [], hashlib.sha256(), 0
        return runs

    async def finish(self, dest: Path) -> None:
        await self.settle()
        self.file.close()
        os.replace(self.path, dest)  # atomic: dest is either absent/old or the whole checked file

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self.settle()
        self._worker.shutdown(wait=True)
        self.file.close()


async def fetch_file(
    p2p: P2P,
    servers: Sequence[PeerID],
    name: str,
    size: int,
    sha256: str,
    dest: Path,
    *,
    progress: Callable[[int], None] | None = None,
    timeout: float = FETCH_TIMEOUT,
    routes: BulkRoutes | None = None,
) -> FetchResult:
    """Downloads `name` into `dest` from the first of `servers` (in order) that can deliver it, resuming
    `<dest>.part` and moving on to the next server (keeping the bytes) when one fails, stalls `timeout` s
    or refuses. `progress(bytes held)` is called as bytes arrive. The servers must be dialable by this p2pd.
    `routes`: try each server's HTTP path first (None: p2p only).
    Raises DataFetchError (one line) when none delivers a file of this sha256, ValueError for a bad name."""
    if (problem := name_problem(name)) is not None:
        raise ValueError(f"dataset file name {name!r}: {problem}")
    dest = Path(dest)
    if await asyncio.to_thread(file_matches, dest, size, sha256):
        return FetchResult(dest, None, 0)
    part = await asyncio.to_thread(_Part, dest.with_name(dest.name + ".part"), size)
    try:
        return await _Fetch(p2p, name, sha256, dest, part, progress, timeout, routes).run(servers)
    finally:
        await part.aclose()


async def remote_size(p2p: P2P, server: PeerID, name: str, *, timeout: float = FETCH_TIMEOUT) -> int:
    """The size `server` gives for its file `name` (a request for no bytes): for a file whose sha256 is known
    but not its size (a dataset's index, its tokenizer). A wrong answer only fails that file's hash check.
    DataFetchError (one line) if it does not answer with one."""
    if (problem := name_problem(name)) is not None:
        raise ValueError(f"dataset file name {name!r}: {problem}")
    try:
        _, reader, writer = await asyncio.wait_for(
            p2p.call_binary_stream_handler(server, DATA_PROTOCOL), timeout
        )
        try:
            writer.write(frame(encode_data_request({"name": name, "offset": 0, "length": 0})))
            await asyncio.wait_for(writer.drain(), timeout)
            (count,) = LEN.unpack(await asyncio.wait_for(reader.readexactly(LEN.size), timeout))
            if count > DATA_REPLY.max_bytes:
                raise ValueError(f"a reply header of {count} bytes")
            reply = decode_data_reply(await asyncio.wait_for(reader.readexactly(count), timeout))
        finally:
            writer.close()
    except Exception as e:
        raise DataFetchError(f"{server} gives no size for {name}: {str(e) or type(e).__name__}") from None
    if reply["error"] is not None:
        raise DataFetchError(f"{server} gives no size for {name}: it answered {reply['error']!r}")
    return int(reply["size"])


@dataclass
class _Fetch:
    p2p: P2P
    name: str
    sha256: str
    dest: Path
    part: _Part
    progress: Callable[[int], None] | None
    timeout: float
    routes: BulkRoutes | None
    received: int = 0
    bad: list[PeerID] = field(default_factory=list)
    failed: dict[PeerID, str] = field(default_factory=dict)
    whole_files: bool = False  # set after a mismatch nobody could be blamed for
    cuts: dict[PeerID, int] = field(default_factory=dict)  # streams of each server that ended short
    suspect: list[_Run] | None = None

    @property
    def suspect_path(self) -> Path:
        return self.dest.with_name(self.dest.name + ".suspect")

    async def run(self, servers: Sequence[PeerID]) -> FetchResult:
        queue = deque(dict.fromkeys(servers))
        last: PeerID | None = None
        try:
            while True:
                complete = self.part.held == self.part.size
                if complete and (done := await self._check(last, queue)) is not None:
                    return done
                if not queue:
                    break
                peer = queue.popleft()
                if peer in self.bad:  # asked again after a cut, then blamed for a mismatch
                    continue
                last = peer
                if await self._try(peer):
                    queue.append(peer)
        finally:
            if self.suspect is not None:
                self.suspect_path.unlink(missing_ok=True)
        raise DataFetchError(self._summary())

    async def _try(self, peer: PeerID) -> bool:
        """One download from `peer`; True when it is worth asking again (its stream was cut)."""
        try:
            if not await self._bulk(peer):
                await self._download(peer)
        except DataFetchError:
            raise
        except _Lied as e:  # caught in its header, before it sent a byte
            self._mark_bad(peer, str(e))
        except Exception as e:
            self.failed[peer] = _one_line(e)
            log.info("data: %s from %s failed: %s", self.name, peer, self.failed[peer])
            if self.whole_files:
                await self.part.discard()  # every file must come from one server now
            return isinstance(e, _Cut) and self._count_cut(peer)
        else:
            self.failed.pop(peer, None)  # asked again after a cut, it delivered
        return False

    def _count_cut(self, peer: PeerID) -> bool:
        self.cuts[peer] = self.cuts.get(peer, 0) + 1
        return self.cuts[peer] <= CUT_RETRIES

    async def _check(self, last: PeerID | None, queue: deque[PeerID]) -> FetchResult | None:
        """The part is complete: install it when it matches, else blame or set it aside."""
        if await self.part.matches(self.sha256):
            sources = list(dict.fromkeys(r.peer for r in self.part.runs if r.peer is not None))
            if self.suspect is not None:
                self.part.file.flush()  # the worker is idle (settled): the good bytes must be on disk to compare
                await asyncio.to_thread(self._compare_suspect)
            await self.part.finish(self.dest)
            return FetchResult(self.dest, last, self.received, sources, self.bad, self.failed)
        senders = {r.peer for r in self.part.runs}
        if len(senders) == 1 and None not in senders:
            (liar,) = senders
            assert liar is not None
            self._mark_bad(liar, "its bytes do not match the file's sha256")
            await self.part.discard()
            return None
        if senders == {None}:  # all of it from an earlier call: nobody to blame, nothing to compare
            await self.part.discard()
            return None
        # Several senders (or bytes of an earlier call): set the file aside, fetch whole files from now on,
        # and let each sender that did not fail try again alone.
        log.warning(
            "data: %s from %d sources does not match its sha256; refetching whole", self.name, len(senders)
        )
        self.suspect = await self.part.set_aside(self.suspect_path)
        self.whole_files = True
        for peer in senders:
            if peer is not None and peer not in self.failed and peer not in self.bad and peer not in queue:
                queue.append(peer)
        return None

    def _compare_suspect(self) -> None:
        assert self.suspect is not None
        for run in self.suspect:
            if run.peer is None or run.peer in self.bad:
                continue
            if not _same_bytes(self.suspect_path, self.part.path, run.start, run.end):
                self._mark_bad(run.peer, "its bytes do not match the good file's")

    def _mark_bad(self, peer: PeerID, why: str) -> None:
        log.warning("data: %s from %s: %s", self.name, peer, why)
        if peer not in self.bad:
            self.bad.append(peer)
        self.failed.pop(peer, None)

    async def _bulk(self, peer: PeerID) -> bool:
        """Tries `peer`'s HTTP path; True when every byte asked came that way. Its failure is not the
        server's fault as far as we know (a firewall, a cut): p2p goes on from the bytes held."""
        if self.routes is None or (url := await self.routes.url(peer)) is None:
            return False
        offset, size = self.part.held, self.part.size
        try:
            await self._take(bulk_chunks(url, self.name, offset, size - offset, self.timeout), peer)
        except DataFetchError:
            raise
        except Exception as e:
            self.routes.failed(peer)
            log.info("data: %s from %s over HTTP failed (%s): over p2p", self.name, peer, _one_line(e))
            return False
        return True

    async def _download(self, peer: PeerID) -> None:
        offset, size = self.part.held, self.part.size
        _, reader, writer = await asyncio.wait_for(
            self.p2p.call_binary_stream_handler(peer, DATA_PROTOCOL), self.timeout
        )
        try:
            request = {"name": self.name, "offset": offset, "length": size - offset}
            writer.write(frame(encode_data_request(request)))
            await asyncio.wait_for(writer.drain(), self.timeout)
            length = await self._read_header(reader, offset)
            await self._take(self._receive(reader, length), peer)
        finally:
            writer.close()

    async def _read_header(self, reader: asyncio.StreamReader, offset: int) -> int:
        header = await asyncio.wait_for(reader.readexactly(LEN.size), self.timeout)
        (count,) = LEN.unpack(header)
        if count > DATA_REPLY.max_bytes:
            raise _Failed(f"a reply header of {count} bytes")
        reply = decode_data_reply(await asyncio.wait_for(reader.readexactly(count), self.timeout))
        if reply["error"] is not None:
            raise _Failed(f"it answered {reply['error']!r}")
        size = self.part.size
        if reply["size"] != size:
            raise _Failed(f"its {self.name} has {reply['size']} bytes, not {size}")
        if reply["length"] > size - offset:
            raise _Lied(f"it offers {reply['length']} bytes from {offset} of a {size}-byte file")
        if reply["length"] < size - offset:
            raise _Failed(f"it offers {reply['length']} of the {size - offset} bytes asked")
        return int(reply["length"])

    async def _take(self, chunks: AsyncGenerator[bytes], peer: PeerID) -> None:
        """Appends what `chunks` yields to the part, as `peer`'s bytes (closing it however this ends)."""
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                await self.part.append(chunk, peer)
                self.received += len(chunk)
                if self.progress is not None:
                    self.progress(self.part.held)

    async def _receive(self, reader: asyncio.StreamReader, length: int) -> AsyncGenerator[bytes]:
        # One deadline rescheduled per read (not a wait_for, which makes a task per read): it covers the
        # wait for the server's next bytes only, never our own disk (the deadline is off while we yield).
        loop = asyncio.get_running_loop()
        left = length
        try:
            async with asyncio.timeout(None) as deadline:
                while left > 0:
                    deadline.reschedule(loop.time() + self.timeout)
                    chunk = await reader.read(min(left, READ_SIZE))
                    deadline.reschedule(None)
                    if not chunk:
                        raise _Cut(f"the stream ended {left} bytes short")
                    left -= len(chunk)
                    yield chunk
        except TimeoutError:
            raise _Failed(f"stalled: no bytes for {self.timeout:g} s") from None

    def _summary(self) -> str:
        parts = [f"{peer}: {why}" for peer, why in self.failed.items()]
        parts += [f"{peer}: sent bytes that do not match" for peer in self.bad]
        detail = "; ".join(parts) or "no servers given"
        return f"cannot fetch dataset file {self.name} from any peer ({detail})"


def file_matches(path: Path, size: int, sha256: str) -> bool:
    """Whether `path` exists with this size and sha256 (read in pieces, never whole)."""
    try:
        if path.stat().st_size != size:
            return False
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(READ_SIZE):
                digest.update(chunk)
    except OSError:
        return False
    return digest.hexdigest() == sha256


def _same_bytes(a: Path, b: Path, start: int, end: int) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        fa.seek(start)
        fb.seek(start)
        left = end - start
        while left > 0:
            n = min(left, READ_SIZE)
            if fa.read(n) != fb.read(n):
                return False
            left -= n
    return True


def _one_line(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "timed out"
    text = str(error).splitlines()[0] if str(error) else ""
    return (text or type(error).__name__)[:200]
