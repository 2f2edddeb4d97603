"""Tests for proto/: valid records round-trip, everything else raises ProtoError and only that."""

from __future__ import annotations

import math
import string
import time
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import proto
from proto import (
    MANIFEST,
    ROUND_TICKET,
    STATE_META,
    STATUS,
    Field,
    ProtoError,
    Schema,
    decode,
    decode_state_meta,
    decode_status,
    decode_ticket,
    encode,
    encode_state_meta,
    encode_status,
    encode_ticket,
)

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SCHEMAS = [STATUS, ROUND_TICKET, STATE_META, MANIFEST]
INT64_MAX = 2**63 - 1

# ---------------------------------------------------------------- strategies for valid records

sha256 = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
steps = st.integers(0, INT64_MAX)
finite = st.floats(allow_nan=False, allow_infinity=False)
nonneg = st.floats(min_value=0, allow_nan=False, allow_infinity=False)
maybe_loss = st.none() | st.floats(allow_infinity=False)  # NaN allowed
# Realistic multiaddrs are short ASCII; arbitrary unicode at full length could exceed max_bytes.
maddr = st.text(alphabet=string.ascii_letters + string.digits + "/.:-", max_size=150)

status_records = st.fixed_dictionaries(
    {
        "peer_id": st.text(min_size=1, max_size=128),
        "run_id": st.text(min_size=1, max_size=64),
        "role": st.sampled_from(["peer", "bootstrap", "helper"]),
        "reachability": st.sampled_from(["public", "private", "unknown"]),
        "outer_step": steps,
        "inner_step": steps,
        "loss": maybe_loss,
        "eval_loss": maybe_loss,
        "tokens_per_second": nonneg,
        "global_sha256": sha256,
        "group_size": st.integers(0, 4096),
        "alone": st.booleans(),
        "last_round_seconds": st.none() | nonneg,
        "rounds_ok": steps,
        "rounds_failed": steps,
        "time": nonneg,
        "version": st.text(min_size=1, max_size=32),
        "maddrs": st.lists(maddr, max_size=16),
        "rejected_contributions": st.none() | st.integers(0, INT64_MAX),
        "bans": st.none() | st.integers(0, 100_000),
        "bytes_sent": st.none() | st.integers(0, INT64_MAX),
        "bytes_received": st.none() | st.integers(0, INT64_MAX),
        "compute_utilization": st.none() | st.floats(0, 1),
        "relayed": st.none() | st.booleans(),
        "round_steps": st.none() | st.integers(0, INT64_MAX),
        "round": st.none() | st.integers(0, INT64_MAX),
        "round_tokens": st.none() | st.integers(0, INT64_MAX),
        "round_opened": st.none() | nonneg,
        "reference_tokens": st.none() | st.integers(0, INT64_MAX),
        "tokens_trained": st.none() | st.integers(0, INT64_MAX),
        "tokens_contributed": st.none() | st.integers(0, INT64_MAX),
        "contributing": st.none() | st.booleans(),
        "settings_hash": st.none() | st.text(alphabet="0123456789abcdef", min_size=16, max_size=16),
        "training": st.none() | st.booleans(),
        "manifest_hash": st.none() | sha256,
        "joining": st.none() | steps,
        "joining_since": st.none() | nonneg,
        "eval_bits_per_byte": maybe_loss,
        "sample": st.none() | st.text(max_size=20),
        "sample_step": st.none() | steps,
    }
)
ticket_records = st.fixed_dictionaries(
    {
        "outer_step": steps,
        "global_sha256": sha256,
        "num_params": steps,
        "role": st.sampled_from(["peer", "helper"]),
        "bans": st.none()
        | st.lists(st.text(alphabet=string.ascii_letters + string.digits, max_size=60), max_size=32),
        "tokens": st.integers(0, 2**53),
        "tokens_per_second": st.floats(0, 1e12),
        "train_seconds": st.floats(0, 1e9),
        "manifest_hash": sha256,
        "chunks": st.none()
        | st.lists(
            st.tuples(
                st.integers(0, 9), st.integers(0, 2**40), st.integers(0, 2**20), st.integers(1, 2**20)
            ).filter(lambda p: p[2] < p[3]),
            max_size=32,
        ).map(lambda parts: [v for p in parts for v in p]),
    }
)
state_meta_records = st.fixed_dictionaries(
    {
        "outer_step": steps,
        "global_sha256": sha256,
        "num_tensors": st.integers(0, 100_000),
        "param_count": st.integers(0, 2**40),
        "time": nonneg,
        "pending_tensors": st.integers(0, 100_000),
    }
)
manifest_records = st.fixed_dictionaries(
    {
        "run_id": st.text(alphabet=string.ascii_letters, min_size=1, max_size=64),
        "serial": st.integers(1, 2**31),
        "settings": st.just('{"model":{"preset":"tiny"}}'),
        "key_required": st.booleans(),
        "issued": nonneg,
        "signer": st.text(alphabet=string.ascii_letters, min_size=1, max_size=128),
        "public_key": st.binary(min_size=1, max_size=2048),
        "signature": st.binary(min_size=1, max_size=1024),
    }
)
RECORDS = {
    MANIFEST.name: manifest_records,
    STATUS.name: status_records,
    ROUND_TICKET.name: ticket_records,
    STATE_META.name: state_meta_records,
}


