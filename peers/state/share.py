"""θ_global and the outer momentum in parts, over p2p: the donor's server and the joiner's client.

Wire (protocol STATE_PROTOCOL, one request per stream, proto/state.py): the requester sends a 4-byte
big-endian length and a `dilocod.state.request`; the donor answers a 4-byte length and a
`dilocod.state.head`, or a `dilocod.state.part` header followed by exactly `length` raw bytes of the part.
See docs/protocol.md, "State parts".

The donor serves the snapshot its `provider` returns (StateSync's: metadata and tensors, refreshed every
round). A joiner's download of a large state outlasts rounds, so a snapshot a joiner asked for is held,
by its id, for `hold_seconds` after its last request even when the provider has moved on: one more copy
of the state in memory only while someone downloads it. Each snapshot's part digests are hashed once, on
a worker thread, at its first head request.

The joiner's downloader (which donor fetches which part) is peers/state/download.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from peers.auth import RunAuth
from proto import ProtoError
from proto.state import (
    STATE_HEAD,
    STATE_PART,
    STATE_REQUEST,
    decode_state_head,
    decode_state_part,
    decode_state_request,
    encode_state_head,
    encode_state_part,
    encode_state_request,
    format_shape,
)

log = logging.getLogger("peers.state.share")

STATE_PROTOCOL = "/dilocod/state/1.0.0"
LEN = struct.Struct(">I")
TARGET_PARTS = 64  # enough parts to spread over many donors and retry cheaply
MIN_PART = 256 << 10  # below this a request's round trip costs more than its bytes
MAX_PART = 64 << 20
PIECE = 1 << 20  # bytes written to the stream at a time
HOLD_SECONDS = 120.0  # an old snapshot is kept this long after a joiner's last request for it
MAX_HELD = 3  # snapshots held at once (the current one and those joiners still download)
MAX_CONCURRENT = 16  # part transfers one donor runs at once; more are answered "busy"
REQUEST_TIMEOUT = 10.0  # seconds a requester has to send its request
SEND_TIMEOUT = 60.0  # seconds a requester may leave a piece unread before the donor gives up on it

StateProvider = Callable[[], tuple[bytes, Sequence[torch.Tensor]] | None]


class StateRefused(Exception):
    """A donor answered with an error (no state, not a member, busy, an unknown snapshot)."""


def part_size(total_bytes: int) -> int:
    """The part size of a state of `total_bytes`: about TARGET_PARTS parts of 64 KiB multiples, within
    [MIN_PART, MAX_PART]. A function of the size alone, so every donor of one state declares the same parts."""
    size = -(-max(total_bytes, 1) // TARGET_PARTS)
    size = -(-size // (64 << 10)) * (64 << 10)
    return min(MAX_PART, max(MIN_PART, size))


@dataclass
class Snapshot:
    """One state as a donor serves it: its tensors' bytes laid end to end, cut into parts."""

    id: str
    meta: bytes
    tensors: list[torch.Tensor]  # CPU, contiguous fp32, as sent
    offsets: list[int]  # each tensor's first byte in the flat state
    total: int
    part_bytes: int
    digests: list[str] | None = None
    used: float = field(default_factory=time.monotonic)

    @classmethod
    def of(cls, meta: bytes, tensors: Sequence[torch.Tensor]) -> Snapshot:
        flat = [t.detach().to("cpu", torch.float32).contiguous() for t in tensors]
        offsets, total = [], 0
        for t in flat:
            offsets.append(total)
            total += t.numel() * 4
        return cls(hashlib.sha256(meta).hexdigest(), meta, flat, offsets, total, part_size(total))

    def shapes(self) -> list[str]:
        return [format_shape(t.shape) for t in self.tensors]

    def parts(self) -> int:
        return -(-self.total // self.part_bytes)

    def pieces(self, index: int) -> list[memoryview]:
        """The bytes of part `index`, as views of the tensors (no copy)."""
        start = index * self.part_bytes
        end = min(start + self.part_bytes, self.total)
        views = []
        for t, offset in zip(self.tensors, self.offsets):
            size = t.numel() * 4
            lo, hi = max(start, offset), min(end, offset + size)
            if lo < hi:
                views.append(t.view(-1).view(torch.uint8).numpy().data[lo - offset : hi - offset])
        return views

    def hash_parts(self) -> list[str]:
        """Every part's sha256 (hashlib releases the GIL: run it on a worker thread)."""
        digests = []
        for index in range(self.parts()):
            h = hashlib.sha256()
            for view in self.pieces(index):
                h.update(view)
            digests.append(h.hexdigest())
        return digests


class StateServer:
    """Serves our state in parts on a p2pd; counters are totals since it started."""

    def __init__(
        self,
        provider: StateProvider,
        auth: RunAuth | None = None,
        *,
        hold_seconds: float = HOLD_SECONDS,
        max_concurrent: int = MAX_CONCURRENT,
    ) -> None:
        self.provider, self.auth = provider, auth
        self.hold_seconds, self.max_concurrent = hold_seconds, max_concurrent
        self.held: dict[str, Snapshot] = {}
        self._hashing: dict[str, asyncio.Future[list[str]]] = {}
        self.bytes_served = self.parts_served = self.requests = self.refused = self.active = 0

    async def handle(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.requests += 1
        try:
            try:
                request = await _read_message(
                    reader, STATE_REQUEST.max_bytes, REQUEST_TIMEOUT, decode_state_request
                )
            except (ProtoError, ValueError) as e:
                await self._refuse(writer, "head", f"bad request: {e}")
                return
            kind = request["kind"]
            if self.auth is not None and not self.auth.admits_member(
                info.peer_id.to_bytes(), request["proof"]
            ):
                await self._refuse(writer, kind, "not a member of this run")
                return
            if kind == "head":
                await self._head(writer)
            elif self.active >= self.max_concurrent:
                await self._refuse(writer, kind, "busy")
            else:
                self.active += 1
                try:
                    await self._part(writer, request["snapshot"], request["index"])
                finally:
                    self.active -= 1
        except Exception as e:  # a requester that lies or hangs up must never hurt the donor
            log.debug("state request from %s: %r", info.peer_id, e)
        finally:
            writer.close()

    async def _head(self, writer: asyncio.StreamWriter) -> None:
        snapshot = self._current()
        if snapshot is None:
            await self._refuse(writer, "head", "no state yet")
            return
        digests = await self._digests(snapshot)
        head = {
            "meta": snapshot.meta,
            "snapshot": snapshot.id,
            "part_bytes": snapshot.part_bytes,
            "total_bytes": snapshot.total,
            "shapes": snapshot.shapes(),
            "digests": digests,
        }
        writer.write(_frame(encode_state_head(head)))
        await asyncio.wait_for(writer.drain(), SEND_TIMEOUT)

    async def _part(self, writer: asyncio.StreamWriter, snapshot_id: str, index: int) -> None:
        snapshot = self.held.get(snapshot_id)
        if snapshot is None:
            await self._refuse(writer, "part", "unknown snapshot")
            return
        if index >= snapshot.parts():
            await self._refuse(writer, "part", f"bad request: part {index} of {snapshot.parts()}")
            return
        snapshot.used = time.monotonic()
        pieces = snapshot.pieces(index)
        writer.write(_frame(encode_state_part({"index": index, "length": sum(len(p) for p in pieces)})))
        await self._send(writer, pieces)
        snapshot.used = time.monotonic()
        self.parts_served += 1

    async def _send(self, writer: asyncio.StreamWriter, pieces: list[memoryview]) -> None:
        for view in pieces:
            for start in range(0, len(view), PIECE):
                chunk = view[start : start + PIECE]
                writer.write(bytes(chunk))
                await asyncio.wait_for(writer.drain(), SEND_TIMEOUT)
                self.bytes_served += len(chunk)

    def _current(self) -> Snapshot | None:
        """The provider's snapshot, held under its id; old ones no joiner asked for lately are dropped."""
        try:
            served = self.provider()
        except Exception as e:  # no state yet, or the provider failed: "no state", not a crash
            log.debug("no state to serve: %r", e)
            served = None
        now = time.monotonic()
        current = None
        if served is not None:
            meta, tensors = served
            key = hashlib.sha256(meta).hexdigest()
            current = self.held.get(key) or Snapshot.of(meta, tensors)
            current.used = now
            self.held[key] = current
        stale = [k for k, s in self.held.items() if s is not current and now - s.used > self.hold_seconds]
        for key in stale:
            del self.held[key]
        while len(self.held) > MAX_HELD:  # the least recently used first
            del self.held[min(self.held, key=lambda k: self.held[k].used)]
        return current

    async def _digests(self, snapshot: Snapshot) -> list[str]:
        if snapshot.digests is None:
            hashing = self._hashing.get(snapshot.id)
            if hashing is None:  # concurrent heads of one snapshot share one hashing pass
                hashing = asyncio.ensure_future(asyncio.to_thread(snapshot.hash_parts))
                self._hashing[snapshot.id] = hashing
            try:
                snapshot.digests = await asyncio.shield(hashing)
            finally:
                if hashing.done():
                    self._hashing.pop(snapshot.id, None)
        return snapshot.digests

    async def _refuse(self, writer: asyncio.StreamWriter, kind: str, error: str) -> None:
        self.refused += 1
        text = " ".join(error.split())[:200] or "refused"
        message = encode_state_head({"error": text}) if kind == "head" else encode_state_part({"error": text})
        writer.write(_frame(message))
        await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT)

    def status(self) -> dict[str, Any]:
        return {"parts_served": self.parts_served, "bytes_served": self.bytes_served, "held": len(self.held)}


async def serve_state(p2p: P2P, provider: StateProvider, auth: RunAuth | None = None) -> StateServer:
    """Answer state-part requests on this p2pd with what `provider()` returns (None: no state yet)."""
    server = StateServer(provider, auth)
    await p2p.add_binary_stream_handler(STATE_PROTOCOL, server.handle)
    return server


class P2PStateClient:
    """The joiner's side of the wire: one stream per request (peers/state/download.py drives it)."""

    def __init__(self, p2p: P2P, proof: bytes = b"", stall_seconds: float = 15.0) -> None:
        self.p2p, self.proof, self.stall_seconds = p2p, proof, stall_seconds

    async def head(self, donor: str, timeout: float) -> dict[str, Any]:
        reader, writer = await self._open(donor, {"kind": "head", "proof": self.proof}, timeout)
        try:
            head = await _read_message(reader, STATE_HEAD.max_bytes, timeout, decode_state_head)
        finally:
            writer.close()
        if head.get("error") is not None:
            raise StateRefused(head["error"])
        return head

    async def part(self, donor: str, snapshot: str, index: int, into: memoryview) -> None:
        """Read part `index` into `into` (its exact size); raises on a refusal, a short or stalled stream."""
        request = {"kind": "part", "proof": self.proof, "snapshot": snapshot, "index": index}
        reader, writer = await self._open(donor, request, self.stall_seconds)
        try:
            reply = await _read_message(reader, STATE_PART.max_bytes, self.stall_seconds, decode_state_part)
            if reply.get("error") is not None:
                raise StateRefused(reply["error"])
            if reply["index"] != index or reply["length"] != len(into):
                raise ValueError(
                    f"asked part {index} ({len(into)} bytes), got {reply['index']} ({reply['length']})"
                )
            got = 0
            while got < len(into):
                chunk = await asyncio.wait_for(reader.read(min(PIECE, len(into) - got)), self.stall_seconds)
                if not chunk:
                    raise ValueError(f"the stream broke off after {got} of {len(into)} bytes")
                into[got : got + len(chunk)] = chunk
                got += len(chunk)
        finally:
            writer.close()

    async def _open(
        self, donor: str, request: dict[str, Any], timeout: float
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        peer = PeerID.from_base58(donor)
        _, reader, writer = await asyncio.wait_for(
            self.p2p.call_binary_stream_handler(peer, STATE_PROTOCOL), timeout
        )
        writer.write(_frame(encode_state_request(request)))
        try:
            await asyncio.wait_for(writer.drain(), timeout)
        except BaseException:
            writer.close()
            raise
        return reader, writer


async def _read_message(
    reader: asyncio.StreamReader, limit: int, timeout: float, decode: Callable[[bytes], dict[str, Any]]
) -> dict[str, Any]:
    (size,) = LEN.unpack(await asyncio.wait_for(reader.readexactly(LEN.size), timeout))
    if size > limit:
        raise ValueError(f"a message of {size} bytes (at most {limit})")
    return decode(await asyncio.wait_for(reader.readexactly(size), timeout))


def _frame(message: bytes) -> bytes:
    return LEN.pack(len(message)) + message
