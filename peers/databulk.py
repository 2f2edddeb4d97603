"""Dataset files over plain HTTP: the bulk path beside the p2p data protocol (peers/datashare.py).

Why a second path: a file's bytes through libp2p go Python → unix socket → p2pd (noise, yamux) → TCP → p2pd
→ unix socket → Python, ~4× the CPU per byte of a plain socket copy, and on a busy machine CPU is what
bounds a download. The bytes need no secure channel: every file a node fetches is known by its sha256 (the
index pinned by the signed manifest), so a server over plain HTTP can lie no more than one over libp2p, and
a liar is still named and banned by the same check (peers/datafetch.py).

- Server: a node that serves the dataset also listens for `GET /dilocod/data/<name>` (optionally with a
  `Range: bytes=N-` or `bytes=N-M`) and answers with `sendfile` (piece by piece where the event loop has
  none, as uvloop), under the same lookup, concurrency cap and
  bandwidth cap (token bucket) as its p2p transfers.
- Advertised over p2p: the protocol BULK_PROTOCOL answers an empty request with a `dilocod.data.bulk`
  reply carrying only the port. The requester joins it to the IP of the libp2p connection it already has
  to that peer (never to a host the server names: a server cannot point joiners at a third machine).
- Client (`BulkRoutes`): the URL of a server's bulk path, or None (no port, a relayed connection, or the
  path failed lately: firewalled, NATed or cut, so the p2p path stays the fallback).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import BinaryIO, Protocol

import aiohttp
from aiohttp import web
from hivemind.p2p import P2P, PeerID

from peers import unary
from proto.data import BULK_REPLY, decode_bulk_reply, encode_bulk_reply, name_problem

log = logging.getLogger("peers.databulk")

BULK_PROTOCOL = "/dilocod/data-bulk/1.0.0"
ROUTE = "/dilocod/data/{name}"
SEND_PIECE = 4 << 20  # bytes sent at a time without a rate limit (a stop is seen between pieces)
SEND_TIMEOUT = 60.0  # seconds a requester may leave a piece unread before the server gives up on it
ASK_TIMEOUT = 5.0  # seconds for the port's p2p request and for the TCP connect
FAILED_SECONDS = 600.0  # a server whose bulk path failed is asked over p2p only, this long
READ_BUFFER = (
    4 << 20
)  # bytes the client buffers before it stops reading (larger: fewer pauses, fewer hand-offs)
_RANGE = re.compile(r"bytes=(\d{1,16})-(\d{0,16})")
_TCP_ADDR = re.compile(r"/(ip4|ip6)/([^/]+)/tcp/\d+")


# ---- the server --------------------------------------------------------------------------------------------


class Served(Protocol):
    """What the bulk server shares with the p2p one (peers/datashare.py's DataServer): the lookup, the cap
    on transfers at once, the bandwidth cap and the counters."""

    requests: int
    refused: int
    active: int
    bytes_served: int
    max_concurrent: int
    stopped: bool

    def lookup(self, name: str) -> Path | None: ...

    async def admit(self, want: int) -> int:
        """Waits for the bandwidth cap; how many of `want` bytes to send now."""
        ...


class BulkServer:
    """The HTTP side of a data server: the same files, caps and counters, sent with sendfile."""

    def __init__(self, data: Served) -> None:
        self.data = data
        self.port: int | None = None
        self.bytes_served = 0  # of the node's total (data.bytes_served), what went this way
        self._sendfile = True  # the loop's sendfile until it says it has none
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> int:
        app = web.Application()
        app.router.add_get(ROUTE, self.handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            with contextlib.suppress(Exception):
                await self._runner.cleanup()
            self._runner = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        data = self.data
        data.requests += 1
        name = request.match_info["name"]
        if name_problem(name) is not None:
            return self._refuse(400, "bad request: a path, not a file name")
        if data.stopped or data.active >= data.max_concurrent:
            return self._refuse(503, "busy")
        path = data.lookup(name)
        if path is None:
            return self._refuse(404, "not found")
        data.active += 1
        try:
            with open(path, "rb") as file:
                return await self._send(request, file)
        except OSError:
            return self._refuse(404, "not found")
        finally:
            data.active -= 1

    async def _send(self, request: web.Request, file: BinaryIO) -> web.StreamResponse:
        size = os.fstat(file.fileno()).st_size
        span = byte_range(request.headers.get("Range"), size)
        if span is None:
            return self._refuse(416, f"the range is not within the file's {size} bytes")
        offset, count = span
        response = web.StreamResponse(status=206 if "Range" in request.headers else 200)
        response.content_length = count
        response.content_type = "application/octet-stream"
        if "Range" in request.headers:
            response.headers["Content-Range"] = f"bytes {offset}-{offset + count - 1}/{size}"
        await response.prepare(request)
        end = offset + count
        while offset < end and not self.data.stopped:
            piece = await self.data.admit(min(end - offset, SEND_PIECE))
            sent = await asyncio.wait_for(
                self._send_piece(request, response, file, offset, piece), SEND_TIMEOUT
            )
            if not sent:
                break  # the file shrank under us: the requester sees a short body and moves on
            offset += sent
            self.bytes_served += sent
            self.data.bytes_served += sent
        await response.write_eof()
        return response

    async def _send_piece(
        self, request: web.Request, response: web.StreamResponse, file: BinaryIO, offset: int, count: int
    ) -> int:
        """Sends file bytes [offset, offset + count) to the requester; how many went (0: none left)."""
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the requester hung up")
        if self._sendfile:
            try:
                return await asyncio.get_running_loop().sendfile(transport, file, offset, count)
            except NotImplementedError:  # uvloop (what the daemon runs on) has no sendfile
                self._sendfile = False
        chunk = await asyncio.to_thread(os.pread, file.fileno(), count, offset)
        await response.write(chunk)
        return len(chunk)

    def _refuse(self, status: int, error: str) -> web.Response:
        self.data.refused += 1
        return web.Response(status=status, text=error)


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(offset, count) that a `Range` header asks of a `size`-byte file; the whole file without one; None when
    it asks for what the file does not hold. Only the one form a fetch sends: `bytes=N-` or `bytes=N-M`."""
    if header is None:
        return 0, size
    match = _RANGE.fullmatch(header.strip())
    if match is None:
        return None
    first = int(match[1])
    last = int(match[2]) if match[2] else size - 1
    if first > last or last >= size:
        return None
    return first, last - first + 1


async def serve_bulk_port(p2p: P2P, port: int) -> None:
    """Answer BULK_PROTOCOL requests with our bulk port."""
    reply = encode_bulk_reply({"port": port})

    async def handler(_peer: str, _request: bytes) -> bytes:
        return reply

    await unary.serve_unary(p2p, BULK_PROTOCOL, handler, max_request=64)


# ---- the client --------------------------------------------------------------------------------------------


class BulkRoutes:
    """Where each server's bulk path is, learnt over p2p once per server, and which ones failed lately."""

    def __init__(self, p2p: P2P) -> None:
        self.p2p = p2p
        self._urls: dict[PeerID, str | None] = {}
        self._failed: dict[PeerID, float] = {}

    async def url(self, peer: PeerID) -> str | None:
        """The base URL of `peer`'s bulk path (files are `<url>/<name>`), or None: ask over p2p."""
        failed = self._failed.get(peer)
        if failed is not None and time.monotonic() - failed < FAILED_SECONDS:
            return None
        if peer not in self._urls:
            self._urls[peer] = await self._discover(peer)
        return self._urls[peer]

    def failed(self, peer: PeerID) -> None:
        """The bulk path of `peer` failed: p2p only for a while (a firewall that drops the port would
        otherwise cost a connect timeout per file)."""
        self._failed[peer] = time.monotonic()
        self._urls.pop(peer, None)

    async def _discover(self, peer: PeerID) -> str | None:
        try:
            raw = await unary.ask_unary(
                self.p2p, peer, BULK_PROTOCOL, b"", timeout=ASK_TIMEOUT, max_reply=BULK_REPLY.max_bytes
            )
            port = decode_bulk_reply(raw)["port"]
            host = await self._host(peer)
        except Exception as e:  # an older node, or no answer: the p2p path
            log.debug("no bulk path to %s: %r", peer, e)
            return None
        if port is None or host is None:
            return None
        return f"http://{host}:{port}/dilocod/data"

    async def _host(self, peer: PeerID) -> str | None:
        """The IP of our direct connection to `peer` (None through a relay)."""
        for info in await self.p2p.list_peers():
            if info.peer_id != peer:
                continue
            for addr in info.addrs:
                match = _TCP_ADDR.fullmatch(str(addr))
                if match is not None:
                    return f"[{match[2]}]" if match[1] == "ip6" else match[2]
        return None


async def bulk_chunks(url: str, name: str, offset: int, length: int, timeout: float) -> AsyncGenerator[bytes]:
    """The bytes [offset, offset + length) of `name` from a bulk server, as they come. Raises on an answer
    that is not exactly those bytes' range (the caller falls back to p2p) and TimeoutError when no bytes
    came for `timeout` s; yields at most `length` bytes whatever the server sends."""
    limits = aiohttp.ClientTimeout(total=None, connect=ASK_TIMEOUT, sock_read=timeout)
    headers = {"Range": f"bytes={offset}-{offset + length - 1}"}
    async with (
        aiohttp.ClientSession(timeout=limits, auto_decompress=False, read_bufsize=READ_BUFFER) as session,
        session.get(f"{url}/{name}", headers=headers, allow_redirects=False) as response,
    ):
        if response.status != 206:
            raise ConnectionError(f"HTTP {response.status} for bytes from {offset}")
        if response.content_length != length:
            raise ConnectionError(f"it offers {response.content_length} bytes, not {length}")
        left = length
        async for chunk in response.content.iter_any():
            chunk = chunk[:left]
            left -= len(chunk)
            yield chunk
            if left == 0:
                return
        raise ConnectionError(f"the body ended {left} bytes short")