def same(a: Any, b: Any) -> bool:
    """Equality where NaN equals NaN (loss fields may legitimately be NaN)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b) and type(a) is type(b)


def assert_same_record(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert same(a[key], b[key]), (key, a[key], b[key])


def example(schema: Schema) -> dict[str, Any]:
    sha = "ab" * 32
    if schema is MANIFEST:
        return {
            "run_id": "run-1", "serial": 1, "settings": '{"model":{"preset":"tiny"}}', "key_required": False,
            "issued": 1.0, "signer": "QmSigner", "public_key": b"k" * 294, "signature": b"s" * 256,
        }  # fmt: skip
    if schema is STATUS:
        return {
            "peer_id": "12D3KooWExample",
            "run_id": "run-1",
            "role": "peer",
            "reachability": "public",
            "outer_step": 3,
            "inner_step": 1500,
            "loss": 3.25,
            "eval_loss": None,
            "tokens_per_second": 12000.5,
            "global_sha256": sha,
            "group_size": 4,
            "alone": False,
            "last_round_seconds": 12.5,
            "rounds_ok": 3,
            "rounds_failed": 0,
            "time": 1_700_000_000.0,
            "version": "0.1.0",
            "maddrs": ["/ip4/1.2.3.4/tcp/31337", "/ip4/1.2.3.4/udp/31337/quic"],
            "rejected_contributions": 0,
            "bans": 0,
            "bytes_sent": 0,
            "bytes_received": 0,
            "compute_utilization": 0.93,
            "relayed": False,
            "round_steps": 40,
            "round": 3,
            "round_tokens": 81920,
            "round_opened": 1_699_999_990.0,
            "reference_tokens": 163840,
            "tokens_trained": 4_000_000,
            "tokens_contributed": 3_900_000,
            "contributing": True,
            "settings_hash": "0123456789abcdef",
            "training": True,
            "manifest_hash": "cd" * 32,
            "joining": 4,
            "joining_since": 1_699_999_995.0,
            "eval_bits_per_byte": 1.25,
            "sample": " quick brown fox",
            "sample_step": 4,
        }
    if schema is ROUND_TICKET:
        return {
            "outer_step": 3, "global_sha256": sha, "num_params": 124_000_000, "role": "peer", "bans": [],
            "tokens": 163840, "tokens_per_second": 16384.0, "train_seconds": 10.0, "manifest_hash": sha,
            "chunks": [0, 17, 0, 4096, 0, 18, 0, 1024],
        }  # fmt: skip
    return {
        "outer_step": 3, "global_sha256": sha, "num_tensors": 300, "param_count": 150, "time": 1.0,
        "pending_tensors": 0,
    }  # fmt: skip


def raw_pack(schema: Schema, fields: dict[Any, Any], name: Any = None, version: Any = None) -> bytes:
    """Packs a map with an envelope, bypassing validation, to forge defective messages."""
    body: dict[Any, Any] = {
        "_s": schema.name if name is None else name,
        "_v": schema.version if version is None else version,
    }
    body.update(fields)
    return msgpack.packb(body, use_bin_type=True)


def decode_or_protoerror(schema: Schema, data: bytes) -> dict[str, Any] | None:
    """The decoding contract: a valid record or ProtoError; any other exception fails the test."""
    try:
        record = decode(schema, data)
    except ProtoError as exc:
        message = str(exc)
        assert message.startswith(schema.name) and "\n" not in message
        return None
    # Anything accepted must itself be a valid record that re-encodes.
    assert record.keys() == {f.name for f in schema.fields}
    encode(schema, record)
    return record


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: s.name)
def test_example_round_trip(schema: Schema) -> None:
    record = example(schema)
    data = encode(schema, record)
    assert len(data) <= schema.max_bytes
    assert_same_record(decode(schema, data), record)


@FUZZ
@given(data=st.data())
def test_round_trip_generated(data: st.DataObject) -> None:
    schema = data.draw(st.sampled_from(SCHEMAS))
    record = data.draw(RECORDS[schema.name])
    encoded = encode(schema, record)
    assert len(encoded) <= schema.max_bytes
    assert_same_record(decode(schema, encoded), record)


def test_convenience_functions() -> None:
    assert_same_record(decode_status(encode_status(example(STATUS))), example(STATUS))
    assert_same_record(decode_ticket(encode_ticket(example(ROUND_TICKET))), example(ROUND_TICKET))
    assert_same_record(decode_state_meta(encode_state_meta(example(STATE_META))), example(STATE_META))
    with pytest.raises(ProtoError, match="dilocod.ticket"):
        decode_ticket(encode_status(example(STATUS)))


def test_optional_fields_absent_or_null_decode_to_none() -> None:
    record = example(STATUS)
    for name in ("loss", "eval_loss", "last_round_seconds"):
        del record[name]
    decoded = decode(STATUS, encode(STATUS, record))
    assert decoded["loss"] is None and decoded["eval_loss"] is None and decoded["last_round_seconds"] is None
    explicit = raw_pack(STATUS, {**record, "loss": None})
    assert decode(STATUS, explicit)["loss"] is None


def test_nan_loss_allowed_and_int_normalised_to_float() -> None:
    record = {**example(STATUS), "loss": float("nan"), "time": 5, "tokens_per_second": 0}
    decoded = decode(STATUS, encode(STATUS, record))
    assert math.isnan(decoded["loss"])
    assert decoded["time"] == 5.0 and type(decoded["time"]) is float
    assert type(decoded["tokens_per_second"]) is float


def test_tuple_list_is_accepted_on_encode() -> None:
    record = {**example(STATUS), "maddrs": ("/ip4/1.2.3.4/tcp/1",)}
    assert decode(STATUS, encode(STATUS, record))["maddrs"] == ["/ip4/1.2.3.4/tcp/1"]


def test_public_names() -> None:
    for name in proto.__all__:
        assert hasattr(proto, name)


# ---------------------------------------------------------------- hostile bytes


@FUZZ
@given(schema=st.sampled_from(SCHEMAS), data=st.binary(max_size=5000))
def test_garbage_bytes_only_protoerror(schema: Schema, data: bytes) -> None:
    decode_or_protoerror(schema, data)


@FUZZ
@given(data=st.data())
def test_mutated_valid_encodings_only_protoerror(data: st.DataObject) -> None:
    schema = data.draw(st.sampled_from(SCHEMAS))
    encoded = bytearray(encode(schema, data.draw(RECORDS[schema.name])))
    for _ in range(data.draw(st.integers(1, 8))):
        position = data.draw(st.integers(0, len(encoded) - 1))
        encoded[position] = data.draw(st.integers(0, 255))
    decode_or_protoerror(schema, bytes(encoded))


# Arbitrary msgpack values, to exercise the type checks behind a correct envelope.
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=40)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=10,
)


@FUZZ
@given(data=st.data())
def test_wrong_values_behind_valid_envelope_only_protoerror(data: st.DataObject) -> None:
    schema = data.draw(st.sampled_from(SCHEMAS))
    record: dict[str, Any] = data.draw(RECORDS[schema.name])
    names = [f.name for f in schema.fields]
    for name in data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=4, unique=True)):
        record[name] = data.draw(msgpack_values)
    encoded = raw_pack(schema, record)
    if len(encoded) <= schema.max_bytes:
        decode_or_protoerror(schema, encoded)


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: s.name)
def test_every_truncation_is_rejected(schema: Schema) -> None:
    data = encode(schema, example(schema))
    for end in range(len(data)):
        with pytest.raises(ProtoError, match="not valid msgpack"):
            decode(schema, data[:end])


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: s.name)
def test_trailing_data_is_rejected(schema: Schema) -> None:
    with pytest.raises(ProtoError, match="ExtraData"):
        decode(schema, encode(schema, example(schema)) + b"\xc0")


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: s.name)
def test_oversized_input_rejected_without_unpacking(schema: Schema, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bytes] = []
    real_unpackb = msgpack.unpackb

    def spy(data: bytes, **kwargs: Any) -> Any:
        calls.append(data)
        return real_unpackb(data, **kwargs)

    monkeypatch.setattr(msgpack, "unpackb", spy)
    valid = encode(schema, example(schema))
    oversized = valid + b"\x00" * (schema.max_bytes + 1 - len(valid))
    with pytest.raises(ProtoError, match="above the limit"):
        decode(schema, oversized)
    assert calls == []
    decode(schema, valid)  # the spy is really in the path
    assert calls == [valid]


@pytest.mark.parametrize("value", ["text", bytearray(b"\x80"), memoryview(b"\x80"), None, 5, [1]])
def test_non_bytes_input_rejected(value: Any) -> None:
    with pytest.raises(ProtoError, match="expected bytes"):
        decode(STATUS, value)


@pytest.mark.parametrize(
    "data",
    [
        b"\xdd\xff\xff\xff\xff",  # array32 claiming 4 billion items
        b"\xdf\xff\xff\xff\xff",  # map32 claiming 4 billion pairs
        b"\xdb\xff\xff\xff\xff",  # str32 claiming 4 GiB
        b"\xc6\xff\xff\xff\xff",  # bin32 claiming 4 GiB
        b"\xc9\xff\xff\xff\xff\x01",  # ext32 claiming 4 GiB
        b"\x82\xa2_s\xaedilocod.status\xa2_v\xdd\xff\xff\xff\xff",  # huge array as a value
        b"\x91" * 4000,  # nesting far deeper than any record
        b"\x81\xa1a" * 1300 + b"\xc0",  # deeply nested maps, deeper than msgpack allows
    ],
)
def test_huge_declared_lengths_rejected_quickly(data: bytes) -> None:
    start = time.perf_counter()
    with pytest.raises(ProtoError, match="not valid msgpack"):
        decode(STATUS, data)
    assert time.perf_counter() - start < 0.5


def test_status_max_bytes_is_a_real_bound() -> None:
    # Every field is individually valid but together they do not fit into 4096 bytes.
    record = {**example(STATUS), "maddrs": ["x" * 256] * 16}
    with pytest.raises(ProtoError, match="exceeds the limit"):
        encode(STATUS, record)


# ---------------------------------------------------------------- defects, each named in the error


def defect_cases() -> list[tuple[str, Schema, bytes, str]]:
    status = example(STATUS)
    ticket = example(ROUND_TICKET)
    meta = example(STATE_META)

    def without(record: dict[str, Any], name: str) -> dict[str, Any]:
        return {k: v for k, v in record.items() if k != name}

    cases: list[tuple[str, Schema, bytes, str]] = [
        ("missing field", STATUS, raw_pack(STATUS, without(status, "peer_id")), "peer_id"),
        ("missing field", ROUND_TICKET, raw_pack(ROUND_TICKET, without(ticket, "role")), "role"),
        ("null required", STATUS, raw_pack(STATUS, {**status, "alone": None}), "alone"),
        ("unknown field", STATUS, raw_pack(STATUS, {**status, "evil": 1}), "evil"),
        ("unknown bytes key", STATUS, raw_pack(STATUS, {**status, b"evil": 1}), "evil"),
        ("wrong type str", STATUS, raw_pack(STATUS, {**status, "peer_id": 7}), "peer_id"),
        ("wrong type int", ROUND_TICKET, raw_pack(ROUND_TICKET, {**ticket, "outer_step": "3"}), "outer_step"),
        ("float for int", ROUND_TICKET, raw_pack(ROUND_TICKET, {**ticket, "outer_step": 3.0}), "outer_step"),
        ("bool for int", STATE_META, raw_pack(STATE_META, {**meta, "num_tensors": True}), "num_tensors"),
        ("bool for float", STATUS, raw_pack(STATUS, {**status, "time": False}), "time"),
        ("int for bool", STATUS, raw_pack(STATUS, {**status, "alone": 0}), "alone"),
        ("bytes for str", STATUS, raw_pack(STATUS, {**status, "run_id": b"run"}), "run_id"),
        ("map for list", STATUS, raw_pack(STATUS, {**status, "maddrs": {"a": "b"}}), "maddrs"),
        ("non-str item", STATUS, raw_pack(STATUS, {**status, "maddrs": ["/ip4", 5]}), "maddrs"),
        ("NaN not allowed", STATUS, raw_pack(STATUS, {**status, "time": math.nan}), "time"),
        (
            "NaN not allowed",
            STATUS,
            raw_pack(STATUS, {**status, "last_round_seconds": math.nan}),
            "last_round_seconds",
        ),
        ("Inf", STATUS, raw_pack(STATUS, {**status, "tokens_per_second": math.inf}), "tokens_per_second"),
        ("-Inf in NaN field", STATUS, raw_pack(STATUS, {**status, "loss": -math.inf}), "loss"),
        ("negative", STATUS, raw_pack(STATUS, {**status, "outer_step": -1}), "outer_step"),
        ("negative float", STATE_META, raw_pack(STATE_META, {**meta, "time": -0.5}), "time"),
        ("above max", STATUS, raw_pack(STATUS, {**status, "group_size": 4097}), "group_size"),
        ("above max", STATE_META, raw_pack(STATE_META, {**meta, "param_count": 2**40 + 1}), "param_count"),
        ("beyond int64", ROUND_TICKET, raw_pack(ROUND_TICKET, {**ticket, "num_params": 2**63}), "num_params"),
        ("empty str", STATUS, raw_pack(STATUS, {**status, "peer_id": ""}), "peer_id"),
        ("long str", STATUS, raw_pack(STATUS, {**status, "version": "v" * 33}), "version"),
        ("bad choice", STATUS, raw_pack(STATUS, {**status, "role": "king"}), "role"),
        ("bad choice", ROUND_TICKET, raw_pack(ROUND_TICKET, {**ticket, "role": "bootstrap"}), "role"),
        ("uppercase hex", STATUS, raw_pack(STATUS, {**status, "global_sha256": "AB" * 32}), "global_sha256"),
        (
            "non-hex",
            ROUND_TICKET,
            raw_pack(ROUND_TICKET, {**ticket, "global_sha256": "zz" * 32}),
            "global_sha256",
        ),
        (
            "short hex",
            STATE_META,
            raw_pack(STATE_META, {**meta, "global_sha256": "ab" * 31}),
            "global_sha256",
        ),
        ("too many items", STATUS, raw_pack(STATUS, {**status, "maddrs": ["/a"] * 17}), "maddrs"),
        ("too long item", STATUS, raw_pack(STATUS, {**status, "maddrs": ["x" * 257]}), "maddrs"),
        ("wrong schema", STATUS, raw_pack(STATUS, status, name="dilocod.ticket"), "_s"),
        ("schema as bytes", STATUS, raw_pack(STATUS, status, name=b"dilocod.status"), "_s"),
        ("missing schema", STATUS, msgpack.packb({"_v": 1, **status}), "_s"),
        ("newer version", STATUS, raw_pack(STATUS, status, version=STATUS.version + 1), "_v"),
        ("version zero", ROUND_TICKET, raw_pack(ROUND_TICKET, ticket, version=0), "_v"),
        ("version as bool", ROUND_TICKET, raw_pack(ROUND_TICKET, ticket, version=True), "_v"),
        ("version as str", STATE_META, raw_pack(STATE_META, meta, version="1"), "_v"),
        ("missing version", STATE_META, msgpack.packb({"_s": STATE_META.name, **meta}), "_v"),
    ]
    return cases


@pytest.mark.parametrize(
    ("schema", "data", "field"),
    [case[1:] for case in defect_cases()],
    ids=[f"{case[1].name}-{case[0]}-{case[3]}" for case in defect_cases()],
)
def test_defect_is_rejected_naming_the_field(schema: Schema, data: bytes, field: str) -> None:
    with pytest.raises(ProtoError) as info:
        decode(schema, data)
    message = str(info.value)
    assert field in message
    assert message.startswith(f"{schema.name} v{schema.version}: field ")
    assert "\n" not in message


def test_newer_version_message() -> None:
    newer = STATUS.version + 1
    with pytest.raises(ProtoError, match=f"unsupported version {newer}"):
        decode(STATUS, raw_pack(STATUS, example(STATUS), version=newer))


def test_duplicate_key_rejected() -> None:
    # msgpack.packb cannot produce duplicate keys from a dict, so assemble the map by hand.
    ticket = example(ROUND_TICKET)
    pairs = [("_s", ROUND_TICKET.name), ("_v", 1), *ticket.items(), ("role", "helper")]
    data = bytes([0x80 | len(pairs)]) + b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in pairs)
    with pytest.raises(ProtoError, match="'role': duplicate key"):
        decode(ROUND_TICKET, data)


@pytest.mark.parametrize("top", [[1, 2], "x", 5, None, b"\x00"], ids=repr)
def test_non_map_top_level_rejected(top: Any) -> None:
    with pytest.raises(ProtoError, match="top level must be a map"):
        decode(ROUND_TICKET, msgpack.packb(top, use_bin_type=True))


def test_non_str_map_key_rejected() -> None:
    with pytest.raises(ProtoError, match="not valid msgpack"):
        decode(ROUND_TICKET, msgpack.packb({1: 2}))


def test_error_message_truncates_hostile_values() -> None:
    data = raw_pack(STATUS, {**example(STATUS), "role": "x" * 3000})
    with pytest.raises(ProtoError) as info:
        decode(STATUS, data)
    assert len(str(info.value)) < 300


# ---------------------------------------------------------------- outgoing records


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"peer_id": None}, "peer_id"),
        ({"outer_step": True}, "outer_step"),
        ({"outer_step": 2**70}, "outer_step"),
        ({"time": 10**400}, "time"),
        ({"loss": math.inf}, "loss"),
        ({"role": "admin"}, "role"),
        ({"global_sha256": "x"}, "global_sha256"),
        ({"maddrs": "not a list"}, "maddrs"),
        ({"surprise": 1}, "surprise"),
        ({"_s": "other"}, "_s"),
    ],
)
def test_encode_rejects_bad_records(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ProtoError, match=field):
        encode(STATUS, {**example(STATUS), **change})


def test_encode_rejects_missing_field_and_non_mapping() -> None:
    record = example(ROUND_TICKET)
    del record["num_params"]
    with pytest.raises(ProtoError, match="num_params"):
        encode(ROUND_TICKET, record)
    with pytest.raises(ProtoError, match="mapping"):
        encode(ROUND_TICKET, [("outer_step", 1)])  # type: ignore[arg-type]


def test_encode_rejects_unencodable_str() -> None:
    with pytest.raises(ProtoError, match="cannot pack"):
        encode(STATUS, {**example(STATUS), "peer_id": "\ud800"})


# ---------------------------------------------------------------- schema definitions


def test_schema_definitions_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown kind"):
        Field("x", "decimal")
    with pytest.raises(ValueError, match="reserved"):
        Field("_s", "str")
    with pytest.raises(ValueError, match="choices"):
        Field("x", "int", choices=("a",))
    with pytest.raises(ValueError, match="duplicate"):
        Schema("s", 1, (Field("a", "int"), Field("a", "str")), 100)
    with pytest.raises(ValueError, match="version"):
        Schema("s", 0, (), 100)


def test_schema_constants() -> None:
    assert (STATUS.name, STATUS.version, STATUS.max_bytes) == ("dilocod.status", 10, 4096)
    assert (ROUND_TICKET.name, ROUND_TICKET.version, ROUND_TICKET.max_bytes) == ("dilocod.ticket", 5, 4096)
    assert ROUND_TICKET.min_version == 4 and STATUS.min_version == 1
    assert (MANIFEST.name, MANIFEST.version, MANIFEST.max_bytes) == ("dilocod.manifest", 1, 16384)
    assert (STATE_META.name, STATE_META.version, STATE_META.max_bytes) == ("dilocod.state", 2, 2048)


def test_older_version_accepted_when_schema_grows() -> None:
    # A v2 schema that added an optional field still reads v1 records, which lack it.
    v1 = Schema("demo", 1, (Field("a", "int"),), 64)
    v2 = Schema("demo", 2, (Field("a", "int"), Field("b", "str", optional=True)), 64)
    assert decode(v2, encode(v1, {"a": 1})) == {"a": 1, "b": None}
    with pytest.raises(ProtoError, match="unsupported version 2"):
        decode(v1, encode(v2, {"a": 1, "b": "x"}))


V6 = ("round", "round_tokens", "round_opened", "reference_tokens", "tokens_trained", "tokens_contributed",
      "contributing", "settings_hash", "training")  # fmt: skip
V7 = ("manifest_hash",)
V8 = ("joining", "joining_since")
V6_ON = (*V6, *V7, *V8)
V5_ON = ("round_steps", *V6_ON)


def test_status_v2_records_still_decode() -> None:
    """v3 added compute_utilization (optional): a v2 sender's record reads back with it as None."""
    record = {k: v for k, v in example(STATUS).items() if k not in ("compute_utilization", "relayed", *V5_ON)}
    decoded = decode(STATUS, raw_pack(STATUS, record, version=2))
    assert decoded["compute_utilization"] is None and decoded["peer_id"] == record["peer_id"]
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ProtoError, match="compute_utilization"):
            decode(STATUS, raw_pack(STATUS, {**record, "compute_utilization": bad}))


