"""A dataset file's download (peers/datafetch.py), over HTTP and over p2p, vs a plain TCP copy of the same bytes.

    .venv/bin/python bench/datafetch.py [--mb 200] [--repeat 3] [--piece-kib 1024] [--dir /dev/shm]
                                        [--loop uvloop|asyncio]

`--dir` holds the source and the downloaded copies (default: the system's temp dir); /dev/shm takes the
disk out of both sides, so what is left is the transport. `--loop`: the event loop of both ends (default
uvloop, which the daemon runs on; it has no sendfile, so the HTTP server sends piece by piece there).

One server p2pd and one client p2pd in this process (as a node runs them: each daemon is a child process,
the Python side talks to it over a unix socket). Each repeat times, side by side:
- `http`: fetch_file as a joiner runs it (the server's HTTP path, peers/databulk.py: its port asked over p2p,
  then a Range GET answered with sendfile; write to <dest>.part, sha256 as bytes come, rename);
- `p2p`: fetch_file over the p2p data protocol only (what a server without a reachable HTTP port gives);
- `tcp`: a plain socket that `sendfile`s the same file, an asyncio client that writes it to disk;
- `tcp+sha`: the same with the client hashing as it writes (the work fetch_file does besides the transport).
The ratios are http ÷ tcp and p2p ÷ tcp MB/s (goal ≥ 0.8), and http ÷ tcp+sha (the copy with the check
no download may skip), per repeat, and their medians.

A first HTTP fetch (the server's port asked over p2p, the first connection) is timed apart: a joiner does
that once per server, then fetches shard after shard. Each path's CPU seconds per GB are printed too (this
process and both p2pd daemons, from /proc, over the transfer alone): on a loaded machine the wall-clock
ratio is noise, the CPU cost is not.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import uvloop
from hivemind.p2p import P2P
from hivemind.utils.multiaddr import Multiaddr

from peers.databulk import BulkRoutes
from peers.datafetch import fetch_file, file_matches
from peers.datashare import serve_data

NAME = "train-00000.bin"
READ = 1 << 20
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """user + system CPU seconds of this process (all its threads) and of `pids`."""
    own = os.times()
    total = own.user + own.system
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    return total


def make_file(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        left = size
        while left:
            chunk = os.urandom(min(left, 16 << 20))
            f.write(chunk)
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


async def start_p2p() -> P2P:
    return await P2P.create(
        host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False, use_relay=False
    )


async def fetch(
    client: P2P, server: P2P, size: int, sha: str, dest: Path, routes: BulkRoutes | None, daemons: list[int]
) -> tuple[float, float]:
    """(seconds, CPU seconds) of one fetch_file; the check of the result afterwards is not counted."""
    dest.unlink(missing_ok=True)
    cpu = cpu_seconds(daemons)
    began = time.perf_counter()
    result = await fetch_file(client, [server.peer_id], NAME, size, sha, dest, routes=routes)
    took = time.perf_counter() - began
    cpu = cpu_seconds(daemons) - cpu
    assert result.received == size and not result.failed
    assert file_matches(dest, size, sha)
    return took, cpu


async def tcp_copy(source: Path, dest: Path, daemons: list[int], *, hash_too: bool) -> tuple[float, float]:
    # The sender is a plain blocking socket on a thread (socket.sendfile), whatever the event loop: uvloop
    # has no loop.sendfile.
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def send() -> None:
        conn, _ = listener.accept()
        with conn, open(source, "rb") as f:
            conn.sendfile(f)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    digest = hashlib.sha256()
    cpu = cpu_seconds(daemons)
    began = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    with open(dest, "wb") as out:
        while chunk := await reader.read(READ):
            out.write(chunk)
            if hash_too:
                digest.update(chunk)
    writer.close()
    sender.join()
    took = time.perf_counter() - began
    cpu = cpu_seconds(daemons) - cpu
    listener.close()
    assert dest.stat().st_size == source.stat().st_size
    return took, cpu


async def main(mb: int, repeat: int, piece: int, where: str | None) -> None:
    size = mb * 1_000_000
    with tempfile.TemporaryDirectory(prefix="datafetch-", dir=where) as tmp:
        source, dest = Path(tmp) / "source.bin", Path(tmp) / NAME
        sha = make_file(source, size)
        server, client = await asyncio.gather(start_p2p(), start_p2p())
        try:
            own = Multiaddr(f"/p2p/{server.peer_id}")
            maddrs = [m.decapsulate(own) for m in await server.get_visible_maddrs()]
            await client._client.connect(server.peer_id, maddrs)
            resolve = lambda name: source if name == NAME else None  # noqa: E731
            data = await serve_data(server, resolve, piece_size=piece, bulk_host="127.0.0.1", bulk_port=0)
            assert data.bulk is not None, "the HTTP path did not start"
            routes = BulkRoutes(client)
            daemons = [p._child.pid for p in (server, client) if p._child is not None]
            # A joiner asks a server's HTTP port once (over p2p) and then fetches shard after shard: the
            # first fetch, with the lookup and the first connection, is shown apart from the repeats.
            first, first_cpu = await fetch(client, server, size, sha, dest, routes, daemons)
            print(
                f"first http fetch (port asked over p2p): {mb / first:6.1f} MB/s ({first_cpu * 1000 / mb:4.1f} CPU s/GB)"
            )
            ratios: dict[str, list[float]] = {"http/tcp": [], "p2p/tcp": [], "http/tcp+sha": []}
            for i in range(repeat):
                (http, c_http), (p2p, c_p2p) = [
                    await fetch(client, server, size, sha, dest, r, daemons) for r in (routes, None)
                ]
                (tcp, c_tcp), (tcp_sha, c_sha) = [
                    await tcp_copy(source, dest, daemons, hash_too=h) for h in (False, True)
                ]
                gb = [c * 1000 / mb for c in (c_http, c_p2p, c_tcp, c_sha)]
                ratios["http/tcp"].append(tcp / http)
                ratios["p2p/tcp"].append(tcp / p2p)
                ratios["http/tcp+sha"].append(tcp_sha / http)
                print(
                    f"run {i + 1}: http {mb / http:6.1f} MB/s ({gb[0]:4.1f} CPU s/GB)   "
                    f"p2p {mb / p2p:6.1f} ({gb[1]:4.1f})   tcp {mb / tcp:6.1f} ({gb[2]:4.1f})   "
                    f"tcp+sha {mb / tcp_sha:6.1f} ({gb[3]:4.1f})   http/tcp {tcp / http:.2f}   "
                    f"p2p/tcp {tcp / p2p:.2f}   http/tcp+sha {tcp_sha / http:.2f}"
                )
            for name, values in ratios.items():
                print(f"median {name} ratio over {repeat} runs of {mb} MB: {statistics.median(values):.2f}")
        finally:
            await asyncio.gather(server.shutdown(), client.shutdown())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--piece-kib", type=int, default=1024)
    parser.add_argument("--dir", default=None, help="where the files go (default: the temp dir)")
    parser.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default="uvloop",
        help="the event loop (the daemon runs uvloop)",
    )
    args = parser.parse_args()
    run = uvloop.run if args.loop == "uvloop" else asyncio.run
    print(f"{args.loop} event loop")
    run(main(args.mb, args.repeat, args.piece_kib * 1024, args.dir))
