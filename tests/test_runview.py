"""The round driver's view of the run (dilocod/observability/runview.py) on a fake DHT node: invalid
records are dropped, and peers we ban are not part of the run as we see it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from dilocod.observability.peerstate import NodeFacts, PeerState
from dilocod.observability.runview import NodeRunView
from proto import encode_status


class FakeNode:
    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values
        self.options = SimpleNamespace(run_id="run")
        self.reads = 0

    async def read_all(self, name: str) -> dict[str, Any]:
        self.reads += 1
        return dict(self.values)


def record(peer_id: str, run_id: str = "run") -> bytes:
    return encode_status(PeerState(NodeFacts(peer_id=peer_id, run_id=run_id)).record())


def test_banned_peers_are_left_out_of_the_run_we_see() -> None:
    node = FakeNode(
        {
            "a": record("a"),
            "b": record("b"),
            "liar": record("liar"),
            "c": record("c", "another"),
            "d": b"junk",
        }
    )
    banned: list[str] = []
    view = NodeRunView(node, max_age=0.0, excluded=lambda: banned)  # type: ignore[arg-type]
    assert [r["peer_id"] for r in asyncio.run(view.records())] == ["a", "b", "liar"]
    banned.append("liar")  # a ban takes effect at the next read, cached or not
    assert [r["peer_id"] for r in asyncio.run(view.records())] == ["a", "b"]


def test_reads_within_max_age_share_one_lookup() -> None:
    node = FakeNode({"a": record("a")})
    view = NodeRunView(node, max_age=60.0)  # type: ignore[arg-type]

    async def twice() -> None:
        await asyncio.gather(view.records(), view.records())

    asyncio.run(twice())
    assert node.reads == 1