def test_status_v3_records_still_decode() -> None:
    """v4 added relayed (optional): a v3 sender's record reads back with it as None."""
    record = {k: v for k, v in example(STATUS).items() if k not in ("relayed", *V5_ON)}
    decoded = decode(STATUS, raw_pack(STATUS, record, version=3))
    assert decoded["relayed"] is None and decoded["compute_utilization"] == record["compute_utilization"]
    with pytest.raises(ProtoError, match="relayed"):
        decode(STATUS, raw_pack(STATUS, {**record, "relayed": 1}))


def test_status_v4_records_still_decode() -> None:
    """v5 added round_steps (optional): a v4 sender's record reads back with it as None."""
    record = {k: v for k, v in example(STATUS).items() if k not in V5_ON}
    decoded = decode(STATUS, raw_pack(STATUS, record, version=4))
    assert decoded["round_steps"] is None and decoded["relayed"] == record["relayed"]
    for bad in (-1, 1.5, "3"):
        with pytest.raises(ProtoError, match="round_steps"):
            decode(STATUS, raw_pack(STATUS, {**record, "round_steps": bad}))


def test_status_v5_records_still_decode() -> None:
    """v6 added the round clock's fields (optional): a v5 sender's record reads back without them."""
    record = {k: v for k, v in example(STATUS).items() if k not in V6_ON}
    decoded = decode(STATUS, raw_pack(STATUS, record, version=5))
    assert all(decoded[k] is None for k in V6_ON) and decoded["round_steps"] == record["round_steps"]
    with pytest.raises(ProtoError, match="settings_hash"):
        decode(STATUS, raw_pack(STATUS, {**example(STATUS), "settings_hash": "abc"}))


