"""The concrete wire messages of dilocod (STATUS at version 10, ROUND_TICKET at 4, STATE_META at 2,
MANIFEST at 1).

See docs/protocol.md for the protocol these messages belong to.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proto.schema import Field, ProtoError, Schema, decode, encode

_SHA256 = Field("global_sha256", "hex", min=64, max=64)

STATUS = Schema(
    name="dilocod.status",
    version=10,
    max_bytes=4096,
    fields=(
        Field("peer_id", "str", min=1, max=128),
        Field("run_id", "str", min=1, max=64),
        Field("role", "str", choices=("peer", "bootstrap", "helper")),
        Field("reachability", "str", choices=("public", "private", "unknown")),
        Field("outer_step", "int", min=0),
        Field("inner_step", "int", min=0),
        Field("loss", "float", optional=True, allow_nan=True),
        Field("eval_loss", "float", optional=True, allow_nan=True),
        Field("tokens_per_second", "float", min=0),
        _SHA256,
        Field("group_size", "int", min=0, max=4096),
        Field("alone", "bool"),
        Field("last_round_seconds", "float", optional=True, min=0),
        Field("rounds_ok", "int", min=0),
        Field("rounds_failed", "int", min=0),
        Field("time", "float", min=0),
        Field("version", "str", min=1, max=32),
        Field("maddrs", "list_str", max=16, item_max=256),
        # v2: trust counters, so a run-wide view shows who is rejecting whom.
        Field("rejected_contributions", "int", optional=True, min=0),
        Field("bans", "int", optional=True, min=0, max=100_000),
        # v2: bytes on the wire, for the run-wide view of communication cost.
        Field("bytes_sent", "int", optional=True, min=0),
        Field("bytes_received", "int", optional=True, min=0),
        # v3: share of wall time spent in inner steps, since the sender started training.
        Field("compute_utilization", "float", optional=True, min=0, max=1),
        # v4: whether the sender's pseudo-gradients go through a relay or public reducer.
        Field("relayed", "bool", optional=True),
        # v5: inner steps into the current round, so a peer that re-synced can join the round in step.
        Field("round_steps", "int", optional=True, min=0),
        # v6: the run's round clock (dilocod/rounds/clock.py) and what reached θ_global.
        Field("round", "int", optional=True, min=0),
        Field("round_tokens", "int", optional=True, min=0),
        Field("round_opened", "float", optional=True, min=0),
        Field("reference_tokens", "int", optional=True, min=0),
        Field("tokens_trained", "int", optional=True, min=0),
        Field("tokens_contributed", "int", optional=True, min=0),
        Field("contributing", "bool", optional=True),
        Field("settings_hash", "hex", optional=True, min=16, max=16),
        Field("training", "bool", optional=True),
        # v7: the run manifest the sender runs with (dilocod/manifest/): peers of other manifests are flagged.
        Field("manifest_hash", "hex", optional=True, min=64, max=64),
        # v8: a peer downloading the run's state says which round it will train, so the run's clock waits.
        Field("joining", "int", optional=True, min=0),
        Field("joining_since", "float", optional=True, min=0),
        # v9: eval loss in bits per byte of text (comparable between tokenizers).
        Field("eval_bits_per_byte", "float", optional=True, allow_nan=True),
        # v10: a greedy completion of the run's prompt from θ_global, and the outer step it came from.
        Field("sample", "str", optional=True, max=200),
        Field("sample_step", "int", optional=True, min=0),
    ),
)
"""A peer's status, published by every daemon in the DHT every few seconds.

