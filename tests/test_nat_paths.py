"""NAT↔NAT: two peers behind different NATs average with each other, no public reducer in between.

The bootstrap runs with `--no-reduce`, so it never joins a round: the only way the two NATed peers can
average is to reach each other. With `--relay` the bootstrap runs a py-libp2p circuit relay
(peers/relay.py) and offers it in its dial-back replies; each peer finds itself private, reserves a slot
on the relay, and runs as a full node reachable at its /p2p-circuit address. Needs root (netns) and
py-libp2p in the relay's site directory (`make relay`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from peers.relay import relay_available
from tests.harness import wait_for
from tests.netbed import NetBed, _tool
from tests.wanrun import NetSwarm, round_hashes

pytestmark = pytest.mark.integration


def rounds_together(statuses: list[dict[str, Any]]) -> dict[int, str]:
    """outer step → θ_global hash for the steps both peers averaged in one group of 2 with equal results."""
    per_step: dict[int, list[str]] = {}
    for status in statuses:
        for entry in status["rounds"]:
            if entry["result"] == "ok" and entry["group_size"] == len(statuses):
                per_step.setdefault(entry["outer_step"], []).append(entry["global_sha256"])
    return {s: h[0] for s, h in per_step.items() if len(h) == len(statuses) and len(set(h)) == 1}


def relay_bytes_received(bed: NetBed, ports: set[int]) -> int:
    """Bytes received by the live TCP connections on the relay's ports in `pub` (from `ss -ti`)."""
    out = bed.call("pub", ["ss", "-tinH", "state", "established"], timeout=10).stdout
    total, local_port = 0, None
    for line in out.splitlines():
        fields = line.split()
        if not line.startswith((" ", "\t")) and len(fields) >= 4:
            local_port = int(fields[2].rsplit(":", 1)[1])
            continue
        match = re.search(r"bytes_received:(\d+)", line)
        if match and local_port in ports:
            total += int(match.group(1))
    return total


def test_two_nated_peers_average_through_the_bootstraps_relay_without_a_reducer(
    netbed: NetBed, wan: Callable[..., NetSwarm]
) -> None:
    missing = relay_available()
    assert missing is None, missing  # `make venv` installs it; a skip here would hide a broken install
    for host in ("natA", "natB"):
        netbed.add_nat(host)
    s = wan()
    s.start_bootstrap("dilocod", "--no-reduce", "--relay")
    peers = [s.add_peer(where="natA"), s.add_peer(where="natB")]

    def three_rounds() -> list[dict[str, Any]] | None:
        for proc in [*peers, s.bootstrap]:
            assert proc is not None and proc.alive, (
                f"{proc and proc.name} exited:\n{proc and proc.output()[-3000:]}"
            )
        statuses = [proc.status() for proc in peers]
        for step, found in round_hashes(statuses).items():
            assert len(found) == 1, f"the peers disagree on θ_global after outer step {step}: {found}"
        return statuses if len(rounds_together(statuses)) >= 3 else None

    statuses = wait_for(
        "3 rounds averaged by the two NATed peers together", three_rounds, 300, s.poll_interval
    )
    for status in statuses:
        assert status["reachability"] == "private" and status["relayed"] is True, status
        assert any("/p2p-circuit" in m for m in status["maddrs"]), status["maddrs"]
    assert s.bootstrap is not None
    # The tensors really went through the relay (not over a hole-punched direct connection): the
    # relay's sockets in `pub` received at least what the two peers sent each other.
    relay_ports = {int(m.split("/tcp/")[1].split("/")[0]) for m in s.bootstrap.status()["relays"]}
    relayed = relay_bytes_received(netbed, relay_ports)
    sent = sum(status["bytes_sent"] for status in statuses)
    print(f"relay received {relayed} bytes; peers sent {sent} payload bytes")
    assert sent > 0 and relayed >= sent, (relayed, sent)
    boot_log = s.bootstrap.output()
    assert "relaying for peers behind NAT" in boot_log and "auxiliary" not in boot_log, boot_log[-2000:]
    for proc in peers:
        assert "full mode through 4 relay(s)" in proc.output(), proc.output()[-2000:]
    assert netbed.guard_violations() == 0


def test_a_peer_that_gets_no_relay_slot_falls_back_to_client_mode(
    netbed: NetBed, wan: Callable[..., NetSwarm]
) -> None:
    """Relays offered but unreachable (firewalled): the peer must not stay a full node nobody can dial."""
    assert relay_available() is None
    netbed.add_nat("natA")
    s = wan()
    s.start_bootstrap("dilocod", "--no-reduce", "--relay")
    assert s.bootstrap is not None
    relays = wait_for("the relay's addresses", lambda: s.bootstrap and s.bootstrap.status()["relays"], 60)
    for port in {int(m.split("/tcp/")[1].split("/")[0]) for m in relays}:
        netbed.call(
            "pub",
            [_tool("iptables"), "-w", "5", "-I", "INPUT", "-p", "tcp", "--dport", str(port), "-j", "DROP"],
        )
    peer = s.add_peer(where="natA")
    status = s.wait_serving(peer, timeout=180)
    assert status["reachability"] == "private" and status["relayed"] is True, status
    assert not any("/p2p-circuit" in m for m in status["maddrs"]), status["maddrs"]
    assert "no relay reservation after 20s: running as a client" in peer.output(), peer.output()[-2000:]
    assert netbed.guard_violations() == 0