def test_status_v6_records_still_decode() -> None:
    """v7 added manifest_hash (optional): a v6 sender's record reads back with it as None."""
    record = {k: v for k, v in example(STATUS).items() if k not in (*V7, *V8)}
    decoded = decode(STATUS, raw_pack(STATUS, record, version=6))
    assert decoded["manifest_hash"] is None and decoded["settings_hash"] == record["settings_hash"]
    with pytest.raises(ProtoError, match="manifest_hash"):
        decode(STATUS, raw_pack(STATUS, {**example(STATUS), "manifest_hash": "ab" * 16}))


def test_status_v7_records_still_decode() -> None:
    """v8 added joining and joining_since (optional): a v7 sender's record reads back with them as None."""
    record = {k: v for k, v in example(STATUS).items() if k not in V8}
    decoded = decode(STATUS, raw_pack(STATUS, record, version=7))
    assert decoded["joining"] is None and decoded["joining_since"] is None
    assert decoded["manifest_hash"] == record["manifest_hash"]
    for field, bad in (("joining", -1), ("joining", 1.5), ("joining_since", -3.0), ("joining_since", "now")):
        with pytest.raises(ProtoError, match=field):
            decode(STATUS, raw_pack(STATUS, {**example(STATUS), field: bad}))


@pytest.mark.parametrize(
    "version, missing",
    [
        (3, ("manifest_hash",)),  # names no manifest: which settings it trained under is unknown
        (2, ("tokens", "tokens_per_second", "train_seconds", "manifest_hash")),  # no tokens to weigh it by
    ],
)
def test_old_tickets_are_refused_by_name(version: int, missing: tuple[str, ...]) -> None:
    old = {k: v for k, v in example(ROUND_TICKET).items() if k not in missing}
    with pytest.raises(
        ProtoError,
        match=f"version {version} is no longer accepted .oldest accepted is 4.: the sender runs an older dilocod",
    ):
        decode_ticket(raw_pack(ROUND_TICKET, old, version=version))
    with pytest.raises(ProtoError, match=missing[0]):
        decode_ticket(raw_pack(ROUND_TICKET, old))