Read by other peers (to see who is alive, ahead, or diverged) and by monitoring tools. It is
advisory: anything a peer claims here can be a lie, so decisions that matter for training are made
on data checked later (the round ticket, the state download's hash), never on this record alone.

- peer_id: the libp2p peer id of the sender, so readers can dial it and dedupe records.
- run_id: the training run; records of other runs sharing the DHT are ignored.
- role: what the sender does in the run: a training "peer", a "bootstrap" node, or a "helper".
- reachability: whether others can dial the sender directly ("private" needs a relay).
- outer_step / inner_step: progress; outer steps are DiLoCo rounds, inner steps local optimizer steps.
- loss / eval_loss: latest training / evaluation loss; absent before the first value, NaN if it diverged.
- tokens_per_second: local throughput, used to size groups and shown in the UI.
- global_sha256: hash of the sender's global (outer) parameters, to spot peers that drifted apart.
- group_size: members in the sender's last averaging group (0 if none yet).
- alone: true when the sender's last round found no partner and it applied its own update.
- last_round_seconds: wall time of the last averaging round; absent before the first.
- rounds_ok / rounds_failed: counts of averaging rounds that completed / failed.
- time: sender's unix time when the record was made, so readers can drop stale records.
- version: dilocod software version of the sender.
- maddrs: multiaddresses the sender listens on.
- rejected_contributions (v2): contributions the sender dropped (screened or from a lying reducer).
- bans (v2): peers the sender currently bans.
- bytes_sent / bytes_received (v2): tensor payload bytes the sender sent / received since it started.
- compute_utilization (v3): time in inner steps ÷ wall time since the sender started training (0–1).
- relayed (v4): true when the sender's pseudo-gradients reach the others through a relay or a public
  reducer rather than over direct connections (a private peer in client mode, or over circuit relay).
- eval_bits_per_byte (v9): the eval loss as bits per UTF-8 byte of the eval text, so runs with other
  tokenizers compare.
- sample / sample_step (v10): the sender's latest greedy completion of the run's `trainer.sample_prompt`
  (at most 200 characters) and the outer step of the θ_global that wrote it; shown on the dashboard.
- settings_hash (v6): superseded by manifest_hash; still accepted from v6 senders.
- manifest_hash (v7): sha256 of the run manifest the sender runs with (see MANIFEST).
- joining / joining_since (v8): set while the sender downloads the run's state (it restarted, or the run
  closed a round without it): the round it will train with that state, and the unix time the download
  began. Its round stays open for it (the others train on) until the record no longer says so, at most
  `averaging.state_timeout` after joining_since (dilocod/rounds/clock.py).
- round_steps (v5): inner steps the sender took since its θ_global last changed (its place in the
  current round); a peer that just re-synced trains only the rest of the round, so it reaches the
  next matchmaking with the others instead of one re-sync's duration late.
"""

TICKET_SEGMENTS = 32  # chunk parts a ticket names at most (a round usually trains one or two)

ROUND_TICKET = Schema(
    name="dilocod.ticket",
    version=5,
    # v3 weights each contribution by its tokens: a v2 ticket has none, and weighing it 1 would misread it.
    # v4 names the run manifest: a v3 sender cannot say which settings its contribution was made under.
    min_version=4,
    max_bytes=4096,
    fields=(
        Field("outer_step", "int", min=0),
        _SHA256,
        Field("num_params", "int", min=0),
        Field("role", "str", choices=("peer", "helper")),
        # v2: the peers the sender bans (bounded). A member banned by most contributors gets weight 0.
        Field("bans", "list_str", optional=True, max=32, item_max=128),
        # v3: what the contribution covers, for its weight (peers/membership.py caps the claim).
        Field("tokens", "int", min=0, max=2**53),
        Field("tokens_per_second", "float", min=0, max=1e12),
        Field("train_seconds", "float", min=0, max=1e9),
        # v4: the run manifest the sender runs with; members of another manifest never count.
        Field("manifest_hash", "hex", min=64, max=64),
        # v5: where the tokens came from, (epoch, chunk, lo, hi) per trained part of a chunk, flattened.
        Field("chunks", "list_int", optional=True, max=4 * TICKET_SEGMENTS, item_max=2**53),
    ),
)
"""Sent by each member of a forming averaging group to all the others (all-gather) during matchmaking.

Every member sees the same set of tickets and applies the same deterministic rule to them, so all
members decide the same way (who averages with whom) without another round of messages.

- outer_step: the round the sender is about to average; members at different steps must not mix.
- global_sha256: hash of the sender's global parameters; members must start from identical weights.
- num_params: the sender's parameter count; compared for equality, a cheap check that all members
  train the same model.
- role: "peer" for a training member, "helper" for a member that only helps with averaging.
- bans (v2): peer ids the sender bans; the group drops a member that most contributors ban.
- tokens (v3): tokens of inner steps behind the pseudo-gradient the sender is about to send, measured
  from the group's θ_global (progress carried from rounds that were not applied counts too). The
  contribution's weight; 0 for a helper.
