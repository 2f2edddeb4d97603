"""Is this peer publicly reachable? A dial-back through the bootstrap decides, before the DHT starts.

libp2p's AutoNAT cannot answer this for us: p2pd never classifies private addresses (LANs, test beds,
loopback) as reachable, and a peer must know its role before its DHT starts (client mode is fixed at
start). So dilocod asks a peer it already trusts to exist, the bootstrap:

1. the peer starts a short-lived p2pd on its real listen port (fresh identity, no DHT) and opens a
   stream of `DIALBACK_PROTOCOL` to one of its initial peers, sending the TCP ports it listens on;
2. the bootstrap takes the IP address the stream *came from* (the remote address of the connection,
   which behind a NAT is the router's public address) and tries a fresh TCP connection to each port
   of that IP, with a short timeout; it answers which ports accepted;
3. any port reached → public (full DHT node, reduces in the all-reduce); none → private (client mode).

The bootstrap cannot be used to port-scan anyone: it only ever dials the requester's own observed
IP, at most `MAX_PORTS` ports per request, and each IP gets a few requests a minute
(`DialBackLimiter`). Requests that arrive over a relay (no observed IP) are answered "unknown".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.utils.multiaddr import Multiaddr

log = logging.getLogger("peers.reachability")

DIALBACK_PROTOCOL = "/dilocod/dialback/1.0.0"
MAX_PORTS = 4  # ports checked per request (listen port + a few announced ones)
MAX_MESSAGE = 1024  # bytes: a request or reply is a tiny JSON object
DIAL_TIMEOUT = 2.0  # seconds per TCP connect of the dial-back
# Dial-back requests one IP may make in a window. Each costs at most MAX_PORTS connects to the requester's
# own address, so this bounds our work, not anyone's exposure. It must still admit every peer of a swarm
# sharing one address (one machine, or a lab behind one router with port forwards): at 6 a minute, 10 of 16
# loopback peers starting together were told "rate limited" and ran as private peers for good (client
# mode: they could neither lead a group nor reduce), which split the groups of the 16-peer bench.
PER_IP_REQUESTS = 64
PER_IP_WINDOW = 60.0  # seconds
MAX_CONCURRENT = 4  # dial-backs in flight on one server
MAX_RELAYS = 8  # relay multiaddrs offered in one reply


@dataclass(frozen=True)
class Reachability:
    """The outcome of the decision: the role, and why (one line for the log)."""

    public: bool
    reason: str
    observed_ip: str | None = None  # our address as the prober saw it (the NAT's, behind one)
    reached: tuple[int, ...] = ()  # ports the prober could connect to
    prober: str | None = None  # peer id of the peer that dialled us back
    relays: tuple[str, ...] = ()  # circuit relays the prober offers (peers/relay.py), for NAT↔NAT paths

    @property
    def name(self) -> str:
        return "public" if self.public else "private"


# ---- the service (bootstrap, public peers) --------------------------------------------------------------


@dataclass
class DialBackLimiter:
    """Bounds the work one requester can cause: a sliding window per IP plus a global concurrency cap."""

    per_ip: int = PER_IP_REQUESTS
    window: float = PER_IP_WINDOW
    concurrent: int = MAX_CONCURRENT
    _seen: dict[str, deque[float]] = field(default_factory=dict)
    _slots: asyncio.Semaphore | None = None

    def allow(self, ip: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if len(self._seen) > 10_000:  # forget idle IPs so the table cannot grow without bound
            self._seen = {k: v for k, v in self._seen.items() if v and now - v[-1] < self.window}
        times = self._seen.setdefault(ip, deque())
        while times and now - times[0] >= self.window:
            times.popleft()
        if len(times) >= self.per_ip:
            return False
        times.append(now)
        return True

    @property
    def slots(self) -> asyncio.Semaphore:
        if self._slots is None:  # created lazily: it must belong to the loop that serves
            self._slots = asyncio.Semaphore(self.concurrent)
        return self._slots


def observed_ip(addr: Multiaddr | None) -> str | None:
    """The IP a connection came from, or None when it came through a relay (or has no IP)."""
    if addr is None:
        return None
    protocols = [p.name for p in addr.protocols()]
    if "p2p-circuit" in protocols:
        return None
    for name in ("ip4", "ip6"):
        if name in protocols:
            return str(addr.value_for_protocol(name))
    return None


async def can_connect(ip: str, port: int, timeout: float = DIAL_TIMEOUT) -> bool:
    """A fresh TCP connection (new source port, so no NAT mapping of an existing one lets it in)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), timeout)
    except (TimeoutError, OSError):
        return False
    writer.close()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(writer.wait_closed(), 1.0)
    return True


