"""A state download from 1, 2 and 4 donors on shaped links vs the bound (state ÷ the donors' summed upload).

    sudo .venv/bin/python bench/statedonors.py [--mb 64] [--rate 40] [--delay-ms 10] [--repeat 2]

Needs root (tests/netbed.py: network namespaces, tc). Four public donor hosts, each on an access link of
`--rate` Mbit/s each way with `--delay-ms` one-way delay, serve the same state (θ_global and momentum as
two fp32 tensors of `--mb` MB in all) with peers/state/share.py's server; an unshaped joiner host downloads
it with peers/state/download.py (the code a re-syncing peer runs), from the first 1, 2 and 4 donors in
turn, `--repeat` times each, and checks every byte. The bound for k donors is the state's bits ÷ (k ×
rate); the ratio printed is bound ÷ measured time (1.0 = the donors' links were full all along).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from hivemind.p2p import P2P, PeerID  # noqa: E402
from hivemind.utils.multiaddr import Multiaddr  # noqa: E402

from peers.state import download as statedownload  # noqa: E402
from peers.state.download import PartsDownload  # noqa: E402
from peers.state.share import STATE_PROTOCOL, P2PStateClient, StateServer  # noqa: E402
from proto import encode_state_meta  # noqa: E402

DONORS = 4
COUNTS = (1, 2, 4)


def make_state(mb: int) -> tuple[bytes, list[torch.Tensor]]:
    """The same state in every process: θ_global and momentum of `mb` MB together."""
    floats = mb * 1_000_000 // 8
    g = torch.Generator().manual_seed(1234)
    tensors = [torch.randn(floats, generator=g), torch.randn(floats, generator=g)]
    meta = encode_state_meta(
        {"outer_step": 1, "global_sha256": "0" * 64, "num_tensors": 2, "param_count": 1, "time": 1.0}
    )
    return meta, tensors


async def start_p2p(host: str) -> P2P:
    return await P2P.create(
        host_maddrs=[f"/ip4/{host}/tcp/0"], nat_port_map=False, auto_nat=False, use_relay=False
    )


async def donor(host: str, out: Path, mb: int) -> None:
    p2p = await start_p2p(host)
    meta, tensors = make_state(mb)
    server = StateServer(lambda: (meta, tensors))
    snapshot = server._current()  # hash the parts before the joiner asks (a donor does it once a snapshot)
    assert snapshot is not None
    await server._digests(snapshot)
    await p2p.add_binary_stream_handler(STATE_PROTOCOL, server.handle)
    maddr = next(str(m) for m in await p2p.get_visible_maddrs() if host in str(m))
    out.with_suffix(".maddr").write_text(maddr)
    while not out.with_suffix(".stop").exists():
        await asyncio.sleep(0.2)
    await p2p.shutdown()


async def joiner(host: str, maddrs: list[str], mb: int, repeat: int, out: Path) -> None:
    p2p = await start_p2p(host)
    want = make_state(mb)[1]
    donors = []
    for text in maddrs:
        peer = PeerID.from_base58(text.split("/p2p/")[1])
        await p2p._client.connect(peer, [Multiaddr(text.split("/p2p/")[0])])
        donors.append(peer.to_base58())
    client = P2PStateClient(p2p, stall_seconds=60)
    for donor_id in donors:  # warm each connection once (dial, stream setup) outside the timing
        await client.head(donor_id, 30)
    rows = []
    for _ in range(repeat):
        for count in COUNTS:
            download = PartsDownload(client, max_bytes=mb * 1_000_000, min_part_timeout=120)
            began = time.perf_counter()
            result = await download.download(donors[:count], timeout=900)
            seconds = time.perf_counter() - began
            assert result.ok and all(torch.equal(a, b) for a, b in zip(result.tensors, want)), result.error
            rows.append(
                {"donors": count, "seconds": seconds, "parts_from": sorted(result.parts_from.values())}
            )
            print(json.dumps(rows[-1]), flush=True)
            del result
    out.write_text(json.dumps(rows))
    await p2p.shutdown()


def run_bed(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tests.netbed import NetBed

    with tempfile.TemporaryDirectory(prefix="statedonors-") as tmp, NetBed() as bed:
        work = Path(tmp)
        me = [sys.executable, str(Path(__file__).resolve())]
        procs = []
        for i in range(DONORS):
            host = f"d{i}"
            bed.add_public(host, rate_mbit=args.rate, delay_ms=args.delay_ms)
            argv = [*me, "donor", "--host", bed.addr(host), "--out", str(work / host), "--mb", str(args.mb)]
            procs.append(bed.run(host, argv, cwd=Path.cwd()))
        files = [work / f"d{i}.maddr" for i in range(DONORS)]
        deadline = time.monotonic() + 300
        while not all(f.exists() for f in files):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError("the donors did not start")
            time.sleep(0.2)
        maddrs = [f.read_text() for f in files]
        argv = [*me, "joiner", "--host", bed.addr("pub"), "--mb", str(args.mb), "--repeat", str(args.repeat),
                "--out", str(work / "rows.json"), "--in-flight", str(args.in_flight or 0), "--donors", *maddrs]  # fmt: skip
        bed.call("pub", argv, timeout=3600)
        for i in range(DONORS):
            (work / f"d{i}.stop").write_text("")
        for p in procs:
            p.wait(timeout=30)
        rows: list[dict[str, Any]] = json.loads((work / "rows.json").read_text())
        return rows


def summarize(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    bits = args.mb * 1e6 * 8
    in_flight = args.in_flight or statedownload.IN_FLIGHT
    print(
        f"state {args.mb} MB, donors' links {args.rate} Mbit/s each way, {args.delay_ms} ms one-way delay, "
        f"{in_flight} parts in flight per donor"
    )
    print("donors | bound s | median s | runs s | bound ÷ time | speed-up vs 1 donor")
    one = None
    for count in COUNTS:
        times = [r["seconds"] for r in rows if r["donors"] == count]
        median = statistics.median(times)
        one = one or median
        bound = bits / (count * args.rate * 1e6)
        print(
            f"{count:6d} | {bound:7.1f} | {median:8.1f} | {', '.join(f'{t:.1f}' for t in times):>10} | "
            f"{bound / median:12.2f} | {one / median:.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("role", nargs="?", choices=("donor", "joiner"), help=argparse.SUPPRESS)
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--rate", type=float, default=40.0, help="each donor's link, Mbit/s each way")
    ap.add_argument("--delay-ms", type=float, default=10.0)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument(
        "--in-flight", type=int, default=None, help="parts a donor sends at once (default: the code's)"
    )
    ap.add_argument("--host", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--donors", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "donor":
        asyncio.run(donor(args.host, args.out, args.mb))
    elif args.role == "joiner":
        if args.in_flight:
            statedownload.IN_FLIGHT = args.in_flight
        asyncio.run(joiner(args.host, args.donors, args.mb, args.repeat, args.out))
    else:
        summarize(args, run_bed(args))


if __name__ == "__main__":
    main()
