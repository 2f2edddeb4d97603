"""The run as seen from the DHT: every live peer's latest status record, validated."""

from __future__ import annotations

from typing import Any

from dilocod.history import RunHistory
from dilocod.metrics import Metrics
from peers.node import Node
from proto import ProtoError, decode_status

STATUS_KEY = "status"


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
