"""Joining the network: decide whether we are reachable, then start the DHT node and the averager.

Reachability is `net.reachability`, or with `auto` a dial-back through an initial peer. A public peer
is a full node; a private one is a client that averages through public reducers, or a full node
reachable through the bootstrap's relays when it offers relays that carry tensors
(`dilocod bootstrap --relay`). The peer's persistent identity (and the data-sharding key derived from
it) lives in the run dir.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from dilocod.adversary import Adversary
from dilocod.bans import BanList
from dilocod.config import Config
from dilocod.diloco import OuterOptimizer
from dilocod.groupoptions import averaging_options
from dilocod.peerstate import PeerState
from dilocod.runtime import install_stop_signals
from peers.group import GroupAverager
from peers.node import Node, NodeOptions, first_public_maddrs
from peers.reachability import Reachability, detect_reachability, free_tcp_port

if TYPE_CHECKING:
    import torch

    from dilocod.daemon import PeerArgs

log = logging.getLogger("dilocod.netstart")
RELAY_RESERVATION_SECONDS = 20.0  # how long a private peer waits for a slot on the bootstrap's relay


class NetworkStart:
    """Mixed into `PeerDaemon`: sets its `node` and `group`, and the network fields of its state."""

    args: PeerArgs
    cfg: Config
    state: PeerState
    stopping: asyncio.Event
    outer: OuterOptimizer | None
    node: Node | None
    group: GroupAverager | None
    bans: BanList
    adversary: Adversary

    if TYPE_CHECKING:  # defined by PeerDaemon

        def _current_state(self) -> tuple[bytes, list[torch.Tensor]]: ...

    def _peer_key(self) -> str:
        """A stable per-identity key for data sharding, known before the DHT starts."""
        identity = self.args.run_dir / "identity.key"
        if not identity.exists():
            self.args.run_dir.mkdir(parents=True, exist_ok=True)
            from hivemind.p2p import P2P

            P2P.generate_identity(str(identity))
        import hashlib

        return hashlib.sha256(identity.read_bytes()).hexdigest()[:32]

    async def _start_network(self) -> None:
        assert self.outer is not None
        loop = asyncio.get_running_loop()
        net = self.cfg.net
        port, reach = await self._detect_reachability()
        # A private peer offered relays that carry tensors (`dilocod bootstrap --relay`) becomes a full
        # node reachable through them: NAT↔NAT averaging without a public reducer in between.
        via_relay = not reach.public and bool(reach.relays)
        node_options = NodeOptions(
            run_id=self.cfg.run.id,
            initial_peers=self.args.initial_peers,
            host=net.host,
            port=port,
            announce=net.announce,
            identity_path=str(self.args.run_dir / "identity.key"),
            client_mode=not (reach.public or via_relay),
            reachability=reach.name,
            auto_relay=via_relay,
            trusted_relays=reach.relays if via_relay else (),
            auth=self.cfg.run.auth(),  # signs our records; refuses peers without the run key
        )
        self.node = Node(node_options)
        await loop.run_in_executor(None, self.node.start)
        if via_relay and not await self.node.await_relay_reservation(RELAY_RESERVATION_SECONDS):
            # A full node nobody can reach would stall every group it joins: be a client instead.
            log.warning(
                "no relay reservation after %.0fs: running as a client (through public reducers) instead",
                RELAY_RESERVATION_SECONDS,
            )
            await loop.run_in_executor(None, self.node.stop)
            via_relay = False
            client = replace(node_options, client_mode=True, auto_relay=False, trusted_relays=())
            self.node = Node(client)
            await loop.run_in_executor(None, self.node.start)
        options = averaging_options(
            self.cfg,
            "node" if reach.public or via_relay else "client",
            corrupt_reductions=self.adversary.corrupt_reductions,
        )
        self.group = GroupAverager(self.node, self.outer.params, options, self._current_state)
        # hivemind forks the averager from the calling thread and sets SIGINT to "ignore" there: it must be
        # the main thread, and our own handlers go back on afterwards.
        self.group.start()
        install_stop_signals(self.stopping)
        self.group.set_banned(self.bans.peer_ids())
        self.state.peer_id = self.node.peer_id
        self.state.maddrs = self.node.visible_maddrs(latest=True)
        self.state.reachability = reach.name
        # A private peer's pseudo-gradients reach the others through a relay or a public reducer.
        self.state.relayed = not reach.public
        if reach.public:  # public peers dial back others too (the bootstrap is not the only prober)
            await self.node.serve_dialback()
        log.info(
            "reachability: %s (%s); relayed: %s; addresses: %s",
            reach.name, reach.reason, "yes" if self.state.relayed else "no",
            ", ".join(self.state.maddrs if via_relay else first_public_maddrs(self.state.maddrs))
            or "(client mode: none)",
        )  # fmt: skip
        if via_relay:
            log.info("private peer in full mode through %d relay(s) of the bootstrap", len(reach.relays))

    async def _detect_reachability(self) -> tuple[int, Reachability]:
        """Public or private (net.reachability, or a dial-back through an initial peer), and the port."""
        net = self.cfg.net
        if net.reachability != "auto":
            return net.port, Reachability(net.reachability == "public", "set by net.reachability")
        # The probe's p2pd and the DHT after it must listen on the same port, so pick it now.
        port = net.port or free_tcp_port(net.host)
        reach = await detect_reachability(self.args.initial_peers, net.host, port, net.announce)
        if not reach.public and not reach.observed_ip:  # nobody answered: say so loudly
            log.warning(
                "reachability check failed, running as a private peer (client mode): %s", reach.reason
            )
        return port, reach
