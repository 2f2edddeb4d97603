"""One peer's presence in a run: its hivemind DHT (and the p2pd daemon under it) and its DHT records.

Everything here is blocking hivemind calls wrapped for asyncio: the DHT lives in its own process with
its own event loop, so our loop only ever waits on futures, never on sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hivemind
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from peers import datashare, reachability, runinfo, unary
from peers.auth import Identity, RunAuth, RunRecordValidator, ensure_identity
from peers.dhtprocess import RunDHT
from peers.errors import PeersError
from peers.forking import freeze_before_fork
from peers.state import share as stateshare

log = logging.getLogger("peers.node")


@dataclass(frozen=True)
class NodeSettings:
    """How this peer joins the network. Plain values: the daemon builds it from its own config."""

    run_id: str
    initial_peers: tuple[str, ...] = ()
    host: str = "0.0.0.0"
    port: int = 0
    announce: tuple[str, ...] = ()
    identity_path: str | None = None
    client_mode: bool = False
    relay_service: bool = True  # serve as a circuit relay for peers behind NAT
    auto_relay: bool = False  # look for relays when we are not reachable ourselves
    reachability: str | None = None  # None = let AutoNAT decide; "public" | "private" forces it
    trusted_relays: tuple[str, ...] = ()  # relays to reserve a slot on (with auto_relay), peers/relay.py
    startup_timeout: float = 60.0
    # How long to keep trying when none of `initial_peers` answers: a bootstrap that is restarting, or
    # too busy to answer one ping in time, must not end a peer's start (each try pings for 3 s).
    bootstrap_wait: float = 30.0
    auth: RunAuth | None = None  # the run key (peers/auth.py); None = an open run. Its repr hides secrets.


def parse_multiaddr(text: str, *, need_peer_id: bool = True) -> Multiaddr:
    """Parse one multiaddr, raising PeersError with a one-line reason a user can act on."""
    try:
        maddr = Multiaddr(text)
    except Exception as e:  # multiaddr raises several unrelated types
        raise PeersError(f"bad multiaddr '{text}': {e}") from None
    protocols = {proto.name for proto in maddr.protocols()}
    if need_peer_id and "p2p" not in protocols:
        raise PeersError(f"bad multiaddr '{text}': it must end with /p2p/<peer id> of the peer to dial")
    if not protocols & {"ip4", "ip6", "dns", "dns4", "dns6"}:
        raise PeersError(f"bad multiaddr '{text}': it names no host (/ip4/, /ip6/ or /dns/)")
    if need_peer_id:
        try:
            PeerID.from_base58(maddr.value_for_protocol("p2p"))
        except Exception:
            raise PeersError(f"bad multiaddr '{text}': the /p2p/ part is not a valid peer id") from None
    return maddr


class _NoInitialPeer(Exception):
    """No initial peer answered the DHT's ping: worth another try (the message is the user's line)."""


def retry_pause(attempt: int) -> float:
    """Seconds before try `attempt` + 1 of a start that found no initial peer: 1, 2, 4, 5, 5, …"""
    return float(min(5, 2 ** (attempt - 1)))


def _listen_maddr(host: str, port: int) -> str:
    family = "ip6" if ":" in host else "ip4"
    return f"/{family}/{host}/tcp/{port}"


class Node:
    """A started DHT node for one run. Keys it touches are all prefixed with the run id."""

    def __init__(self, options: NodeSettings) -> None:
        for text in options.initial_peers:
            parse_multiaddr(text)
        for text in options.announce:
            parse_multiaddr(text, need_peer_id=False)
        self.options = options
        self.dht: hivemind.DHT | None = None
        self._identity_dir: str | None = None  # a throwaway identity's folder, when none was given
        self._identity_path: str | None = None
        self._client_p2p: Any = None  # our p2pd, for requests we send (replicated once, on first use)

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the DHT process and p2pd; blocking (call it from an executor). While none of the initial
        peers answers, try again with backoff for `bootstrap_wait` seconds; then the error stands."""
        deadline = time.monotonic() + self.options.bootstrap_wait
        for attempt in itertools.count(1):
            try:
                self._start_once()
                return
            except _NoInitialPeer as e:
                pause = retry_pause(attempt)
                if time.monotonic() + pause >= deadline:
                    raise PeersError(str(e)) from None
                log.warning("%s; trying again in %.0fs", e, pause)
                time.sleep(pause)

    def _start_once(self) -> None:
        opts = self.options
        identity = self._identity()
        kwargs: dict[str, Any] = dict(
            initial_peers=list(opts.initial_peers),
            host_maddrs=[_listen_maddr(opts.host, opts.port)],
            client_mode=opts.client_mode,
            use_relay=opts.relay_service,
            use_auto_relay=opts.auto_relay,
            # UPnP multicast leaves the machine and never helps on loopback or in test beds.
            nat_port_map=False,
            identity_path=self._identity_path,
            # A restarted peer must not wait to learn that its own old process is gone.
            check_if_identity_free=False,
            # Every record is signed with our identity key (and the run key); others' are checked.
            record_validators=[RunRecordValidator(identity, opts.auth)],
            start=True,
            await_ready=False,
        )
        if opts.announce:
            kwargs["announce_maddrs"] = list(opts.announce)
        if opts.reachability:
            kwargs["force_reachability"] = opts.reachability
        if opts.trusted_relays:
            kwargs["trusted_relays"] = list(opts.trusted_relays)
        freeze_before_fork()
        dht = RunDHT(**kwargs)
        self.dht = dht
        try:
            dht.wait_until_ready(timeout=opts.startup_timeout)
        except Exception as e:
            self.stop()
            reason = str(e).split("\n")[0] or type(e).__name__
            # hivemind's ping of them failed, or p2pd's own dial of them did (it exits at start)
            if "none of the initial_peers responded" in reason or "failed to connect to bootstrap" in reason:
                peers = ", ".join(opts.initial_peers)
                raise _NoInitialPeer(
                    f"could not start the DHT node: none of the initial peers answered ({peers}); "
                    "is the bootstrap running and reachable?"
                ) from None
            raise PeersError(f"could not start the DHT node: {reason}") from None
        auth = opts.auth.describe() if opts.auth is not None else "open (no run.key)"
        log.info("run authorization: %s; our DHT records are signed with our identity key", auth)

    def stop(self) -> None:
        """Shut the DHT and its p2pd down, and make sure neither outlives us."""
        dht, self.dht = self.dht, None
        if dht is not None:
            stop_child(dht, timeout=10)
        if self._identity_dir is not None:
            shutil.rmtree(self._identity_dir, ignore_errors=True)
            self._identity_dir = None

    def _identity(self) -> Identity:
        """Load (or make) the identity key p2pd will run with: our DHT records are signed with it."""
        path = self.options.identity_path
        if path is None:  # hivemind would let p2pd make a key we could not read; make one ourselves
            self._identity_dir = tempfile.mkdtemp(prefix="dilocod-identity-")
            path = os.path.join(self._identity_dir, "identity.key")
        self._identity_path = path
        identity = ensure_identity(path)
        auth = self.options.auth
        if auth is not None and auth.allowed is not None and identity.peer_id not in auth.allowed:
            peer = PeerID(identity.peer_id).to_base58()
            raise PeersError(
                f"this peer ({peer}) is not in the run's allowed-peers file (run.key): add it there"
            )
        return identity

    @property
    def auth(self) -> RunAuth | None:
        return self.options.auth

    # ---- identity ---------------------------------------------------------------------------------
    @property
    def started(self) -> hivemind.DHT:
        if self.dht is None:
            raise PeersError("the DHT node is not running")
        return self.dht

    @property
    def peer_id(self) -> str:
        return self.started.peer_id.to_base58()

    def visible_maddrs(self, latest: bool = False) -> list[str]:
        return [str(m) for m in self.started.get_visible_maddrs(latest=latest)]

    async def await_relay_reservation(self, timeout: float) -> list[str]:
        """Our /p2p-circuit addresses once p2pd holds a relay reservation ([] if none came in time)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            maddrs = await loop.run_in_executor(None, lambda: self.visible_maddrs(latest=True))
            circuits = [m for m in maddrs if "/p2p-circuit" in m]
            if circuits or loop.time() >= deadline:
                return circuits
            await asyncio.sleep(0.5)

    async def serve_dialback(self, relays: Sequence[str] = ()) -> None:
        """Answer other peers' reachability checks (peers/reachability.py) on our p2pd."""
        await reachability.serve_dialback(await self.started.replicate_p2p(), relays=relays)

    async def serve_manifest(self, provider: Callable[[], bytes | None]) -> None:
        """Serve the run's manifest (opaque signed bytes) to nodes that ask (peers/runinfo.py)."""
        await runinfo.serve_manifest(await self.started.replicate_p2p(), provider)

    async def serve_data(
        self,
        resolve: Callable[[str], Path | None],
        *,
        rate_limit: float | None = None,
        bulk_port: int | None = None,
    ) -> datashare.DataServer:
        """Serve dataset files to peers that ask (peers/datashare.py); `resolve` maps a name to our copy.
        `bulk_port`: also over HTTP on our listening host (peers/databulk.py; 0: a free port, None: not)."""
        return await datashare.serve_data(
            await self.started.replicate_p2p(),
            resolve,
            rate_limit=rate_limit,
            bulk_host=self.options.host,
            bulk_port=bulk_port,
        )

    async def serve_state(self, provider: stateshare.StateProvider) -> stateshare.StateServer:
        """Serve our state in parts to the run's members that re-sync (peers/state/share.py)."""
        return await stateshare.serve_state(await self.started.replicate_p2p(), provider, self.auth)

    async def state_client(self) -> stateshare.P2PStateClient:
        """Our side of other peers' state servers, with our run-key proof."""
        proof = self.auth.member_proof(self.started.peer_id.to_bytes()) if self.auth is not None else b""
        return stateshare.P2PStateClient(await self.client_p2p(), proof)

    async def serve_unary(self, protocol: str, handler: unary.Handler, *, max_request: int) -> None:
        """Answer small requests on `protocol` with `handler(peer_id, request)` (peers/unary.py)."""
        await unary.serve_unary(await self.started.replicate_p2p(), protocol, handler, max_request)

    async def ask_unary(
        self, maddr: str, protocol: str, request: bytes, *, timeout: float, max_reply: int
    ) -> bytes:
        """One request to the peer `maddr` names (its /p2p/ id; our DHT already knows how to reach it)."""
        peer_id = PeerID.from_base58(str(parse_multiaddr(maddr).value_for_protocol("p2p")))
        return await unary.ask_unary(
            await self.client_p2p(), peer_id, protocol, request, timeout=timeout, max_reply=max_reply
        )

    async def ask_unary_peer(
        self, peer_id: str, protocol: str, request: bytes, *, timeout: float, max_reply: int
    ) -> bytes:
        """One request to a peer known by its id alone (the DHT's routing finds its addresses)."""
        return await unary.ask_unary(
            await self.client_p2p(), PeerID.from_base58(peer_id), protocol, request, timeout=timeout,
            max_reply=max_reply,
        )  # fmt: skip

    async def client_p2p(self) -> Any:
        """Our p2pd, for streams we open (replicated once, on first use)."""
        if self._client_p2p is None:
            self._client_p2p = await self.started.replicate_p2p()
        return self._client_p2p

    # ---- records ----------------------------------------------------------------------------------
    def run_key(self, name: str) -> str:
        return f"{self.options.run_id}.{name}"

    async def publish(self, name: str, payload: bytes, ttl: float) -> bool:
        """Store this peer's record under `<run>.<name>`, subkey = our peer id, for `ttl` seconds."""
        future = self.started.store(
            self.run_key(name),
            subkey=self.peer_id,
            value=payload,
            expiration_time=get_dht_time() + ttl,
            return_future=True,
        )
        return bool(await asyncio.wrap_future(future))

    async def read_all(self, name: str) -> dict[str, Any]:
        """All live subkey → raw value pairs under `<run>.<name>`; values are unvalidated stranger data."""
        future = self.started.get(self.run_key(name), latest=True, return_future=True)
        found = await asyncio.wrap_future(future)
        if found is None or not isinstance(found.value, dict):
            return {}
        records: dict[str, Any] = {}
        for subkey, item in found.value.items():
            value = getattr(item, "value", None)
            records[str(subkey)] = value
        return records

    async def dht_records(self) -> int:
        """Records this node's DHT holds: stored for others plus cached (what a soak watches for growth;
        hivemind drops expired ones as it counts)."""
        future = self.started.run_coroutine(_count_records, return_future=True)
        return int(await asyncio.wrap_future(future))

    @property
    def joins_others(self) -> bool:
        """Whether this node was started with initial peers to join (a bootstrap that seeds the run was not)."""
        return bool(self.options.initial_peers)

    async def rejoin(self) -> int:
        """Dial the initial peers again and ping them from our DHT, then look up our own neighbours: a node
        whose every contact failed while it could not answer (its processes stopped past the DHT's
        timeouts: a laptop asleep, a machine frozen) has an empty routing table and no one left to ask, and
        nobody asks it either. Returns how many nodes the routing table holds afterwards."""
        if not self.options.initial_peers:
            return 0
        future = self.started.run_coroutine(
            functools.partial(_rejoin, tuple(self.options.initial_peers)), return_future=True
        )
        return int(await asyncio.wrap_future(future))