async def _read_message(reader: asyncio.StreamReader, timeout: float) -> dict[str, object]:
    header = await asyncio.wait_for(reader.readexactly(4), timeout)
    (size,) = struct.unpack(">I", header)
    if size > MAX_MESSAGE:
        raise ValueError(f"message of {size} bytes (max {MAX_MESSAGE})")
    body = await asyncio.wait_for(reader.readexactly(size), timeout)
    message = json.loads(body)
    if not isinstance(message, dict):
        raise ValueError("message is not an object")
    return message


def _write_message(writer: asyncio.StreamWriter, message: dict[str, object]) -> None:
    body = json.dumps(message).encode()
    writer.write(struct.pack(">I", len(body)) + body)


def _ports(value: object) -> list[int]:
    if not isinstance(value, list):
        raise ValueError("'ports' must be a list")
    ports = []
    for item in value[:MAX_PORTS]:
        if not isinstance(item, int) or isinstance(item, bool) or not 1 <= item <= 65535:
            raise ValueError(f"bad port {item!r}")
        if item not in ports:
            ports.append(item)
    return ports


async def serve_dialback(
    p2p: P2P, limiter: DialBackLimiter | None = None, relays: Sequence[str] = ()
) -> None:
    """Answer dial-back requests on this p2pd (the bootstrap's, or a public peer's).

    `relays`: multiaddrs of circuit relays that carry pseudo-gradients (peers/relay.py), offered to
    every requester so that a private one can become reachable through them.
    """
    limiter = limiter or DialBackLimiter()
    offered = list(relays)[:MAX_RELAYS]

    async def handle(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            ip = observed_ip(info.addr)
            request = await _read_message(reader, timeout=5.0)
            ports = _ports(request.get("ports"))
            reply: dict[str, object] = {"observed": ip, "reached": [], "relays": offered}
            if ip is None:
                reply["error"] = "no observed address (relayed connection)"
            elif not limiter.allow(ip):
                reply["error"] = "rate limited"
            else:
                async with limiter.slots:
                    ok = await asyncio.gather(*(can_connect(ip, port) for port in ports))
                reply["reached"] = [port for port, good in zip(ports, ok) if good]
            log.debug("dial-back for %s at %s ports %s: %s", info.peer_id, ip, ports, reply)
            _write_message(writer, reply)
            await writer.drain()
        except Exception as e:  # a stranger's malformed request must never hurt the server
            log.debug("dial-back request from %s refused: %r", info.peer_id, e)
        finally:
            writer.close()

    await p2p.add_binary_stream_handler(DIALBACK_PROTOCOL, handle)


# ---- the client (a starting peer) -----------------------------------------------------------------------


def free_tcp_port(host: str) -> int:
    """A port free right now on `host`, so that the probe and the DHT after it listen on the same one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_ports(host: str, count: int) -> list[int]:
    """`count` distinct free ports (each socket held open until all are picked, so none repeats)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(family, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in socks:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in socks]


def candidate_ports(port: int, announce: Sequence[str]) -> list[int]:
    """The listen port first, then the ports of announced addresses (a port forward may differ)."""
    ports = [port]
    for text in announce:
        with contextlib.suppress(Exception):
            value = int(Multiaddr(text).value_for_protocol("tcp"))
            if value not in ports:
                ports.append(value)
    return ports[:MAX_PORTS]


async def ask_dialback(p2p: P2P, peer: Multiaddr, ports: Sequence[int], timeout: float) -> Reachability:
    """One dial-back request to `peer` over `p2p`; raises when the peer does not answer."""
    peer_id = PeerID.from_base58(str(peer.value_for_protocol("p2p")))
    _, reader, writer = await asyncio.wait_for(
        p2p.call_binary_stream_handler(peer_id, DIALBACK_PROTOCOL), timeout
    )
    try:
        _write_message(writer, {"ports": list(ports)})
        await writer.drain()
        reply = await _read_message(reader, timeout=timeout)
    finally:
        writer.close()
    if reply.get("error"):
        raise RuntimeError(str(reply["error"]))
    observed = reply.get("observed")
    reached = tuple(p for p in _ports(reply.get("reached", [])) if p in ports)
    relays = _relays(reply.get("relays", []))
    where = f"{observed}:{'/'.join(map(str, ports))}"
    reason = (
        f"{peer_id.to_base58()[-8:]} dialled us back at {where}"
        if reached
        else f"{peer_id.to_base58()[-8:]} could not dial us back at {where} (NAT or firewall)"
    )
    return Reachability(
        public=bool(reached),
        reason=reason,
        observed_ip=str(observed) if observed else None,
        reached=reached,
        prober=peer_id.to_base58(),
        relays=relays,
    )


# A prober that took our stream but gave no verdict (its handler failed or timed out under load, or it
# rate-limited us) says nothing about our reachability: ask it again once before calling ourselves
# private, which lasts as long as the process. Seen with 16 peers starting together on one machine.
ANSWERED_RETRIES = 1
RETRY_PAUSE = 1.0  # seconds


def _answered(error: Exception) -> bool:
    """Whether a failed dial-back got as far as the prober's stream (worth one more try)."""
    return isinstance(error, asyncio.IncompleteReadError | RuntimeError)


def _relays(value: object) -> tuple[str, ...]:
    """The relay multiaddrs of a reply: stranger data, so only well-formed /p2p/ addresses pass."""
    if not isinstance(value, list):
        return ()
    found = []
    for item in value[:MAX_RELAYS]:
        with contextlib.suppress(Exception):
            if isinstance(item, str) and len(item) <= 256:
                PeerID.from_base58(str(Multiaddr(item).value_for_protocol("p2p")))
                found.append(item)
    return tuple(found)


async def detect_reachability(
    initial_peers: Sequence[str],
    host: str,
    port: int,
    announce: Sequence[str] = (),
    timeout: float = 15.0,
) -> Reachability:
    """Decide public/private by a dial-back through the first initial peer that answers.

    `port` must be the real listen port (not 0): the probe's p2pd listens on it, then exits, and the
    DHT listens on it after us. Never raises: no answer from anyone means private, with the reason.
    """
    if not initial_peers:
        return Reachability(public=True, reason="no initial peers to dial us back: assuming public")
    family = "ip6" if ":" in host else "ip4"
    p2p: P2P | None = None
    errors: list[str] = []
    try:
        p2p = await P2P.create(
            initial_peers=list(initial_peers),
            host_maddrs=[f"/{family}/{host}/tcp/{port}"],
            nat_port_map=False,  # UPnP would open the very port we are testing
            auto_nat=False,
            use_relay=False,  # a relayed stream carries no observed address
            startup_timeout=timeout,
        )
        for text in initial_peers:
            for attempt in range(1 + ANSWERED_RETRIES):
                try:
                    return await ask_dialback(p2p, Multiaddr(text), candidate_ports(port, announce), timeout)
                except Exception as e:
                    if attempt < ANSWERED_RETRIES and _answered(e):
                        await asyncio.sleep(RETRY_PAUSE)
                        continue
                    errors.append(f"{text}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
                    break
    except Exception as e:
        errors.append(f"probe did not start: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    finally:
        if p2p is not None:
            with contextlib.suppress(Exception):
                await p2p.shutdown()
    return Reachability(
        public=False, reason=f"no initial peer could dial us back ({'; '.join(errors)}): assuming private"
    )
