"""Joining the network: decide whether we are reachable, then start the DHT node and the averager.

Reachability is `net.reachability`, or with `auto` a dial-back through an initial peer. A public peer
is a full node; a private one is a client that averages through public reducers, or a full node
reachable through the bootstrap's relays when it offers relays that carry tensors
(`dilocod bootstrap --relay`). The peer's persistent identity (and the data-sharding key derived from
it) lives in the run dir.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dilocod.config import Config
from dilocod.node.groupsettings import averaging_settings
from dilocod.node.runtime import install_stop_signals
from dilocod.trust.hooks import HONEST, Tampering
from peers.auth import ensure_identity
from peers.group import GroupAverager
from peers.linkbudget import LinkRule
from peers.node import Node, NodeSettings, first_public_maddrs
from peers.reachability import Reachability, detect_reachability, free_tcp_port

log = logging.getLogger("dilocod.netstart")
RELAY_RESERVATION_SECONDS = 20.0  # how long a private peer waits for a slot on the bootstrap's relay


@dataclass(frozen=True)
class Network:
    """What joining the network gave: the DHT node, the averager, and how others reach us."""

    node: Node
    group: GroupAverager
    reachability: str  # public | private
    relayed: bool  # our pseudo-gradients travel through a relay or a public reducer
    client: bool  # averaging in client mode (we reduce nothing and serve no state)


def peer_key(run_dir: Path) -> str:
    """A stable per-identity key for data sharding, known before the DHT starts (creates the identity)."""
    identity = run_dir / "identity.key"
    if not identity.exists():
        ensure_identity(identity)
    return hashlib.sha256(identity.read_bytes()).hexdigest()[:32]


async def start_network(
    cfg: Config,
    run_dir: Path,
    initial_peers: Sequence[str],
    template: Sequence[torch.Tensor],
    state_provider: Callable[[], tuple[bytes, list[torch.Tensor]]],
    stopping: asyncio.Event,
    *,
    run_tag: str | None = None,
    link: LinkRule | None = None,
    tampering: Tampering = HONEST,
) -> Network:
    loop = asyncio.get_running_loop()
    net = cfg.net
    port, reach = await _detect_reachability(cfg, initial_peers)
    # A private peer offered relays that carry tensors (`dilocod bootstrap --relay`) becomes a full
    # node reachable through them: NAT↔NAT averaging without a public reducer in between.
    via_relay = not reach.public and bool(reach.relays)
    node_settings = NodeSettings(
        run_id=cfg.run.id,
        initial_peers=tuple(initial_peers),
        host=net.host,
        port=port,
        announce=net.announce,
        identity_path=str(run_dir / "identity.key"),
        client_mode=not (reach.public or via_relay),
        reachability=reach.name,
        auto_relay=via_relay,
        trusted_relays=reach.relays if via_relay else (),
        auth=cfg.run.auth(),  # signs our records; refuses peers without the run key
    )
    node = Node(node_settings)
    await loop.run_in_executor(None, node.start)
    if via_relay and not await node.await_relay_reservation(RELAY_RESERVATION_SECONDS):
        # A full node nobody can reach would stall every group it joins: be a client instead.
        log.warning(
            "no relay reservation after %.0fs: running as a client (through public reducers) instead",
            RELAY_RESERVATION_SECONDS,
        )
        await loop.run_in_executor(None, node.stop)
        via_relay = False
        node = Node(replace(node_settings, client_mode=True, auto_relay=False, trusted_relays=()))
        await loop.run_in_executor(None, node.start)
    client = not (reach.public or via_relay)
    options = averaging_settings(
        cfg,
        "client" if client else "node",
        run_tag=run_tag,
        link=link,
        reply_part=tampering.reply_part(),
        check_reducers=tampering.checks_reducers,
    )
    group = GroupAverager(node, template, options, state_provider)
    # hivemind forks the averager from the calling thread and sets SIGINT to "ignore" there: it must be
    # the main thread, and our own handlers go back on afterwards.
    group.start()
    install_stop_signals(stopping)
    if reach.public:  # public peers dial back others too (the bootstrap is not the only prober)
        await node.serve_dialback()
    maddrs = node.visible_maddrs(latest=True)
    log.info(
        "reachability: %s (%s); relayed: %s; addresses: %s",
        reach.name, reach.reason, "yes" if not reach.public else "no",
        ", ".join(maddrs if via_relay else first_public_maddrs(maddrs)) or "(client mode: none)",
    )  # fmt: skip
    if via_relay:
        log.info("private peer in full mode through %d relay(s) of the bootstrap", len(reach.relays))
    # A private peer's pseudo-gradients reach the others through a relay or a public reducer.
    return Network(node, group, reach.name, relayed=not reach.public, client=client)


async def _detect_reachability(cfg: Config, initial_peers: Sequence[str]) -> tuple[int, Reachability]:
    """Public or private (net.reachability, or a dial-back through an initial peer), and the port."""
    net = cfg.net
    if net.reachability != "auto":
        return net.port, Reachability(net.reachability == "public", "set by net.reachability")
    # The probe's p2pd and the DHT after it must listen on the same port, so pick it now.
    port = net.port or free_tcp_port(net.host)
    reach = await detect_reachability(tuple(initial_peers), net.host, port, net.announce)
    if not reach.public and not reach.observed_ip:  # nobody answered: say so loudly
        log.warning("reachability check failed, running as a private peer (client mode): %s", reach.reason)
    return port, reach
