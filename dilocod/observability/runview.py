"""The run as seen from the DHT: every live peer's latest status record, validated."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection
from typing import Any, Protocol

from dilocod.observability.history import RunHistory
from dilocod.observability.metrics import Metrics
from peers.node import Node
from proto import ProtoError, decode_status

STATUS_KEY = "status"


class ManifestDifferences(Protocol):
    """What a view needs of the run's manifests (`dilocod.manifest.book.ManifestBook`, passed in: the
    manifest package sits above this one)."""

    async def differences(self, manifest_hash: str) -> tuple[str, ...]: ...


async def read_run(
    node: Node, metrics: Metrics | None = None, history: RunHistory | None = None, key: str = STATUS_KEY
) -> list[dict[str, Any]]:
    """Valid status records of this run, one per peer, sorted by peer id.

    A record that does not decode, belongs to another run, or is stored under another peer's subkey
    (one peer speaking for another) is dropped and counted, never raised. What is read updates the
    run-wide gauges of `metrics` and is added to `history` (the dashboard's charts).
    """
    raw = await node.read_all(key)
    records = []
    for subkey, value in raw.items():
        try:
            record = decode_status(value)
        except ProtoError:
            record = None
        if record is None or record["run_id"] != node.options.run_id or record["peer_id"] != subkey:
            if metrics is not None:
                metrics.invalid_records.inc()
            continue
        records.append(record)
    records.sort(key=lambda r: r["peer_id"])
    if metrics is not None:
        metrics.observe_run(records)
    if history is not None:
        history.observe(records)
    return records


HELPERS_KEY = "helpers"


def newest_sample(records: list[dict[str, Any]], prompt: str) -> dict[str, Any] | None:
    """The completion of the run's prompt from the newest θ_global any peer sampled (`trainer.sample_every`),
    with the outer step it came from, who wrote it, and how many peers wrote the same text at that step (they
    hold the same θ_global, and sampling is greedy); None before the first."""
    sampled = [r for r in records if r.get("sample") is not None and r.get("sample_step") is not None]
    if not sampled:
        return None
    step = max(r["sample_step"] for r in sampled)
    at_step = [r for r in sampled if r["sample_step"] == step]
    texts = [r["sample"] for r in at_step]
    text = max(texts, key=texts.count)  # the text most peers wrote there
    writer = next(r for r in at_step if r["sample"] == text)
    return {"prompt": prompt, "text": text, "outer_step": step, "peer_id": writer["peer_id"],
            "peers_agreeing": texts.count(text), "peers_sampled": len(texts)}  # fmt: skip


def flag_manifests(records: list[dict[str, Any]], ours: str | None) -> list[dict[str, Any]]:
    """Each record with `other_manifest`: true when its node runs another manifest than `ours` (it can
    never average with us; a record without a hash is from a dilocod too old to say)."""
    return [{**r, "other_manifest": ours is not None and r.get("manifest_hash") != ours} for r in records]


class NodeRunView:
    """The round driver's `RunView` port: the run's records through our DHT node.

    The round clock reads the records several times a second near a round's close, and several parts
    of the peer read them at once; reads within `max_age` seconds share one DHT lookup.

    Peers we ban (`excluded`) are not part of the run as we see it: their tokens never reach our
    θ_global (a banned member weighs 0), so counting them would close our rounds early, and their
    records get no say in which step the run is at.
    """

    def __init__(
        self,
        node: Node,
        metrics: Metrics | None = None,
        max_age: float = 0.1,
        excluded: Callable[[], Collection[str]] = tuple,
        manifests: ManifestDifferences | None = None,
    ) -> None:
        self.node, self.metrics, self.max_age, self.excluded = node, metrics, max_age, excluded
        self.manifests = manifests
        self._cache: dict[str, tuple[float, list[dict[str, Any]]]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def records(self) -> list[dict[str, Any]]:
        return self._without_excluded(await self._read(STATUS_KEY))

    async def helpers(self) -> list[dict[str, Any]]:
        return self._without_excluded(await self._read(HELPERS_KEY))

    async def manifest_differences(self, manifest_hash: str) -> tuple[str, ...]:
        return () if self.manifests is None else await self.manifests.differences(manifest_hash)

    def _without_excluded(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        excluded = set(self.excluded())
        return [r for r in records if r["peer_id"] not in excluded] if excluded else records

    async def _read(self, key: str) -> list[dict[str, Any]]:
        async with self._locks.setdefault(key, asyncio.Lock()):
            cached = self._cache.get(key)
            if cached is not None and time.monotonic() - cached[0] < self.max_age:
                return cached[1]
            records = await read_run(self.node, self.metrics if key == STATUS_KEY else None, key=key)
            self._cache[key] = (time.monotonic(), records)
            return records
