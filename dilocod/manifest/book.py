"""The run's manifests in the DHT: ours published under `<run>.manifest` (subkey: our peer id), and the
others' read back when we must say how another manifest differs from ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from dilocod.manifest.record import Manifest, ManifestError, decode, differing_keys
from peers.node import Node

log = logging.getLogger("dilocod.manifest")

MANIFEST_KEY = "manifest"
PUBLISH_TTL = 600.0  # republished every third of it: a node that is gone leaves no manifest for long


class ManifestBook:
    def __init__(self, node: Node, ours: Manifest) -> None:
        self.node, self.ours = node, ours
        self._blob = ours.encode()
        self._differences: dict[str, tuple[str, ...]] = {}

    def blob(self) -> bytes:
        """Our manifest as served over p2p (the signed record)."""
        return self._blob

    async def keep_published(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            try:
                await self.node.publish(MANIFEST_KEY, self._blob, ttl=PUBLISH_TTL)
            except Exception as e:  # a DHT hiccup: the next try is a third of the TTL away
                log.debug("publishing our manifest failed: %r", e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), PUBLISH_TTL / 3)

    async def differences(self, manifest_hash: str) -> tuple[str, ...]:
        """The keys on which the run's manifest with this hash differs from ours (() when none of the
        run's nodes publishes it)."""
        if manifest_hash in self._differences:
            return self._differences[manifest_hash]
        try:
            blobs = await self.node.read_all(MANIFEST_KEY)
        except Exception as e:
            log.debug("reading the run's manifests failed: %r", e)
            return ()
        for blob in blobs.values():
            if not isinstance(blob, bytes):
                continue
            with contextlib.suppress(ManifestError):
                other = decode(blob)
                if other.hash == manifest_hash:
                    found = tuple(differing_keys(self.ours, other))
                    self._differences[manifest_hash] = found
                    return found
        return ()