def test_a_schema_cannot_accept_versions_beyond_its_own() -> None:
    with pytest.raises(ValueError, match="min_version"):
        Schema("s", 2, (), 100, min_version=3)


def test_chunk_messages_round_trip_and_refuse_broken_groups() -> None:
    from proto.chunks import (
        decode_chunk_reply,
        decode_chunk_request,
        encode_chunk_reply,
        encode_chunk_request,
    )

    request = {"held": [0, 3, 128, 1, 9, 0], "want": 2}
    assert decode_chunk_request(encode_chunk_request(request)) == request
    reply = {"leases": [0, 3, 300, 100, 50], "lease_seconds": 300.0, "epoch": 0, "epoch_fraction": 0.5,
             "tokens_trained": 7, "chunks_trained": 1, "chunks_total": 10, "error": None}  # fmt: skip
    assert decode_chunk_reply(encode_chunk_reply(reply)) == reply
    with pytest.raises(ProtoError, match="not groups of 3"):
        encode_chunk_request({"held": [0, 3], "want": 1})
    with pytest.raises(ProtoError, match="either leases or an error"):
        encode_chunk_reply({"lease_seconds": 3.0})
    with pytest.raises(ProtoError, match="outside its size"):
        encode_chunk_reply({"leases": [0, 3, 300, 100, 101]})
    with pytest.raises(ProtoError, match="not groups of 4"):
        encode_ticket({**example(ROUND_TICKET), "chunks": [0, 1, 2]})
    with pytest.raises(ProtoError, match="lo 5 >= hi 5"):
        encode_ticket({**example(ROUND_TICKET), "chunks": [0, 1, 5, 5]})
    with pytest.raises(ProtoError, match="outside 0"):
        encode_ticket({**example(ROUND_TICKET), "chunks": [0, -1, 0, 5]})
