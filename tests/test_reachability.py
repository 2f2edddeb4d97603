"""Reachability detection (peers/reachability.py): the bootstrap dials a starting peer back.

- pure checks of the service's guards (rate limit, request validation, relayed requesters);
- real p2pd on loopback: a listening port is reached, a closed one is not, a dead bootstrap means
  "private" with the reason;
- real daemons (`dilocod bootstrap`, `dilocod join` with the default `net.reachability = auto`): on
  loopback a peer is public; in network namespaces a peer behind a NAT router (which drops unsolicited
  inbound connections) is private and runs in client mode, while a peer on a public address is public.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from hivemind.p2p import P2P
from hivemind.utils.multiaddr import Multiaddr

from peers.reachability import (
    MAX_PORTS,
    DialBackLimiter,
    _ports,
    _relays,
    ask_dialback,
    candidate_ports,
    detect_reachability,
    free_tcp_port,
    observed_ip,
    serve_dialback,
)
from tests.harness import Swarm
from tests.netbed import NetBed
from tests.wanrun import NetSwarm

# ---- the service's guards ------------------------------------------------------------------------------


def test_limiter_bounds_requests_per_ip_within_the_window() -> None:
    limiter = DialBackLimiter(per_ip=3, window=60.0)
    assert [limiter.allow("192.0.0.140", now=t) for t in (0, 1, 2, 3)] == [True, True, True, False]
    assert limiter.allow("192.0.0.141", now=3)  # another IP has its own budget
    assert limiter.allow("192.0.0.140", now=61)  # the window slid past the first request


def test_the_default_limit_admits_a_swarm_behind_one_address() -> None:
    # 16 loopback peers starting together (and restarts) once hit a limit of 6 a minute: the refused ones
    # took "rate limited" for "private" and ran in client mode. 32 peers plus a restart each must pass.
    limiter = DialBackLimiter()
    assert all(limiter.allow("127.0.0.1", now=i / 100) for i in range(64))
    assert not limiter.allow("127.0.0.1", now=1.0)


def test_requests_are_validated_and_bounded() -> None:
    assert _ports([4001, 4001, 5000]) == [4001, 5000]
    assert len(_ports(list(range(1000, 1100)))) == MAX_PORTS
    for bad in ([0], [70000], ["22"], [True], "4001"):
        with pytest.raises(ValueError):
            _ports(bad)
    assert candidate_ports(4001, ["/ip4/203.0.113.5/tcp/5001", "/dns4/x.example/tcp/4001"]) == [4001, 5001]
    relay = "/ip4/192.0.0.130/tcp/4002/p2p/12D3KooWG4S3brttbwHzwzhCCu2sGSSPoZFYSmF4PGAxHGFbqJ4f"
    # Relay addresses in a reply are stranger data: only well-formed /p2p/ multiaddrs pass.
    assert _relays([relay, "/ip4/192.0.0.130/tcp/4003", "junk", 5, relay + "x" * 300]) == (relay,)
    assert _relays("not a list") == ()


def test_only_the_requesters_own_direct_address_is_dialled() -> None:
    assert observed_ip(Multiaddr("/ip4/192.0.0.133/tcp/4001")) == "192.0.0.133"
    relayed = "/ip4/192.0.0.130/tcp/4001/p2p/12D3KooWG4S3brttbwHzwzhCCu2sGSSPoZFYSmF4PGAxHGFbqJ4f/p2p-circuit"
    assert observed_ip(Multiaddr(relayed)) is None  # the relay's IP is not the requester's
    assert observed_ip(None) is None


# ---- real p2pd on loopback -------------------------------------------------------------------------------


async def _with_prober(test: Callable[[str], object], limiter: DialBackLimiter | None = None) -> None:
    prober = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False)
    try:
        await serve_dialback(prober, limiter)
        maddr = f"{(await prober.get_visible_maddrs())[0]}"
        await test(maddr)  # type: ignore[misc]
    finally:
        await prober.shutdown()


def test_dialback_reaches_a_listening_port_and_not_a_closed_one() -> None:
    async def check(maddr: str) -> None:
        port = free_tcp_port("127.0.0.1")
        found = await detect_reachability([maddr], "127.0.0.1", port)
        assert found.public and found.reached == (port,) and found.observed_ip == "127.0.0.1", found
        # A second node asks about a port nothing listens on: not reached.
        asker = await P2P.create(
            initial_peers=[maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False
        )
        try:
            closed = free_tcp_port("127.0.0.1")
            found = await ask_dialback(asker, Multiaddr(maddr), [closed], timeout=10)
            assert not found.public and found.reached == () and "could not dial us back" in found.reason
        finally:
            await asker.shutdown()

    asyncio.run(_with_prober(check))


class FirstRefused(DialBackLimiter):
    def allow(self, ip: str, now: float | None = None) -> bool:
        if not getattr(self, "refused", False):
            self.refused = True
            return False
        return super().allow(ip, now)


def test_a_prober_that_rate_limited_us_is_asked_again_before_we_call_ourselves_private() -> None:
    # The prober refuses our first request (its budget for our address was spent by a neighbour) and
    # answers the next. Taking "rate limited" for "private" kept 10 of 16 peers in client mode.
    limiter = FirstRefused()

    async def check(maddr: str) -> None:
        port = free_tcp_port("127.0.0.1")
        found = await detect_reachability([maddr], "127.0.0.1", port, timeout=10)
        assert found.public and found.reached == (port,), found

    asyncio.run(_with_prober(check, limiter))
    assert limiter.refused


def test_no_answering_bootstrap_means_private_with_the_reason() -> None:
    async def check() -> None:
        dead = free_tcp_port("127.0.0.1")  # nothing listens here
        maddr = f"/ip4/127.0.0.1/tcp/{dead}/p2p/12D3KooWG4S3brttbwHzwzhCCu2sGSSPoZFYSmF4PGAxHGFbqJ4f"
        found = await detect_reachability([maddr], "127.0.0.1", free_tcp_port("127.0.0.1"), timeout=5)
        assert not found.public and found.observed_ip is None
        assert "no initial peer could dial us back" in found.reason and "assuming private" in found.reason

    asyncio.run(check())


# ---- real daemons ------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_a_peer_on_loopback_detects_it_is_public(swarm: Callable[..., Swarm]) -> None:
    s = swarm(1)  # net.reachability = auto (the default)
    status = s.wait_serving(s.peers[0])
    assert status["reachability"] == "public" and status["relayed"] is False, status
    assert status["maddrs"], status
    log = s.peers[0].output()
    assert "reachability: public (" in log and "dialled us back at 127.0.0.1:" in log, log[-2000:]


@pytest.mark.integration
def test_behind_a_nat_a_peer_is_private_and_on_a_public_address_public(
    netbed: NetBed, wan: Callable[..., NetSwarm]
) -> None:
    netbed.add_nat("natA")
    netbed.add_public("pubB")
    s = wan()
    s.start_bootstrap("dilocod", "--no-reduce")
    nated = s.add_peer(where="natA")
    public = s.add_peer(where="pubB")
    for proc, role in ((nated, "private"), (public, "public")):
        status = s.wait_serving(proc, timeout=180)
        assert status["reachability"] == role and status["relayed"] is (role == "private"), status
    nated_log, public_log = nated.output(), public.output()
    router = netbed.public_addr("natA")
    assert "reachability: private (" in nated_log and f"could not dial us back at {router}:" in nated_log
    assert "relayed: yes" in nated_log, nated_log[-2000:]
    assert f"dialled us back at {netbed.addr('pubB')}:" in public_log, public_log[-2000:]
    assert netbed.guard_violations() == 0
