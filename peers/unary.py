"""One small request, one small reply, over a libp2p stream: the framing the chunk schedule uses.

Both messages are a 4-byte big-endian length and that many bytes; what they mean is the caller's (the
handler gets the requester's peer id, which libp2p authenticates, and the request's bytes). A request or
reply longer than the caller's bound is refused before it is read, and a handler's failure closes the
stream: a stranger's bad message never reaches further than its own stream.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Awaitable, Callable

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

log = logging.getLogger("peers.unary")

LEN = struct.Struct(">I")
READ_TIMEOUT = 10.0  # seconds a requester has to send its request

Handler = Callable[[str, bytes], Awaitable[bytes]]


async def _read_message(reader: asyncio.StreamReader, limit: int, timeout: float) -> bytes:
    (size,) = LEN.unpack(await asyncio.wait_for(reader.readexactly(LEN.size), timeout))
    if size > limit:
        raise ValueError(f"a message of {size} bytes (at most {limit})")
    return await asyncio.wait_for(reader.readexactly(size), timeout)


async def serve_unary(p2p: P2P, protocol: str, handler: Handler, max_request: int) -> None:
    """Answer each request on `protocol` with what `handler(peer_id, request)` returns."""

    async def handle(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await _read_message(reader, max_request, READ_TIMEOUT)
            reply = await handler(info.peer_id.to_base58(), request)
            writer.write(LEN.pack(len(reply)) + reply)
            await writer.drain()
        except Exception as e:  # a requester's bad or cut message must never hurt the server
            log.debug("%s request from %s: %r", protocol, info.peer_id, e)
        finally:
            writer.close()

    await p2p.add_binary_stream_handler(protocol, handle)


async def ask_unary(
    p2p: P2P, peer_id: PeerID, protocol: str, request: bytes, *, timeout: float, max_reply: int
) -> bytes:
    """Send `request` to `peer_id` on `protocol`; its reply. Raises on no answer, a timeout or a reply
    over `max_reply` bytes."""
    _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(peer_id, protocol), timeout)
    try:
        writer.write(LEN.pack(len(request)) + request)
        await asyncio.wait_for(writer.drain(), timeout)
        return await _read_message(reader, max_reply, timeout)
    finally:
        writer.close()
