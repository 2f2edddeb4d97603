"""The run's signed manifest over p2p: every full node serves the one it runs with; a starting node asks
the peers it was given for it.

The manifest is opaque bytes here (dilocod/manifest/ builds, signs and checks it): this module only
carries it. It holds no secret (a run key is never in it), so any node may ask. A reply is a 4-byte
big-endian length and that many bytes (0: the node has none yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.utils.multiaddr import Multiaddr

from peers.errors import PeersError

log = logging.getLogger("peers.runinfo")

MANIFEST_PROTOCOL = "/dilocod/manifest/1.0.0"
MAX_MANIFEST_BYTES = 64 * 1024  # the proto schema's bound is lower; this only bounds what we read


@dataclass(frozen=True)
class Fetched:
    """A manifest as one peer served it (unchecked stranger bytes)."""

    served_by: str  # base58 peer id of the peer that answered
    blob: bytes


async def serve_manifest(p2p: P2P, provider: Callable[[], bytes | None]) -> None:
    """Answer manifest requests on this p2pd with what `provider` returns now."""

    async def handle(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            blob = provider() or b""
            writer.write(struct.pack(">I", len(blob)) + blob)
            await writer.drain()
        except Exception as e:  # a requester that hangs up early must never hurt the server
            log.debug("manifest request from %s: %r", info.peer_id, e)
        finally:
            writer.close()

    await p2p.add_binary_stream_handler(MANIFEST_PROTOCOL, handle)


async def dial(p2p: P2P, peer: Multiaddr, timeout: float) -> PeerID:
    """Connect our p2pd to `peer` (a multiaddr ending in /p2p/<id>); its peer id. ConnectionError if not."""
    peer_id = PeerID.from_base58(str(peer.value_for_protocol("p2p")))
    # Dialled here rather than as p2pd's bootstrap peers: p2pd refuses to start when none of those answers,
    # and one client should outlive a bootstrap that is still starting. (`_client`: hivemind's P2P exposes
    # no connect of its own; its daemon bindings do.)
    try:
        await asyncio.wait_for(
            p2p._client.connect(peer_id, [peer.decapsulate(Multiaddr(f"/p2p/{peer_id}"))]), timeout
        )
    except Exception as e:
        raise ConnectionError(f"cannot connect: {_one_line(e)}") from None
    return peer_id


async def ask_manifest(p2p: P2P, peer: Multiaddr, timeout: float) -> Fetched:
    """One request to `peer` (dialled at that address); raises when it does not answer or has no manifest."""
    peer_id = await dial(p2p, peer, timeout)
    _, reader, writer = await asyncio.wait_for(
        p2p.call_binary_stream_handler(peer_id, MANIFEST_PROTOCOL), timeout
    )
    try:
        (size,) = struct.unpack(">I", await asyncio.wait_for(reader.readexactly(4), timeout))
        if size > MAX_MANIFEST_BYTES:
            raise ValueError(f"a manifest of {size} bytes (at most {MAX_MANIFEST_BYTES})")
        if size == 0:
            raise ValueError("it has no manifest yet")
        blob = await asyncio.wait_for(reader.readexactly(size), timeout)
    finally:
        writer.close()
    return Fetched(peer_id.to_base58(), blob)


async def fetch_manifests(
    initial_peers: Sequence[str],
    *,
    deadline: float,
    accept: Callable[[Fetched], bool],
    host: str = "127.0.0.1",
    attempt_timeout: float = 5.0,
) -> Fetched:
    """The first manifest from `initial_peers` that `accept` takes, asking each in turn and retrying with
    backoff until `deadline` seconds have passed. Raises PeersError naming what each peer answered, at once
    when every peer answered with a manifest `accept` refused (asking again would not change it)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline
    errors: dict[str, str] = {}
    delay = 0.5
    p2p: P2P | None = None
    try:
        while True:
            if p2p is None:
                p2p = await _client_or_none(host, errors)
            if p2p is not None:
                refused = 0
                for text in initial_peers:
                    try:
                        fetched = await ask_manifest(p2p, Multiaddr(text), attempt_timeout)
                    except Exception as e:
                        errors[text] = _one_line(e)
                        continue
                    if accept(fetched):
                        return fetched
                    errors[text] = "its manifest was refused (see above)"
                    refused += 1
                if refused == len(initial_peers):
                    break
            if loop.time() + delay >= end:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
    finally:
        if p2p is not None:
            with contextlib.suppress(Exception):
                await p2p.shutdown()
    detail = "; ".join(f"{peer}: {error}" for peer, error in errors.items()) or "no answer"
    raise PeersError(f"no run manifest we can take from the peers given ({detail})")


async def start_client(host: str) -> P2P:
    """A short-lived p2pd that only dials out (a manifest or dataset download before the node starts)."""
    family = "ip6" if ":" in host else "ip4"
    return await P2P.create(
        host_maddrs=[f"/{family}/{host}/tcp/0"],
        nat_port_map=False,
        auto_nat=False,
        use_relay=False,
        startup_timeout=15.0,
    )


async def _client_or_none(host: str, errors: dict[str, str]) -> P2P | None:
    try:
        return await start_client(host)
    except Exception as e:
        errors["p2p"] = f"could not start: {_one_line(e)}"
        return None


def _one_line(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return text or type(error).__name__