- tokens_per_second (v3): the sender's own throughput (as in its status records).
- train_seconds (v3): seconds of training behind those tokens. With tokens_per_second it bounds what an
  honest claim can be (docs/trust.md: a claim is clamped to 2 × the median of the others' claims and to
  1.25 × tokens_per_second × its train_seconds, the latter at most twice the group's median).

- manifest_hash (v4): sha256 of the sender's run manifest (MANIFEST). Only members that share the
  group's majority manifest, step and θ hash are weighed; matchmaking keys carry the hash too, so peers
  of different manifests do not even meet (`peers/grouping.py`).

- chunks (v5): the parts of the run's chunks (dilocod/data/schedule.py) the tokens came from, as
  (epoch, chunk, lo, hi) groups of token offsets within each chunk, at most TICKET_SEGMENTS of them.
  Absent when the sender trains without a schedule. What a later check of the work builds on.

Version 4 is the oldest accepted: a v3 ticket names no manifest and is refused (its sender gets weight 0,
and its group key differs anyway, see `peers/averager.py`).
"""

STATE_META = Schema(
    name="dilocod.state",
    version=2,
    max_bytes=2048,
    fields=(
        Field("outer_step", "int", min=0),
        _SHA256,
        Field("num_tensors", "int", min=0, max=100_000),
        Field("param_count", "int", min=0, max=2**40),
        Field("time", "float", min=0),
        Field("pending_tensors", "int", optional=True, min=0, max=100_000),
    ),
)
"""Metadata sent first by a peer serving a state download to a peer that joins or fell behind.

The receiver uses it to know what it is about to get and to check it once the tensors arrived.

- outer_step: the round the state belongs to; the joiner resumes from there.
- global_sha256: hash of the global parameters, checked by the receiver after loading them.
- num_tensors: how many tensors follow (parameters then optimizer buffers), to bound the download.
- param_count: how many of those tensors are parameters; the rest are outer-optimizer buffers.
- time: sender's unix time when the snapshot was taken.
- pending_tensors (v2): with `outer.overlap` delayed or streaming, how many of the tensors, after the
  parameters and optimizer buffers, are the average of the round the sender has in flight at
  outer_step (every tensor, or its fragment's with streaming; 0 or absent: none completed yet). A joiner
  applies it at its next close, as the sender does, instead of missing that round's group
  (docs/architecture.md, "A joiner with overlap takes the round in flight"). A v1 record has none.
"""


MANIFEST = Schema(
    name="dilocod.manifest",
    version=1,
    max_bytes=16384,
    fields=(
        Field("run_id", "str", min=1, max=64),
        Field("serial", "int", min=1, max=2**31),
        Field("settings", "str", min=2, max=12000),
        Field("key_required", "bool"),
        Field("issued", "float", min=0),
        Field("signer", "str", min=1, max=128),
        Field("public_key", "bytes", min=1, max=2048),
        Field("signature", "bytes", min=1, max=1024),
    ),
)
"""The run's manifest: the settings every participant shares, signed by the node that issued it (the run's
bootstrap, or the first peer of a run started without one). Served by every full node over p2p
(`peers/runinfo.py`), at a bootstrap's `GET /api/run/manifest`, and stored in the DHT under
`<run>.manifest` (subkey: the publishing node).

- run_id: the run these settings belong to; a node adopting the manifest takes its run id from here.
- serial: the manifest's revision (1 for a run's first). A run changes its settings as a new run id.
- settings: canonical JSON (sorted keys, no spaces) of {section: {key: value}} for every run-wide
  config key (`dilocod/manifest/keys.py`).
- key_required: whether the run needs a run key (`run.key`); the key itself is never in the manifest.
- issued: the issuer's unix time when it was made.
- signer: base58 peer id of the issuer; public_key (DER, RSA) must hash to it.
- signature: RSA PKCS#1 v1.5 / SHA-256 by the signer over every other field (`dilocod/manifest/record.py`).

manifest_hash = sha256 over the canonical JSON of (run_id, serial, settings, key_required): the content,
not who signed it or when, so a bootstrap restarted without its identity that issues the same settings
leaves the run's hash unchanged.
"""


def encode_status(record: Mapping[str, Any]) -> bytes:
    return encode(STATUS, record)


def decode_status(data: bytes) -> dict[str, Any]:
    return decode(STATUS, data)


def encode_ticket(record: Mapping[str, Any]) -> bytes:
    _check_segments(record.get("chunks"))
    return encode(ROUND_TICKET, record)


def decode_ticket(data: bytes) -> dict[str, Any]:
    record = decode(ROUND_TICKET, data)
    _check_segments(record.get("chunks"))
    return record


def _check_segments(chunks: object) -> None:
    """A ticket's `chunks` is (epoch, chunk, lo, hi) groups, each with lo < hi."""
    if not isinstance(chunks, list | tuple):
        return  # absent, or the schema names the wrong type
    where = f"{ROUND_TICKET.name} v{ROUND_TICKET.version}: field 'chunks'"
    if len(chunks) % 4:
        raise ProtoError(f"{where}: {len(chunks)} items, not groups of 4")
    for i in range(0, len(chunks), 4):
        lo, hi = chunks[i + 2], chunks[i + 3]
        if isinstance(lo, int) and isinstance(hi, int) and not lo < hi:
            raise ProtoError(f"{where}: part {i // 4} has lo {lo} >= hi {hi}")


def encode_state_meta(record: Mapping[str, Any]) -> bytes:
    return encode(STATE_META, record)


def decode_state_meta(data: bytes) -> dict[str, Any]:
    return decode(STATE_META, data)


def encode_manifest(record: Mapping[str, Any]) -> bytes:
    return encode(MANIFEST, record)


def decode_manifest(data: bytes) -> dict[str, Any]:
    return decode(MANIFEST, data)
