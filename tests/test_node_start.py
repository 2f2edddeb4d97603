"""A peer's DHT start outlasts a bootstrap that is not answering yet (restarting, or too busy for one
ping): `peers.node.Node.start` tries again with backoff for `bootstrap_wait` seconds."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hivemind.p2p import P2P, PeerID

from dilocod.node.demo import free_port
from peers.auth import Identity
from peers.errors import PeersError
from peers.node import Node, NodeSettings, retry_pause

pytestmark = pytest.mark.integration  # real processes, servers or namespaces: not in `make test-fast`


def test_retry_pauses_back_off_to_five_seconds() -> None:
    assert [retry_pause(a) for a in range(1, 7)] == [1.0, 2.0, 4.0, 5.0, 5.0, 5.0]


def _future_bootstrap(tmp_path: Path) -> tuple[str, str, int]:
    """An identity file, its peer's maddr and port, before anything listens there."""
    key = tmp_path / "boot.key"
    P2P.generate_identity(str(key))
    peer_id = PeerID(Identity.load(key).peer_id).to_base58()
    port = free_port()
    return str(key), f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id}", port


def test_a_start_waits_for_a_bootstrap_that_comes_up_late(tmp_path: Path) -> None:
    key, maddr, port = _future_bootstrap(tmp_path)
    joiner = Node(NodeSettings(run_id="late", initial_peers=(maddr,), host="127.0.0.1", bootstrap_wait=40))
    errors: list[BaseException] = []

    def join() -> None:
        try:
            joiner.start()
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=join)
    thread.start()
    time.sleep(5)  # the joiner's first ping has failed by now
    boot = Node(NodeSettings(run_id="late", host="127.0.0.1", port=port, identity_path=key))
    try:
        boot.start()
        thread.join(timeout=60)
        assert not thread.is_alive() and errors == [], errors
        assert joiner.dht is not None
        # They form one DHT: a record the joiner publishes is held (stored or cached) by the two of them,
        # which `dht_records` (in /api/status) counts.
        before = asyncio.run(boot.dht_records()) + asyncio.run(joiner.dht_records())
        assert asyncio.run(joiner.publish("status", b"hello", ttl=60))
        assert asyncio.run(boot.dht_records()) + asyncio.run(joiner.dht_records()) > before
    finally:
        joiner.stop()
        boot.stop()


def test_nobody_there_still_ends_in_one_line_after_the_wait(tmp_path: Path) -> None:
    _, maddr, _ = _future_bootstrap(tmp_path)
    node = Node(NodeSettings(run_id="none", initial_peers=(maddr,), host="127.0.0.1", bootstrap_wait=2))
    started = time.monotonic()
    with pytest.raises(PeersError) as info:
        node.start()
    assert "none of the initial peers answered" in str(info.value) and "\n" not in str(info.value)
    assert time.monotonic() - started < 30
    assert node.dht is None


# Run in a DHT process by `run_coroutine` (pickled by reference: module level).
async def _forget_everyone(_dht: object, node: Any) -> int:
    """What a node's routing table looks like after every contact failed while its processes were stopped."""
    table = node.protocol.routing_table
    for uid in list(table.uid_to_peer_id):
        del table[uid]
    return len(table.uid_to_peer_id)


def test_a_node_that_lost_every_contact_rejoins_through_its_initial_peers(tmp_path: Path) -> None:
    """A peer frozen past the DHT's timeouts (a laptop asleep) comes back with no contact, and nobody has it
    either: `Node.rejoin` (called by the status heartbeat when the DHT shows no other node) dials the initial
    peers again, and records are found over the network once more."""
    key, maddr, port = _future_bootstrap(tmp_path)
    boot = Node(NodeSettings(run_id="rejoin", host="127.0.0.1", port=port, identity_path=key))
    joiner = Node(NodeSettings(run_id="rejoin", initial_peers=(maddr,), host="127.0.0.1"))
    try:
        boot.start()
        joiner.start()
        assert not boot.joins_others and joiner.joins_others
        assert [node.started.run_coroutine(_forget_everyone) for node in (boot, joiner)] == [0, 0]
        assert asyncio.run(boot.publish("later", b"news", ttl=60))  # held by the bootstrap alone
        assert asyncio.run(joiner.read_all("later")) == {}  # the joiner has nobody to ask
        assert asyncio.run(joiner.rejoin()) >= 1
        found = asyncio.run(joiner.read_all("later"))
        assert found == {boot.peer_id: b"news"}, found
    finally:
        joiner.stop()
        boot.stop()
