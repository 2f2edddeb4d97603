"""What the simulation cannot run for real, modelled from the formulas the project's code and docs give.

- **All-reduce bytes** (docs/protocol.md, "Pseudo-gradient payloads"; peers/linkbudget.py): every sender
  sends each reducer that reducer's share of its Δ and gets the average of it back, so a member that reduces
  a share s of the vector moves (1 − s)·|Δ| each way as a sender and (senders − 1)·s·|Δ| each way as a
  reducer. With n members reducing equal shares that is linkbudget's 2(n − 1)/n·|Δ|; a private member
  (s = 0) moves |Δ| each way. Shares are the daemon's: `peers.grouping.reducer_bandwidths` (trusted
  trainers up to `group_size`, every auxiliary reducer) and `share_by_bandwidth`. With `topk` the reducers
  relay: a member receives the n − 1 other payloads (docs: "n − 1 payloads a member").
- **All-reduce seconds**: the slowest member's bytes over its link, both directions at once, plus each
  reducer's CPU at linkbudget's CPU_SECONDS_PER_ELEMENT for every value it reduces (its share × the
  senders), plus a round trip per phase.
- **DHT operations** (hivemind's Kademlia): a lookup takes ⌈log2 N⌉ hops at the median round trip; a store
  then writes to NUM_REPLICAS nodes; a read of a run key (`peers.node.Node.read_all`, `latest=True`) gets
  the whole subkey dictionary from each replica that holds it.
- **Message sizes** from the project's own encoders where one exists (status records, chunk requests and
  replies), with the signed envelope of docs/protocol.md ("DHT record envelope": an RSA-2048 public key and
  signature).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from hivemind.averaging.allreduce import AveragingMode

from dilocod.data.shards import shard_dtype
from peers.grouping import reducer_bandwidths, share_by_bandwidth
from peers.linkbudget import CPU_SECONDS_PER_ELEMENT
from proto.chunks import encode_chunk_reply, encode_chunk_request
from proto.records import MANIFEST, encode_status

NUM_REPLICAS = 5  # hivemind.dht.node.DHTNode's default num_replicas
ENVELOPE_BYTES = 294 + 256 + 16  # RSA-2048 public key (DER) + signature + msgpack framing
DHT_MESSAGE_BYTES = 200  # a find/store request or a reply without values: ids, addresses, framing (a guess)
MANIFEST_BYTES = MANIFEST.max_bytes  # the schema's bound: a manifest is at most this


@dataclass(frozen=True)
class Member:
    """A member of a group as the all-reduce sees it."""

    peer_id: str
    mode: AveragingMode
    up: float  # bytes/s
    down: float
    rtt: float


@dataclass(frozen=True)
class Exchange:
    """One group's all-reduce: its length and each member's bytes (sent, received)."""

    seconds: float
    transfer_seconds: float
    cpu_seconds: float
    traffic: dict[str, tuple[float, float]]
    reducers: tuple[str, ...]  # members that reduce a share, in the group's order


def reducer_shares(members: Sequence[Member], max_trainers: int, elements: int) -> list[float]:
    """Each member's share of the vector it reduces (0.0: none), as the daemon computes it: every member is
    trusted here and states no bandwidth (the daemon's default), so reducers get equal shares."""
    bandwidths = reducer_bandwidths(
        [None] * len(members), [m.mode for m in members], [True] * len(members), max_trainers
    )
    counts = share_by_bandwidth(max(elements, len(members)), bandwidths)
    total = sum(counts)
    return [c / total for c in counts]


def all_reduce(
    members: Sequence[Member], delta_bytes: float, elements: int, max_trainers: int, topk: bool
) -> Exchange:
    shares = reducer_shares(members, max_trainers, elements)
    senders = sum(m.mode != AveragingMode.AUX for m in members)
    traffic: dict[str, tuple[float, float]] = {}
    transfer = cpu = 0.0
    for member, share in zip(members, shares, strict=True):
        sends = member.mode != AveragingMode.AUX
        others = senders - int(sends)
        as_sender = (1.0 - share) * delta_bytes if sends else 0.0
        if topk:
            up = as_sender + share * others * max(0, senders - 1) * delta_bytes
            down = (senders - 1) * delta_bytes * (1.0 - share) + share * others * delta_bytes
        else:
            up = down = as_sender + others * share * delta_bytes
        traffic[member.peer_id] = (up, down)
        transfer = max(transfer, up / member.up, down / member.down)
        cpu = max(cpu, share * senders * elements * CPU_SECONDS_PER_ELEMENT)
    latency = 2 * max((m.rtt for m in members), default=0.0)
    reducers = tuple(m.peer_id for m, s in zip(members, shares, strict=True) if s > 0)
    return Exchange(transfer + cpu + latency, transfer, cpu, traffic, reducers)


def hops(peers: int) -> int:
    """DHT hops of one lookup among `peers` nodes."""
    return max(1, math.ceil(math.log2(max(2, peers))))


def lookup_seconds(peers: int, rtt: float) -> float:
    return hops(peers) * rtt


def store_messages(peers: int) -> int:
    return hops(peers) + NUM_REPLICAS


def read_messages(peers: int) -> int:
    return hops(peers) + NUM_REPLICAS


def read_bytes(peers: int, records: int, record_bytes: int) -> float:
    """Bytes a reader receives for one read of a run key holding `records` subkeys."""
    return read_messages(peers) * DHT_MESSAGE_BYTES + NUM_REPLICAS * records * record_bytes


def store_bytes(peers: int, record_bytes: int) -> float:
    return store_messages(peers) * DHT_MESSAGE_BYTES + NUM_REPLICAS * record_bytes


def status_record_bytes() -> int:
    """A trainer's signed status record as the DHT stores it: a typical record through the project's encoder,
    plus the envelope."""
    record = {
        "peer_id": "12D3KooW" + "x" * 44, "run_id": "dilocod", "role": "peer", "reachability": "public",
        "outer_step": 1234, "inner_step": 617000, "loss": 3.25, "eval_loss": 3.3,
        "tokens_per_second": 162496.0, "global_sha256": "ab" * 32, "group_size": 16, "alone": False,
        "last_round_seconds": 112.5, "rounds_ok": 1200, "rounds_failed": 3, "time": 1.7e9, "version": "0.1.0",
        "maddrs": ["/ip4/203.0.113.5/tcp/31337", "/ip4/203.0.113.5/udp/31337/quic"],
        "rejected_contributions": 0, "bans": 0, "bytes_sent": 10**11, "bytes_received": 10**11,
        "compute_utilization": 0.93, "relayed": False, "round_steps": 500, "round": 1234,
        "round_tokens": 8_000_000, "round_opened": 1.7e9, "reference_tokens": 16_384_000,
        "tokens_trained": 2 * 10**10, "tokens_contributed": 2 * 10**10, "contributing": True,
        "settings_hash": "0123456789abcdef", "training": True, "manifest_hash": "cd" * 32,
        "eval_bits_per_byte": 1.25,
    }  # fmt: skip
    return len(encode_status(record)) + ENVELOPE_BYTES


@functools.cache
def chunk_message_bytes(held: int, granted: int) -> tuple[int, int]:
    """(request, reply) bytes of one chunk sync holding `held` leases, through the project's encoders."""
    request = encode_chunk_request({"held": [3, 123_456, 2**19] * held, "want": 2})
    lease = [3, 123_456, 123_456 * 2**20, 2**20, 2**19]
    reply = encode_chunk_reply({
        "leases": lease * granted, "lease_seconds": 300.0, "epoch": 3, "epoch_fraction": 0.5,
        "tokens_trained": 10**10, "chunks_trained": 10**4, "chunks_total": 10**4,
    })  # fmt: skip
    return len(request), len(reply)


def bytes_per_token(vocab_size: int) -> int:
    """A training shard's bytes per token (dilocod/data/shards.py)."""
    return 2 if shard_dtype(vocab_size) == "uint16" else 4