# Run inside the DHT process by `run_coroutine`, which pickles the function: module level, not closures.
async def _count_records(_dht: Any, node: Any) -> int:
    return len(node.protocol.storage) + len(node.protocol.cache)


REJOIN_SECONDS = 10.0  # how long a rejoin may take in the DHT process (a dial, a ping, a lookup)


async def _rejoin(initial_peers: tuple[str, ...], _dht: Any, node: Any) -> int:
    async def one(text: str) -> None:
        maddr = Multiaddr(text)
        peer = PeerID.from_base58(maddr["p2p"])
        with contextlib.suppress(Exception):  # known to p2pd already, or unreachable: the ping says which
            await node.p2p._client.connect(peer, [maddr.decapsulate(Multiaddr(f"/p2p/{maddr['p2p']}"))])
        await node.protocol.call_ping(peer)

    with contextlib.suppress(asyncio.TimeoutError):
        async with asyncio.timeout(REJOIN_SECONDS):
            await asyncio.gather(*(one(text) for text in initial_peers), return_exceptions=True)
            await node.find_nearest_nodes([node.node_id])
    return len(node.protocol.routing_table.uid_to_peer_id)


# How long a child that its own shutdown already gave its grace period, then SIGTERM, may take to go. A forked
# child inherits the daemon's SIGTERM handler, which does nothing there: with its p2pd gone (`systemctl stop`
# signals the whole group) the DHT sat out its grace and then 10 s more before the SIGKILL.
AFTER_TERMINATE_SECONDS = 1.0


def stop_child(process: Any, timeout: float) -> None:
    """Ask a hivemind child process (DHT, averager) to shut down (its `shutdown` waits out its own grace
    period, then sends SIGTERM); kill it if it has not gone in time. `timeout`: how long to wait when its
    shutdown could not even be asked for."""
    try:
        process.shutdown()
        wait = AFTER_TERMINATE_SECONDS
    except Exception:
        wait = timeout
    process.join(timeout=wait)
    if process.is_alive() and process.pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)


def first_public_maddrs(maddrs: Sequence[str]) -> list[str]:
    """Addresses worth printing to a user: drop the in-process ones p2pd reports for relays/loopback."""
    return [m for m in maddrs if "/p2p-circuit" not in m]
