"""Dataset files over p2p (peers/datashare.py, peers/datafetch.py, proto/data.py).

- the headers' schemas: round trips, cross-field rules, names that are paths, hostile bytes;
- real p2pd daemons on loopback, in this process: a file fetched whole, a cut download resumed from its
  offset, a server that serves altered bytes reported bad (alone, or mixed with an honest server's bytes),
  path-like names refused before the lookup, a missing file or a cut stream → the next server (a cut one
  asked again after the others, from the bytes held), the rate limit, and a malformed request that leaves
  the server serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import struct
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgpack
import pytest
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.utils.multiaddr import Multiaddr

from peers.datafetch import CUT_RETRIES, fetch_file
from peers.datashare import DATA_PROTOCOL, DataFetchError, DataServer, serve_data
from proto import ProtoError
from proto.data import (
    decode_data_reply,
    decode_data_request,
    encode_data_reply,
    encode_data_request,
    name_problem,
)

pytestmark = pytest.mark.integration  # real processes, servers or namespaces: not in `make test-fast`

# ---- the schemas -------------------------------------------------------------------------------------------


def test_headers_round_trip_and_replies_are_either_data_or_an_error() -> None:
    request = {"name": "train-00000.bin", "offset": 5, "length": None}
    assert decode_data_request(encode_data_request(request)) == request
    reply = {"size": 10, "length": 5, "error": None}
    assert decode_data_reply(encode_data_reply(reply)) == reply
    for bad in ({"size": 10, "length": 11}, {"size": 10}, {"error": "x", "size": 1}, {}):
        with pytest.raises(ProtoError):
            encode_data_reply(bad)


@pytest.mark.parametrize("name", ["a/b", "../x", "..", "x\\y", "a\x00b", "", "n" * 256])
def test_path_like_names_are_refused_on_both_sides(name: str) -> None:
    assert name_problem(name) is not None
    with pytest.raises(ProtoError):
        encode_data_request({"name": name, "offset": 0})
    raw = msgpack.packb({"_s": "dilocod.data.request", "_v": 1, "name": name, "offset": 0})
    with pytest.raises(ProtoError):
        decode_data_request(raw)


def test_hostile_bytes_only_ever_raise_proto_error() -> None:
    rng = random.Random(7)
    for _ in range(500):
        data = rng.randbytes(rng.randrange(0, 64))
        for decode in (decode_data_request, decode_data_reply):
            with contextlib.suppress(ProtoError):
                decode(data)


# ---- real p2pd on loopback ---------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def nodes(count: int) -> AsyncIterator[list[P2P]]:
    """`count` p2pd daemons; the first (the client) is connected to all the others. Always shut down."""
    started: list[P2P] = []

    async def start() -> None:
        p2p = await P2P.create(
            host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False, use_relay=False
        )
        started.append(p2p)

    try:
        await asyncio.gather(*(start() for _ in range(count)))
        client = started[0]
        for server in started[1:]:
            own = Multiaddr(f"/p2p/{server.peer_id}")
            maddrs = [m.decapsulate(own) for m in await server.get_visible_maddrs()]
            await client._client.connect(server.peer_id, maddrs)
        yield started
    finally:
        for p2p in started:
            with contextlib.suppress(Exception):
                await p2p.shutdown()


def make_file(path: Path, size: int, seed: int = 1) -> str:
    path.write_bytes(random.Random(seed).randbytes(size))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def only(path: Path, name: str = "train-00000.bin") -> Callable[[str], Path | None]:
    return lambda asked: path if asked == name else None


async def raw_request(client: P2P, server: PeerID, message: bytes, *, hang_up: bool = False) -> bytes:
    """Sends `message` as it is and returns everything the server answers until it closes (nothing when
    we `hang_up` at once: p2pd has no half-close, so that is how a requester cuts its request short)."""
    _, reader, writer = await client.call_binary_stream_handler(server, DATA_PROTOCOL)
    try:
        writer.write(message)
        await writer.drain()
        if hang_up:
            return b""
        return await asyncio.wait_for(reader.read(-1), 15)
    finally:
        writer.close()


def reply_of(answer: bytes) -> dict[str, object]:
    (size,) = struct.unpack(">I", answer[:4])
    return decode_data_reply(answer[4 : 4 + size])


def request(name: str, offset: int = 0) -> bytes:
    body = msgpack.packb({"_s": "dilocod.data.request", "_v": 1, "name": name, "offset": offset})
    return struct.pack(">I", len(body)) + body


def test_a_file_comes_whole_from_one_server_and_is_not_fetched_again(tmp_path: Path) -> None:
    source = tmp_path / "served.bin"
    sha = make_file(source, 3_000_123)
    dest = tmp_path / "got" / "train-00000.bin"
    dest.parent.mkdir()
    seen: list[int] = []

    async def main() -> None:
        async with nodes(2) as (client, node):
            server = await serve_data(node, only(source))
            result = await fetch_file(
                client,
                [node.peer_id],
                "train-00000.bin",
                source.stat().st_size,
                sha,
                dest,
                progress=seen.append,
            )
            assert result.served_by == node.peer_id and result.sources == [node.peer_id]
            assert result.received == source.stat().st_size and not result.bad and not result.failed
            assert dest.read_bytes() == source.read_bytes() and not Path(f"{dest}.part").exists()
            assert seen[-1] == source.stat().st_size and seen == sorted(seen)
            served = server.bytes_served
            again = await fetch_file(
                client, [node.peer_id], "train-00000.bin", len(dest.read_bytes()), sha, dest
            )
            assert again.served_by is None and again.received == 0 and server.bytes_served == served

    asyncio.run(main())


def test_a_cut_download_resumes_from_its_offset(tmp_path: Path) -> None:
    source = tmp_path / "served.bin"
    sha = make_file(source, 2_000_000)
    dest = tmp_path / "train-00000.bin"
    Path(f"{dest}.part").write_bytes(source.read_bytes()[:1_000_000])

    async def main() -> None:
        async with nodes(2) as (client, node):
            server = await serve_data(node, only(source))
            result = await fetch_file(client, [node.peer_id], "train-00000.bin", 2_000_000, sha, dest)
            assert server.bytes_served == 1_000_000 and result.received == 1_000_000
            assert dest.read_bytes() == source.read_bytes()

    asyncio.run(main())


def test_a_server_of_altered_bytes_is_reported_bad_and_the_file_comes_from_an_honest_one(
    tmp_path: Path,
) -> None:
    source = tmp_path / "good.bin"
    sha = make_file(source, 1_500_000)
    altered = tmp_path / "altered.bin"
    data = bytearray(source.read_bytes())
    data[1_234_567] ^= 0xFF
    altered.write_bytes(data)
    dest = tmp_path / "train-00000.bin"

    async def main() -> None:
        async with nodes(3) as (client, liar, honest):
            await serve_data(liar, only(altered))
            await serve_data(honest, only(source))
            result = await fetch_file(
                client, [liar.peer_id, honest.peer_id], "train-00000.bin", len(data), sha, dest
            )
            assert result.bad == [liar.peer_id] and result.served_by == honest.peer_id
            assert result.sources == [honest.peer_id] and not result.failed
            assert dest.read_bytes() == source.read_bytes()

    asyncio.run(main())


async def serve_cut(
    p2p: P2P, data: bytes, upto: int, *, stall: float = 0.0, streams: int | None = None
) -> list[int]:
    """A server that announces the whole rest of the file but stops after byte `upto`: it closes the
    stream, or first holds it open for `stall` seconds without sending anything. Only its first `streams`
    streams are cut (None: all); it serves the later ones whole. Returns the offsets it was asked for."""
    asked: list[int] = []

    async def handle(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        (size,) = struct.unpack(">I", await reader.readexactly(4))
        offset = decode_data_request(await reader.readexactly(size))["offset"]
        end = upto if streams is None or len(asked) < streams else len(data)
        asked.append(offset)
        header = encode_data_reply({"size": len(data), "length": len(data) - offset})
        writer.write(struct.pack(">I", len(header)) + header + data[offset:end])
        await writer.drain()
        await asyncio.sleep(stall)
        writer.close()

    await p2p.add_binary_stream_handler(DATA_PROTOCOL, handle)
    return asked


@pytest.mark.parametrize("stall", [0.0, 30.0], ids=["closed", "stalled"])
def test_a_cut_or_stalled_stream_moves_on_to_the_next_server_keeping_the_bytes(
    tmp_path: Path, stall: float
) -> None:
    source = tmp_path / "good.bin"
    sha = make_file(source, 1_000_000)
    dest = tmp_path / "train-00000.bin"

    async def main() -> None:
        async with nodes(3) as (client, cut, honest):
            await serve_cut(cut, source.read_bytes(), 400_000, stall=stall)
            server = await serve_data(honest, only(source))
            began = time.monotonic()
            result = await fetch_file(
                client, [cut.peer_id, honest.peer_id], "train-00000.bin", 1_000_000, sha, dest, timeout=1.5
            )
            assert time.monotonic() - began < 10
            assert result.sources == [cut.peer_id, honest.peer_id] and server.bytes_served == 600_000
            reason = "stalled: no bytes for 1.5 s" if stall else "ended 600000 bytes short"
            assert reason in result.failed[cut.peer_id] and not result.bad
            assert dest.read_bytes() == source.read_bytes()

    asyncio.run(main())


def test_the_only_server_of_a_file_is_asked_again_after_a_cut_from_the_bytes_held(tmp_path: Path) -> None:
    """A cut is the network's more often than the server's: with one server (a run's bootstrap serving its
    index to an export), a stream that ended short is asked again from where it ended, a bounded number of
    times; the error of a server that always cuts says so in one line."""
    source = tmp_path / "good.bin"
    sha = make_file(source, 1_000_000)

    async def main() -> None:
        async with nodes(3) as (client, flaky, broken):
            asked = await serve_cut(flaky, source.read_bytes(), 400_000, streams=1)
            dest = tmp_path / "train-00000.bin"
            result = await fetch_file(client, [flaky.peer_id], "train-00000.bin", 1_000_000, sha, dest)
            assert asked == [0, 400_000] and result.received == 1_000_000
            assert result.sources == [flaky.peer_id] and not result.failed and not result.bad
            assert dest.read_bytes() == source.read_bytes()

            asked = await serve_cut(broken, source.read_bytes(), 0)
            with pytest.raises(DataFetchError) as caught:
                await fetch_file(client, [broken.peer_id], "train-00000.bin", 1_000_000, sha, tmp_path / "x")
            assert asked == [0] * (1 + CUT_RETRIES)
            assert "ended 1000000 bytes short" in str(caught.value) and "\n" not in str(caught.value)

    asyncio.run(main())


def test_a_liar_mixed_with_an_honest_server_is_found_by_refetching_whole(tmp_path: Path) -> None:
    # The liar sends 400 kB of altered bytes and hangs up; the honest server sends the rest. The file does
    # not match and either could have lied: it is set aside, the honest server sends it whole, and the
    # liar's run differs from the good bytes at the same place.
    source = tmp_path / "good.bin"
    sha = make_file(source, 1_000_000)
    altered = bytearray(source.read_bytes())
    altered[100] ^= 1
    dest = tmp_path / "train-00000.bin"

    async def main() -> None:
        async with nodes(3) as (client, liar, honest):
            await serve_cut(liar, bytes(altered), 400_000)
            server = await serve_data(honest, only(source))
            result = await fetch_file(
                client, [liar.peer_id, honest.peer_id], "train-00000.bin", 1_000_000, sha, dest
            )
            assert result.bad == [liar.peer_id] and result.served_by == honest.peer_id
            assert server.bytes_served == 600_000 + 1_000_000 and result.sources == [honest.peer_id]
            assert dest.read_bytes() == source.read_bytes()
            assert not Path(f"{dest}.suspect").exists() and not Path(f"{dest}.part").exists()

    asyncio.run(main())


def test_path_like_names_never_reach_the_lookup_and_a_missing_file_means_the_next_server(
    tmp_path: Path,
) -> None:
    source = tmp_path / "good.bin"
    sha = make_file(source, 100_000)
    dest = tmp_path / "train-00000.bin"
    asked: list[str] = []

    def lookup(name: str) -> Path | None:
        asked.append(name)
        return None

    async def main() -> None:
        async with nodes(3) as (client, empty, holder):
            await serve_data(empty, lookup)
            await serve_data(holder, only(source))
            for name in ("../train-00000.bin", "a/b", ".."):
                assert "bad request" in str(
                    reply_of(await raw_request(client, empty.peer_id, request(name)))["error"]
                )
            assert asked == []
            with pytest.raises(ValueError, match="not a file name"):
                await fetch_file(client, [holder.peer_id], "../x", 1, sha, dest)
            result = await fetch_file(
                client, [empty.peer_id, holder.peer_id], "train-00000.bin", 100_000, sha, dest
            )
            assert asked == ["train-00000.bin"] and "not found" in result.failed[empty.peer_id]
            assert result.served_by == holder.peer_id and dest.read_bytes() == source.read_bytes()

    asyncio.run(main())


def test_when_no_server_delivers_the_error_is_one_line(tmp_path: Path) -> None:
    dest = tmp_path / "train-00000.bin"

    async def main() -> None:
        async with nodes(2) as (client, empty):
            await serve_data(empty, lambda name: None)
            with pytest.raises(DataFetchError) as caught:
                await fetch_file(client, [empty.peer_id], "train-00000.bin", 10, "0" * 64, dest, timeout=5)
            assert "\n" not in str(caught.value) and "not found" in str(caught.value)

    asyncio.run(main())


def test_the_rate_limit_caps_what_a_node_serves(tmp_path: Path) -> None:
    source = tmp_path / "good.bin"
    sha = make_file(source, 2_000_000)
    dest = tmp_path / "train-00000.bin"

    async def main() -> None:
        async with nodes(2) as (client, node):
            server = await serve_data(node, only(source), rate_limit=1_000_000)
            began = time.monotonic()
            await fetch_file(client, [node.peer_id], "train-00000.bin", 2_000_000, sha, dest)
            took = time.monotonic() - began
            assert 1.5 <= took < 6, took
            server.set_rate_limit(None)
            os.unlink(dest)
            began = time.monotonic()
            await fetch_file(client, [node.peer_id], "train-00000.bin", 2_000_000, sha, dest)
            assert time.monotonic() - began < 1.5

    asyncio.run(main())


def test_a_malformed_request_does_not_hurt_the_server(tmp_path: Path) -> None:
    source = tmp_path / "good.bin"
    sha = make_file(source, 50_000)
    dest = tmp_path / "train-00000.bin"
    rng = random.Random(3)

    async def main() -> None:
        async with nodes(2) as (client, node):
            server: DataServer = await serve_data(node, only(source))
            for message in (rng.randbytes(64), struct.pack(">I", 40) + rng.randbytes(40)):
                answer = await raw_request(client, node.peer_id, message)
                assert "bad request" in str(reply_of(answer)["error"])
            await raw_request(client, node.peer_id, b"\x00\x00", hang_up=True)  # cut short
            result = await fetch_file(client, [node.peer_id], "train-00000.bin", 50_000, sha, dest)
            assert result.served_by == node.peer_id and dest.read_bytes() == source.read_bytes()
            assert server.requests == 4 and server.refused == 2

    asyncio.run(main())
