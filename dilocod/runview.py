"""The run as seen from the DHT: every live peer's latest status record, validated."""

from __future__ import annotations

from typing import Any

from dilocod.metrics import Metrics
from peers.node import Node
from proto import ProtoError, decode_status

STATUS_KEY = "status"


async def read_run(node: Node, metrics: Metrics | None = None) -> list[dict[str, Any]]:
    """Valid status records of this run, one per peer, sorted by peer id.

    A record that does not decode, belongs to another run, or is stored under another peer's subkey
    (one peer speaking for another) is dropped and counted, never raised.
    """
    raw = await node.read_all(STATUS_KEY)
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
    return sorted(records, key=lambda r: r["peer_id"])
