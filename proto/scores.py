"""The scores a peer published (`<run>.scores` in the DHT, one record per scorer, like the status record):
its verdicts on the contributions it was assigned to score (dilocod/trust/scoring.py). Every peer reads all
of them and folds the verdicts it can check into the same per-peer ratings. See docs/protocol.md."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proto.schema import Field, ProtoError, Schema, decode, encode

MAX_VERDICTS = 16  # the scorer's latest: a reader that reads every round sees each one several times

SCORES = Schema(
    name="dilocod.scores",
    version=1,
    max_bytes=4096,
    fields=(
        Field("peer_id", "str", min=1, max=128),
        Field("run_id", "str", min=1, max=64),
        Field("time", "float", min=0),
        Field("steps", "list_int", max=MAX_VERDICTS, item_max=2**53),
        Field("targets", "list_str", max=MAX_VERDICTS, item_max=128),
        Field("passed", "list_int", max=MAX_VERDICTS, item_max=1),
    ),
)
"""- peer_id / run_id / time: the scorer (the record's subkey must be it), its run, when it was made.
- steps, targets, passed: parallel lists, one verdict each: the outer step whose Δ was scored (measured
  from θ_global at that step), the contributor, and 1 when the Δ passed (dilocod/trust/scoring.py `score`).
"""


def encode_scores(record: Mapping[str, Any]) -> bytes:
    _check(record)
    return encode(SCORES, record)


def decode_scores(data: bytes) -> dict[str, Any]:
    record = decode(SCORES, data)
    _check(record)
    return record


def _check(record: Mapping[str, Any]) -> None:
    lengths = {len(record.get(k) or ()) for k in ("steps", "targets", "passed")}
    if len(lengths) != 1:
        raise ProtoError(f"{SCORES.name} v{SCORES.version}: steps, targets and passed differ in length")
