"""Dataset files over a node's HTTP path (peers/databulk.py), with the p2p data protocol as the fallback.

Real p2pd daemons and real HTTP servers on loopback, in this process: a file comes over HTTP when the
server advertises a port; a cut download resumes with a Range from the bytes held; altered bytes over HTTP
name and ban their server as over p2p; a port that refuses, a body cut short, or a server without the
HTTP path leaves the download to p2p (keeping the bytes); the node's bandwidth cap holds over HTTP; bad
names and ranges are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import uvloop
from aiohttp import web

from peers.databulk import BulkRoutes, byte_range, serve_bulk_port
from peers.datafetch import fetch_file
from peers.datashare import serve_data
from proto import ProtoError
from proto.data import decode_bulk_reply, encode_bulk_reply
from tests.test_datashare import make_file, nodes, only

pytestmark = pytest.mark.integration  # real processes, servers or namespaces: not in `make test-fast`

NAME = "train-00000.bin"


@pytest.mark.parametrize(
    ("header", "size", "expected"),
    [
        (None, 10, (0, 10)),
        ("bytes=0-", 10, (0, 10)),
        ("bytes=4-", 10, (4, 6)),
        ("bytes=4-6", 10, (4, 3)),
        ("bytes=9-9", 10, (9, 1)),
        ("bytes=10-", 10, None),  # nothing left from there
        ("bytes=4-10", 10, None),  # past the end
        ("bytes=6-4", 10, None),
        ("bytes=-4", 10, None),  # a suffix range: never sent by a fetch
        ("bytes=0-1,4-5", 10, None),
        ("items=0-", 10, None),
    ],
)
def test_the_range_a_request_asks(header: str | None, size: int, expected: tuple[int, int] | None) -> None:
    assert byte_range(header, size) == expected


def test_the_port_reply_round_trips_and_hostile_bytes_only_raise_proto_error() -> None:
    assert decode_bulk_reply(encode_bulk_reply({"port": 8081})) == {"port": 8081}
    assert decode_bulk_reply(encode_bulk_reply({})) == {"port": None}
    for bad in ({"port": 0}, {"port": 70000}):
        with pytest.raises(ProtoError):
            encode_bulk_reply(bad)
    rng = random.Random(5)
    for _ in range(300):
        with contextlib.suppress(ProtoError):
            decode_bulk_reply(rng.randbytes(rng.randrange(0, 80)))


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_a_file_comes_over_http_and_a_cut_one_resumes_with_a_range(
    tmp_path: Path, run: Callable[[Coroutine[Any, Any, None]], None]
) -> None:
    # uvloop (what the daemon runs on) has no sendfile: the server sends piece by piece there.
    source = tmp_path / "served.bin"
    sha = make_file(source, 3_000_123)
    dest = tmp_path / NAME

    async def main() -> None:
        async with nodes(2) as (client, node):
            server = await serve_data(node, only(source), bulk_host="127.0.0.1", bulk_port=0)
            assert server.bulk is not None
            routes = BulkRoutes(client)
            result = await fetch_file(client, [node.peer_id], NAME, 3_000_123, sha, dest, routes=routes)
            assert result.sources == [node.peer_id] and not result.failed and not result.bad
            assert server.bulk.bytes_served == server.bytes_served == 3_000_123
            assert dest.read_bytes() == source.read_bytes()
            # A cut download: the bytes held stay, the rest comes with a Range from their end.
            dest.unlink()
            Path(f"{dest}.part").write_bytes(source.read_bytes()[:1_000_000])
            result = await fetch_file(client, [node.peer_id], NAME, 3_000_123, sha, dest, routes=routes)
            assert result.received == 2_000_123 and server.bulk.bytes_served == 3_000_123 + 2_000_123
            assert dest.read_bytes() == source.read_bytes()

    run(main())


def test_altered_bytes_over_http_name_their_server_bad(tmp_path: Path) -> None:
    source = tmp_path / "good.bin"
    sha = make_file(source, 1_500_000)
    altered = tmp_path / "altered.bin"
    data = bytearray(source.read_bytes())
    data[777_777] ^= 0x01
    altered.write_bytes(data)
    dest = tmp_path / NAME

    async def main() -> None:
        async with nodes(3) as (client, liar, honest):
            lying = await serve_data(liar, only(altered), bulk_host="127.0.0.1", bulk_port=0)
            await serve_data(honest, only(source), bulk_host="127.0.0.1", bulk_port=0)
            result = await fetch_file(
                client, [liar.peer_id, honest.peer_id], NAME, len(data), sha, dest, routes=BulkRoutes(client)
            )
            assert lying.bulk is not None and lying.bulk.bytes_served == len(data)  # it lied over HTTP
            assert result.bad == [liar.peer_id] and result.sources == [honest.peer_id]
            assert dest.read_bytes() == source.read_bytes()

    asyncio.run(main())


@contextlib.asynccontextmanager
async def cutting_http(source: Path, keep: int) -> AsyncIterator[int]:
    """An HTTP server that promises the bytes asked and sends `keep` of them, then hangs up; yields its port."""

    async def handle(request: web.Request) -> web.StreamResponse:
        first = int(request.headers["Range"].removeprefix("bytes=").split("-")[0])
        size = source.stat().st_size
        response = web.StreamResponse(status=206)
        response.content_length = size - first
        await response.prepare(request)
        await response.write(source.read_bytes()[first : first + keep])
        assert request.transport is not None
        request.transport.close()
        return response

    app = web.Application()
    app.router.add_get("/dilocod/data/{name}", handle)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield int(runner.addresses[0][1])
    finally:
        await runner.cleanup()


def test_when_the_http_path_fails_the_download_goes_on_over_p2p(tmp_path: Path) -> None:
    source = tmp_path / "served.bin"
    sha = make_file(source, 2_000_000)
    dest = tmp_path / NAME

    async def main() -> None:
        async with nodes(4) as (client, refusing, cutting, plain):
            # A port advertised where nothing listens (a firewall, a NAT): all of it over p2p.
            server = await serve_data(refusing, only(source), bulk_host="127.0.0.1", bulk_port=0)
            assert server.bulk is not None
            await server.bulk.stop()
            routes = BulkRoutes(client)
            result = await fetch_file(client, [refusing.peer_id], NAME, 2_000_000, sha, dest, routes=routes)
            assert result.sources == [refusing.peer_id] and not result.failed
            assert server.bytes_served == 2_000_000 and server.bulk.bytes_served == 0
            assert await routes.url(refusing.peer_id) is None  # not tried again for a while
            # A body cut short: the bytes that came stay, the rest comes over p2p from there.
            dest.unlink()
            p2p_only = await serve_data(cutting, only(source))
            async with cutting_http(source, 700_000) as port:
                await serve_bulk_port(cutting, port)
                result = await fetch_file(
                    client, [cutting.peer_id], NAME, 2_000_000, sha, dest, routes=routes
                )
            assert result.received == 2_000_000 and p2p_only.bytes_served == 1_300_000
            assert result.sources == [cutting.peer_id] and dest.read_bytes() == source.read_bytes()
            # A node without the HTTP path (or an older one): p2p, as ever.
            dest.unlink()
            plain_server = await serve_data(plain, only(source))
            assert await routes.url(plain.peer_id) is None
            result = await fetch_file(client, [plain.peer_id], NAME, 2_000_000, sha, dest, routes=routes)
            assert plain_server.bytes_served == 2_000_000 and dest.read_bytes() == source.read_bytes()

    asyncio.run(main())


def test_the_bandwidth_cap_holds_over_http_and_bad_requests_are_refused(tmp_path: Path) -> None:
    source = tmp_path / "good.bin"
    sha = make_file(source, 2_000_000)
    dest = tmp_path / NAME

    async def main() -> None:
        async with nodes(2) as (client, node):
            server = await serve_data(
                node, only(source), rate_limit=1_000_000, bulk_host="127.0.0.1", bulk_port=0
            )
            assert server.bulk is not None and server.bulk.port is not None
            began = time.monotonic()
            await fetch_file(client, [node.peer_id], NAME, 2_000_000, sha, dest, routes=BulkRoutes(client))
            took = time.monotonic() - began
            assert 1.5 <= took < 6, took
            assert server.bulk.bytes_served == 2_000_000
            base = f"http://127.0.0.1:{server.bulk.port}/dilocod/data"
            async with aiohttp.ClientSession() as session:
                for path, headers, status in [
                    ("nope.bin", {}, 404),
                    (NAME, {"Range": "bytes=2000000-"}, 416),
                    (NAME, {"Range": "bytes=-5"}, 416),
                    ("..%2Findex.json", {}, 400),
                ]:
                    async with session.get(f"{base}/{path}", headers=headers) as response:
                        assert response.status == status, (path, headers, response.status)
            served = server.bytes_served
            server.set_rate_limit(None)
            dest.unlink()
            began = time.monotonic()
            await fetch_file(client, [node.peer_id], NAME, 2_000_000, sha, dest, routes=BulkRoutes(client))
            assert time.monotonic() - began < 1.5 and server.bytes_served == served + 2_000_000

    asyncio.run(main())
