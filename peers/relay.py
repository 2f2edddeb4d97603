"""A circuit-relay-v2 service whose limits fit pseudo-gradients (py-libp2p), run as a child process.

Why: two peers behind NATs cannot dial each other. The relay bundled in hivemind's p2pd resets every
relayed connection after 128 KiB (libp2p's default limits, not configurable through p2pd), so it
cannot carry tensors. py-libp2p's relay v2 interoperates with p2pd (Noise + Yamux, the same hop/stop
protocol ids) and takes its limits from us. `dilocod bootstrap --relay` starts one.

Why `RELAY_IDENTITIES` relays: go-libp2p's autorelay waits for at least 4 relay candidates before it
reserves a slot (with fewer it waits 3 minutes), so the child runs four relay identities, one port
each, on the bootstrap's public IP. Peers learn their addresses from the dial-back reply
(peers/reachability.py) and pass them to p2pd as trusted relays.

Why a child process with its own site directory: py-libp2p 0.8.1 needs protobuf < 7 (and multiaddr,
py-multihash versions of its own) while the newest grpcio-tools hivemind pulls in needs protobuf ≥ 7;
installing both into one environment would downgrade what hivemind runs on. So py-libp2p lives in
`RELAY_SITE` (`make relay` installs it there with `pip install --target`), and only the relay child,
which imports nothing of hivemind, puts that directory first on its path. The child is a trio
program (`python -m peers.relay`), the parent side here is plain asyncio-free subprocess code.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from peers.errors import PeersError

log = logging.getLogger("peers.relay")

RELAY_IDENTITIES = 4
LIBP2P_VERSION = "0.8.1"
# Where `make relay` installs py-libp2p: beside the venv's own site-packages, never inside it.
RELAY_SITE = Path(os.environ.get("DILOCOD_LIBP2P_SITE", Path(sys.prefix) / "libp2p-site"))
# A relayed connection carries every round's parts for as long as the two peers stay connected.
RELAY_DATA_BYTES = 1 << 40  # per relayed connection (both directions together); 0 would reset at once
RELAY_DURATION_S = 0  # 0 = no time limit (unlike `data`, where 0 means "nothing")
RELAY_MAX_CIRCUITS = 256
RELAY_MAX_RESERVATIONS = 256
START_TIMEOUT = 30.0


def relay_available() -> str | None:
    """None when the relay can run here, else why not (one line a user can act on)."""
    if not (RELAY_SITE / "libp2p").is_dir():
        return (
            f"py-libp2p is not installed in {RELAY_SITE} (run `make relay`, or "
            f"`pip install --target {RELAY_SITE} libp2p=={LIBP2P_VERSION}`)"
        )
    return None


def public_ipv4(maddrs: Sequence[str]) -> str | None:
    """The first IPv4 address in `maddrs` that others could dial (not a wildcard, not loopback)."""
    # Imported here: the relay child must never load hivemind (its protobufs clash with py-libp2p's).
    from hivemind.utils.multiaddr import Multiaddr

    for text in maddrs:
        with contextlib.suppress(Exception):
            ip = str(Multiaddr(text).value_for_protocol("ip4"))
            if ip != "0.0.0.0" and not ip.startswith("127."):
                return ip
    return None


@dataclass
class RelayProcess:
    """The relay child: `start()` returns its multiaddrs once every identity listens; `stop()` ends it."""

    ip: str  # the public IP the relays listen on and announce
    ports: Sequence[int]
    workdir: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> list[str]:
        reason = relay_available()
        if reason is not None:
            raise PeersError(f"cannot start the relay: {reason}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        out = self.workdir / "relay.maddrs"
        out.unlink(missing_ok=True)
        env = dict(os.environ)
        repo = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([str(RELAY_SITE), repo])
        argv = [sys.executable, "-m", "peers.relay", "--ip", self.ip, "--out", str(out)]
        argv += ["--ports", ",".join(str(p) for p in self.ports)]
        with (self.workdir / "relay.log").open("ab") as logfile:
            # Its own session: stopping the bootstrap's process group never leaves it behind, and our
            # shutdown ends it explicitly.
            self.popen = subprocess.Popen(
                argv, env=env, stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if out.exists():
                return out.read_text().split()
            if self.popen.poll() is not None:
                break
            time.sleep(0.1)
        tail = (self.workdir / "relay.log").read_text(errors="replace").strip().splitlines()[-3:]
        self.stop()
        raise PeersError(f"the relay did not start: {' | '.join(tail) or 'no output'}")

    def stop(self) -> None:
        popen, self.popen = self.popen, None
        if popen is None or popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGTERM)
        try:
            popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(timeout=5)


# ---- the child: py-libp2p under trio --------------------------------------------------------------------


def _serve(ip: str, ports: list[int], out: Path) -> None:
    # Imported here: only the child, with RELAY_SITE first on its path, has py-libp2p.
    import multiaddr
    import trio
    from libp2p import new_host
    from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
    from libp2p.relay.circuit_v2.resources import RelayLimits
    from libp2p.tools.anyio_service import background_trio_service

    limits = RelayLimits(
        duration=RELAY_DURATION_S,
        data=RELAY_DATA_BYTES,
        max_circuit_conns=RELAY_MAX_CIRCUITS,
        max_reservations=RELAY_MAX_RESERVATIONS,
        reservation_ttl=3600,
    )
    ready: list[str] = []

    async def one(port: int) -> None:
        listen = multiaddr.Multiaddr(f"/ip4/{ip}/tcp/{port}")
        host = new_host(listen_addrs=[listen], announce_addrs=[listen])
        relay = CircuitV2Protocol(host, limits=limits, allow_hop=True)
        async with host.run(listen_addrs=[listen]), background_trio_service(relay):
            await relay.event_started.wait()
            ready.append(f"/ip4/{ip}/tcp/{port}/p2p/{host.get_id().to_base58()}")
            await trio.sleep_forever()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for port in ports:
                nursery.start_soon(one, port)
            with trio.fail_after(START_TIMEOUT):
                while len(ready) < len(ports):
                    await trio.sleep(0.05)
            tmp = out.with_suffix(".tmp")
            tmp.write_text("".join(f"{m}\n" for m in ready))
            tmp.replace(out)  # the parent never reads a half-written file
            logging.info("relay up: %s", " ".join(ready))
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    logging.info("relay stopping (%s)", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    break

    trio.run(main)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m peers.relay", description=__doc__)
    parser.add_argument("--ip", required=True)
    parser.add_argument("--ports", required=True, help="comma-separated, one relay identity per port")
    parser.add_argument("--out", type=Path, required=True, help="write the relays' multiaddrs here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("libp2p", "multiaddr"):  # per-stream chatter at INFO
        logging.getLogger(noisy).setLevel(logging.WARNING)
    _serve(args.ip, [int(p) for p in args.ports.split(",")], args.out)


if __name__ == "__main__":
    main()
