"""The state download in parts from several donors (peers/state/download.py, peers/state/share.py,
proto/state.py): honest donors share the work, a liar is named and its parts come from others, a slow or
cut donor's parts are re-queued, a cut download resumes from the parts it kept, and the wire carries it
all between real p2pd daemons."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import time
from collections import defaultdict
from typing import Any

import msgpack
import pytest
import torch

from peers.auth import RunAuth
from peers.state.download import IN_FLIGHT, PartsDownload
from peers.state.share import P2PStateClient, Snapshot, StateRefused, StateServer, part_size
from proto import ProtoError, encode_state_meta
from proto.state import decode_state_head, decode_state_part, decode_state_request, encode_state_request
from tests.test_datashare import nodes

ELEMENTS = 320_000  # 2 tensors × 1.28 MB: 10 parts of 256 KiB


def state(seed: int = 0, step: int = 7) -> tuple[bytes, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(ELEMENTS // 400, 400, generator=g), torch.randn(ELEMENTS, generator=g)]
    meta = encode_state_meta(
        {"outer_step": step, "global_sha256": f"{seed:064x}", "num_tensors": 2, "param_count": 1,
         "time": time.time(), "pending_tensors": 0}
    )  # fmt: skip
    return meta, tensors


class FakeDonors:
    """In-process donors serving snapshots as the real server lays them out; each may misbehave."""

    def __init__(
        self, served: dict[str, tuple[bytes, list[torch.Tensor]]], behaviour: dict[str, str]
    ) -> None:
        self.snapshots = {donor: Snapshot.of(*s) for donor, s in served.items()}
        self.behaviour = behaviour
        self.asked: dict[str, list[int]] = defaultdict(list)
        self.answers_left: dict[str, int] = {}  # "quits": parts it serves before it stops answering

    async def head(self, donor: str, timeout: float) -> dict[str, Any]:
        s = self.snapshots[donor]
        return {"meta": s.meta, "snapshot": s.id, "part_bytes": s.part_bytes, "total_bytes": s.total,
                "shapes": s.shapes(), "digests": s.hash_parts()}  # fmt: skip

    async def part(self, donor: str, snapshot: str, index: int, into: memoryview) -> None:
        self.asked[donor].append(index)
        data = b"".join(bytes(v) for v in self.snapshots[donor].pieces(index))
        await asyncio.sleep(0.01)  # every donor takes a moment, so all of them get parts
        how = self.behaviour.get(donor)
        if how == "slow":
            await asyncio.sleep(30)
        if how == "cut":
            into[: len(data) // 2] = data[: len(data) // 2]
            raise ConnectionResetError("stream cut")
        if how == "quits":
            left = self.answers_left.get(donor, 3)
            self.answers_left[donor] = left - 1
            if left <= 0:
                await asyncio.sleep(30)
        if how == "liar":
            data = bytes([data[0] ^ 1]) + data[1:]
        into[:] = data


def download(fake: FakeDonors, **kwargs: Any) -> PartsDownload:
    kwargs.setdefault("max_bytes", 10 * ELEMENTS * 4)
    kwargs.setdefault("min_part_timeout", 0.5)
    return PartsDownload(fake, **kwargs)


def same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_part_size_follows_the_state_size() -> None:
    assert part_size(7_200_000) == 256 << 10  # the tiny preset: ~28 parts
    assert part_size(8 << 30) == 64 << 20  # a 1B model's state: 128 parts
    assert part_size(0) == 256 << 10


def test_two_donors_share_the_parts_and_the_state_is_exact() -> None:
    meta, tensors = state()
    fake = FakeDonors({"a": (meta, tensors), "b": (meta, tensors)}, {})
    seen: list[dict[str, Any]] = []
    result = asyncio.run(download(fake, on_progress=seen.append).download(["a", "b"], timeout=30))
    assert result.ok and result.error is None and result.meta == meta
    assert same(result.tensors, tensors)
    assert set(result.parts_from) == {"a", "b"} and sum(result.parts_from.values()) == 10
    assert seen[-1]["parts_done"] == seen[-1]["parts_total"] == 10 and seen[-1]["bytes_done"] == 8 * ELEMENTS


def test_a_liar_is_named_and_its_parts_come_from_the_others() -> None:
    meta, tensors = state()
    fake = FakeDonors({d: (meta, tensors) for d in ("liar", "b", "c")}, {"liar": "liar"})
    result = asyncio.run(download(fake).download(["liar", "b", "c"], timeout=30))
    assert result.ok and same(result.tensors, tensors)
    assert [d for d, _ in result.liars] == ["liar"] and "digest" in result.liars[0][1]
    assert len(fake.asked["liar"]) <= IN_FLIGHT and "liar" not in result.parts_from  # one try, then never


def test_a_slow_donor_and_a_cut_stream_give_their_parts_back() -> None:
    meta, tensors = state()
    fake = FakeDonors({d: (meta, tensors) for d in ("slow", "cut", "ok")}, {"slow": "slow", "cut": "cut"})
    started = time.monotonic()
    result = asyncio.run(download(fake, max_failures=2).download(["slow", "cut", "ok"], timeout=5))
    assert result.ok and same(result.tensors, tensors) and not result.liars  # no lie: nothing banned
    assert result.parts_from == {"ok": 10}
    assert fake.asked["slow"] and len(fake.asked["cut"]) == IN_FLIGHT  # the cutter: dropped after its first
    assert time.monotonic() - started < 10


def test_a_cut_download_resumes_from_the_parts_it_kept() -> None:
    meta, tensors = state()
    fake = FakeDonors({"a": (meta, tensors)}, {"a": "quits"})  # 3 parts, then silence
    downloader = download(fake)
    first = asyncio.run(downloader.download(["a"], timeout=2))
    assert not first.ok and "3 of 10 parts" in (first.error or "")
    asked_before = len(fake.asked["a"])
    fake.behaviour = {}
    second = asyncio.run(downloader.download(["a"], timeout=30))
    assert second.ok and second.resumed == 3 and same(second.tensors, tensors)
    assert sorted(fake.asked["a"][asked_before:]) == list(range(3, 10))  # only the missing parts


def test_a_resume_keeps_nothing_of_another_state() -> None:
    meta, tensors = state(seed=1)
    fake = FakeDonors({"a": (meta, tensors)}, {"a": "quits"})
    downloader = download(fake)
    assert not asyncio.run(downloader.download(["a"], timeout=2)).ok
    meta2, tensors2 = state(seed=2)  # the run moved on: every part differs
    fake2 = FakeDonors({"a": (meta2, tensors2)}, {})
    downloader.transport = fake2
    result = asyncio.run(downloader.download(["a"], timeout=30))
    assert result.ok and result.resumed == 0 and same(result.tensors, tensors2)


def test_donors_of_another_state_are_not_asked_and_a_tie_downloads_nothing() -> None:
    meta, tensors = state(seed=1)
    other = state(seed=2)
    fake = FakeDonors({"a": (meta, tensors), "b": (meta, tensors), "odd": other}, {})
    result = asyncio.run(download(fake).download(["a", "b", "odd"], timeout=30))
    assert result.ok and same(result.tensors, tensors) and "odd" not in fake.asked and not result.liars
    tie = FakeDonors({"a": (meta, tensors), "odd": other}, {})
    result = asyncio.run(download(tie).download(["a", "odd"], timeout=30))
    assert not result.ok and "do not agree" in (result.error or "") and not tie.asked


def test_of_two_donors_a_round_apart_the_newer_state_is_downloaded() -> None:
    older, newer = state(seed=1, step=6), state(seed=2, step=7)
    fake = FakeDonors({"behind": older, "ahead": newer}, {})
    result = asyncio.run(download(fake).download(["behind", "ahead"], timeout=30))
    assert result.ok and same(result.tensors, newer[1]) and result.donors == ["ahead"]
    assert "behind" not in fake.asked and set(result.outvoted) == {"behind"}


def test_a_donor_declaring_more_than_our_model_holds_is_not_asked() -> None:
    meta, tensors = state()
    fake = FakeDonors({"a": (meta, tensors)}, {})
    result = asyncio.run(download(fake, max_bytes=1000).download(["a"], timeout=30))
    assert not result.ok and result.error == "no donor described its state" and not fake.asked


# ---- the wire ----------------------------------------------------------------------------------------------


def test_requests_and_heads_are_strictly_checked() -> None:
    with pytest.raises(ProtoError, match="needs both snapshot and index"):
        encode_state_request({"kind": "part", "proof": b"", "index": 1})
    with pytest.raises(ProtoError, match="carries no snapshot"):
        decode_state_request(
            msgpack.packb({"_s": "dilocod.state.request", "_v": 1, "kind": "head", "proof": b"", "index": 0})
        )
    meta, tensors = state()
    s = Snapshot.of(meta, tensors)
    head = {"meta": meta, "snapshot": s.id, "part_bytes": s.part_bytes, "total_bytes": s.total,
            "shapes": s.shapes(), "digests": s.hash_parts()}  # fmt: skip
    from proto.state import encode_state_head

    assert decode_state_head(encode_state_head(head))["digests"] == head["digests"]
    for bad, problem in (
        ({**head, "total_bytes": s.total + 4}, "shapes hold"),
        ({**head, "digests": head["digests"][:-1]}, "9 digests for 10 parts"),
        ({**head, "shapes": ["12x-1", *head["shapes"][1:]]}, "bad shape"),
        ({**head, "error": "busy"}, "carries nothing else"),
    ):
        with pytest.raises(ProtoError, match=problem):
            encode_state_head(bad)
    with pytest.raises(ProtoError):
        decode_state_part(b"\x80")


def test_hostile_bytes_only_ever_raise_proto_error() -> None:
    rng = random.Random(3)
    for _ in range(300):
        data = rng.randbytes(rng.randrange(0, 64))
        for decode in (decode_state_request, decode_state_head, decode_state_part):
            with contextlib.suppress(ProtoError):
                decode(data)


def test_two_real_donors_serve_parts_over_p2pd_and_hold_a_snapshot_a_joiner_downloads() -> None:
    async def main() -> None:
        auth = RunAuth(secret=b"k" * 32)
        async with nodes(3) as (joiner, a, b):
            current = {"a": state(step=7), "b": state(step=7)}
            servers = {}
            for name, p2p in (("a", a), ("b", b)):
                servers[name] = StateServer(lambda name=name: current[name], auth)
                await p2p.add_binary_stream_handler("/dilocod/state/1.0.0", servers[name].handle)
            proof = auth.member_proof(joiner.peer_id.to_bytes())
            client = P2PStateClient(joiner, proof)
            donors = [a.peer_id.to_base58(), b.peer_id.to_base58()]
            result = await PartsDownload(client, max_bytes=10 * ELEMENTS * 4).download(donors, timeout=60)
            assert result.ok and same(result.tensors, state()[1]) and set(result.parts_from) == {*donors}
            assert servers["a"].parts_served + servers["b"].parts_served == 10
            # a donor that moves on still serves the snapshot a joiner began on
            head = await client.head(donors[0], 10)
            current["a"] = state(seed=9, step=8)
            assert (await client.head(donors[0], 10))["snapshot"] != head["snapshot"]
            view = memoryview(bytearray(head["part_bytes"]))
            await client.part(donors[0], head["snapshot"], 0, view)
            assert hashlib.sha256(view).hexdigest() == head["digests"][0]
            stranger = P2PStateClient(joiner, b"\x00" * 32)  # a wrong proof: refused by name
            with pytest.raises(StateRefused, match="not a member"):
                await stranger.head(donors[1], 10)
            view = memoryview(bytearray(head["part_bytes"]))
            with pytest.raises(StateRefused, match="unknown snapshot"):
                await client.part(donors[1], "f" * 64, 0, view)

    asyncio.run(main())
