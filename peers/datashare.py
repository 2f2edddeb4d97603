"""The run's prepared dataset files over p2p: a node that holds them serves them; a joining node that lacks
them fetches each file from whichever peers hold it, resuming cut downloads and checking every file's hash.

This module knows nothing of datasets: the server is given a `resolve(name)` that says which local file a
name stands for (None: not served), and the client is given each file's name, size and sha256 (from the
dataset's index, which the caller trusts). Names are file names, never paths: one with "/" or ".." is
refused on both sides before anything looks it up (proto/data.py).

Wire (protocol DATA_PROTOCOL, one request per stream): the requester sends a 4-byte big-endian length and
a `dilocod.data.request`; the server answers a 4-byte length and a `dilocod.data.reply` header, then
exactly `length` raw bytes of the file from the offset asked, and closes. See docs/protocol.md.

The client side is peers/datafetch.py. With `bulk_port` set, the node also serves the same files over plain
HTTP (peers/databulk.py), under the same caps and counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from peers.databulk import BulkServer, serve_bulk_port
from peers.errors import PeersError
from proto import ProtoError
from proto.data import (
    DATA_REQUEST,
    decode_data_request,
    encode_data_reply,
)

log = logging.getLogger("peers.datashare")

DATA_PROTOCOL = "/dilocod/data/1.0.0"
PIECE_SIZE = 1 << 20  # bytes read from disk and written to the stream at a time
MIN_PIECE = 16 << 10  # a slow rate limit sends smaller pieces, so a requester sees bytes every ~1/8 s
MAX_CONCURRENT = 16  # transfers one server runs at once; more are answered "busy"
REQUEST_TIMEOUT = 10.0  # seconds a requester has to send its request
SEND_TIMEOUT = 60.0  # seconds a requester may leave a piece unread before the server gives up on it
LEN = struct.Struct(">I")  # the length before each message


class DataFetchError(PeersError):
    """No server could deliver a dataset file whose hash matches (or it cannot be written here)."""


# ---- the server --------------------------------------------------------------------------------------------


class TokenBucket:
    """Bytes per second shared by every transfer of one server. A taker may overdraw (a piece larger than
    the burst still goes) and then waits its debt off, so concurrent takers queue up fairly."""

    def __init__(self, rate: float, burst: float | None = None) -> None:
        if rate <= 0:
            raise ValueError(f"rate limit must be > 0 bytes/s, got {rate}")
        self.rate = rate
        self.burst = burst if burst is not None else rate / 8
        self._tokens = 0.0  # no initial burst: a limit holds from the first byte
        self._stamp = time.monotonic()

    async def take(self, amount: int) -> None:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        self._tokens -= amount
        if self._tokens < 0:
            await asyncio.sleep(-self._tokens / self.rate)


@dataclass
class DataServer:
    """Serves dataset files on a p2pd. Counters are totals since it started; `stop()` unregisters it."""

    p2p: P2P
    resolve: Callable[[str], Path | None]
    piece_size: int = PIECE_SIZE
    max_concurrent: int = MAX_CONCURRENT
    bytes_served: int = 0
    requests: int = 0
    refused: int = 0  # requests answered with an error (bad, not found, busy)
    active: int = 0
    stopped: bool = False
    bulk: BulkServer | None = None  # the HTTP path (peers/databulk.py), when this node runs one
    _bucket: TokenBucket | None = None

    @property
    def rate_limit(self) -> float | None:
        return self._bucket.rate if self._bucket is not None else None

    def set_rate_limit(self, rate: float | None) -> None:
        """Bytes/s this node serves in total (None: unlimited); transfers in flight follow it at once."""
        self._bucket = TokenBucket(rate) if rate is not None else None

    async def stop(self) -> None:
        """No new requests; transfers in flight end at their next piece."""
        self.stopped = True
        with contextlib.suppress(Exception):
            await self.p2p.remove_binary_stream_handler(DATA_PROTOCOL)
        if self.bulk is not None:
            await self.bulk.stop()

    async def admit(self, want: int) -> int:
        """How many of `want` bytes a transfer sends now, after waiting for the bandwidth cap (shared by every
        transfer of this node, p2p and HTTP)."""
        bucket = self._bucket
        if bucket is None:
            return want
        piece = min(want, max(MIN_PIECE, min(self.piece_size, int(bucket.rate / 8))))
        await bucket.take(piece)
        return piece

    async def handle(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.requests += 1
        try:
            if self.stopped or self.active >= self.max_concurrent:
                await self._refuse(writer, "busy")
                return
            self.active += 1
            try:
                await self._serve(reader, writer)
            finally:
                self.active -= 1
        except Exception as e:  # a requester that lies or hangs up must never hurt the server
            log.debug("data request from %s: %r", info.peer_id, e)
        finally:
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await _read_request(reader)
        except (ProtoError, ValueError) as e:
            await self._refuse(writer, f"bad request: {e}")
            return
        name, offset, length = request["name"], request["offset"], request["length"]
        path = self.lookup(name)
        if path is None:
            await self._refuse(writer, "not found")
            return
        try:
            file = open(path, "rb")  # noqa: SIM115 (closed below, after the stream)
        except OSError:
            await self._refuse(writer, "not found")
            return
        with file:
            size = os.fstat(file.fileno()).st_size
            if offset > size:
                await self._refuse(writer, f"offset {offset} is beyond the file's {size} bytes")
                return
            count = size - offset if length is None else min(length, size - offset)
            writer.write(frame(encode_data_reply({"size": size, "length": count})))
            await self._stream(file, offset, count, writer)

    def lookup(self, name: str) -> Path | None:
        try:
            return self.resolve(name)
        except Exception as e:  # the caller's lookup failing is "not served", not a crash
            log.warning("data: looking up %r failed: %r", name, e)
            return None

    async def _stream(self, file: BinaryIO, offset: int, count: int, writer: asyncio.StreamWriter) -> None:
        # Read piece by piece, off the event loop (a cold disk must not stall the node's other work).
        file.seek(offset)
        left = count
        while left > 0 and not self.stopped:
            piece = await self.admit(min(self.piece_size, left))
            chunk = await asyncio.to_thread(file.read, piece)
            if not chunk:
                return  # the file shrank under us: the requester sees a short stream and moves on
            writer.write(chunk)
            await asyncio.wait_for(writer.drain(), SEND_TIMEOUT)
            left -= len(chunk)
            self.bytes_served += len(chunk)

    async def _refuse(self, writer: asyncio.StreamWriter, error: str) -> None:
        self.refused += 1
        text = " ".join(error.split())[:200] or "refused"
        writer.write(frame(encode_data_reply({"error": text})))
        await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT)


async def serve_data(
    p2p: P2P,
    resolve: Callable[[str], Path | None],
    *,
    rate_limit: float | None = None,
    piece_size: int = PIECE_SIZE,
    max_concurrent: int = MAX_CONCURRENT,
    bulk_host: str = "0.0.0.0",
    bulk_port: int | None = None,
) -> DataServer:
    """Answer dataset-file requests on this p2pd: `resolve(name)` gives the local file for a name (None:
    not served; it only ever sees names without "/" or ".."). `rate_limit`: bytes/s in total, None = no cap.
    `bulk_port`: also serve them over HTTP on `bulk_host`:`bulk_port` (0: a free port; None: no HTTP path),
    advertised on this p2pd. A port that cannot be bound leaves the p2p path alone, with a warning."""
    server = DataServer(p2p, resolve, piece_size=piece_size, max_concurrent=max_concurrent)
    server.set_rate_limit(rate_limit)
    await p2p.add_binary_stream_handler(DATA_PROTOCOL, server.handle)
    if bulk_port is not None:
        bulk = BulkServer(server)
        try:
            port = await bulk.start(bulk_host, bulk_port)
        except OSError as e:
            log.warning("not serving dataset files over HTTP on %s:%d: %s", bulk_host, bulk_port, e)
            await bulk.stop()
        else:
            server.bulk = bulk
            await serve_bulk_port(p2p, port)
    return server


async def _read_request(reader: asyncio.StreamReader) -> dict[str, Any]:
    (size,) = LEN.unpack(await asyncio.wait_for(reader.readexactly(LEN.size), REQUEST_TIMEOUT))
    if size > DATA_REQUEST.max_bytes:
        raise ValueError(f"a request of {size} bytes (at most {DATA_REQUEST.max_bytes})")
    body = await asyncio.wait_for(reader.readexactly(size), REQUEST_TIMEOUT)
    return decode_data_request(body)


def frame(message: bytes) -> bytes:
    return LEN.pack(len(message)) + message
