"""The run manifest: encode/decode/sign/verify, refusing garbage and forgeries, whom to trust, how it meets
this machine's own settings, and the classification of every config key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hivemind.p2p import P2P

from dilocod.config import Config, ConfigError, load_config, read_raw
from dilocod.manifest.adopt import adopt, conflicts, run_config, trust_problem
from dilocod.manifest.keys import LOCAL, RUN_WIDE
from dilocod.manifest.obtain import MANIFEST_FILE, load_stored, store
from dilocod.manifest.record import (
    Manifest,
    ManifestError,
    canonical,
    decode,
    differing_keys,
    issue,
    settings_of,
    summary,
)
from dilocod.observability.runview import flag_manifests
from peers.auth import Identity
from proto import MANIFEST, encode_manifest


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Identity, Identity]:
    root = tmp_path_factory.mktemp("keys")
    made = []
    for name in ("a", "b"):
        P2P.generate_identity(str(root / name))
        made.append(Identity.load(root / name))
    return made[0], made[1]


def run_of(*overrides: str) -> Config:
    return load_config(None, ["trainer.inner_steps=5", "averaging.compression=int4", *overrides])


# ---------------------------------------------------------------- the record


def test_round_trip_keeps_every_field_and_the_signature_verifies(keys: tuple[Identity, Identity]) -> None:
    manifest = issue(run_of(), keys[0], now=100.0)
    back = decode(manifest.encode())
    assert back == manifest
    assert back.value("trainer.inner_steps") == 5 and back.value("averaging.compression") == "int4"
    assert back.key_required is False and back.serial == 1 and len(back.hash) == 64


def test_the_hash_is_the_content_not_the_signer_or_the_time(keys: tuple[Identity, Identity]) -> None:
    a, b = keys
    assert issue(run_of(), a, now=1.0).hash == issue(run_of(), b, now=2.0).hash
    assert issue(run_of(), a).hash != issue(run_of("trainer.inner_steps=6"), a).hash
    assert issue(run_of(), a).hash != issue(run_of('run.key="a-long-enough-secret"'), a).hash  # key_required


def test_local_keys_are_not_in_the_manifest(keys: tuple[Identity, Identity]) -> None:
    a = keys[0]
    base = issue(run_of(), a)
    for local in (
        "net.port=5",
        "trainer.threads=2",
        "trainer.devices=2",
        "adversary.mode=nan",
        "averaging.ban_seconds=5",
    ):
        assert issue(run_of(local), a).hash == base.hash, local
    assert "key" not in base.settings["run"]
    assert issue(run_of('run.key="a-long-enough-secret"'), a).key_required


@pytest.mark.parametrize(
    "blob, problem",
    [
        (b"", "malformed manifest"),
        (b"\x00" * 100, "malformed manifest"),
        (b"\xff" * 20_000, "malformed manifest"),  # oversize: refused before msgpack reads it
    ],
)
def test_garbage_is_refused_in_one_line(blob: bytes, problem: str) -> None:
    with pytest.raises(ManifestError, match=problem) as caught:
        decode(blob)
    assert "\n" not in str(caught.value)


def _forge(manifest: Manifest, **changes: object) -> bytes:
    fields = {
        "run_id": manifest.run_id, "serial": manifest.serial, "settings": canonical(manifest.settings),
        "key_required": manifest.key_required, "issued": manifest.issued, "signer": manifest.signer,
        "public_key": manifest.public_key, "signature": manifest.signature,
    }  # fmt: skip
    fields.update(changes)
    return encode_manifest(fields)


def test_forgeries_are_refused(keys: tuple[Identity, Identity]) -> None:
    a, b = keys
    good = issue(run_of(), a)
    assert decode(_forge(good)) == good  # the forging helper itself reproduces the honest record
    tampered = _forge(good, settings=_forge_settings(good, "trainer", "inner_steps", 500))
    other_signer = _forge(good, signer=issue(run_of(), b).signer)  # claims b, signed by a
    other_key = _forge(good, public_key=b.public_der)  # b's key, a's signature
    resigned_by_b = dataclasses.replace(good, signer=issue(run_of(), b).signer, public_key=b.public_der)
    for blob in (tampered, other_signer, other_key, resigned_by_b.encode()):
        with pytest.raises(ManifestError, match="forged manifest"):
            decode(blob)


def _forge_settings(manifest: Manifest, section: str, key: str, value: object) -> str:
    settings = {s: dict(values) for s, values in manifest.settings.items()}
    settings[section][key] = value
    return canonical(settings)


def test_settings_that_are_not_tables_are_refused(keys: tuple[Identity, Identity]) -> None:
    good = issue(run_of(), keys[0])
    for settings in ("[1, 2]", '{"model": 3}', "not json"):
        with pytest.raises(ManifestError, match="malformed manifest"):
            decode(_forge(good, settings=settings))


def test_summary_and_differences(keys: tuple[Identity, Identity]) -> None:
    a = keys[0]
    one, two = issue(run_of(), a), issue(run_of("trainer.inner_steps=7", "averaging.reducer=median"), a)
    assert summary(one).startswith("tiny, H=5, int4, centered_clip")
    assert differing_keys(one, two) == ["averaging.reducer", "trainer.inner_steps"]
    assert differing_keys(one, one) == []


# ---------------------------------------------------------------- whom to trust


def test_trust_table(keys: tuple[Identity, Identity]) -> None:
    a, b = keys
    by_a, by_b = issue(run_of(), a), issue(run_of(), b)
    by_b_other = issue(run_of("trainer.inner_steps=9"), b)
    other_run = issue(run_of('run.id="other"', "trainer.inner_steps=9"), b)
    cases = [
        # manifest, served by, given, pinned → trusted?
        (by_a, by_a.signer, [by_a.signer], None, True),  # the bootstrap we named signed it
        (by_a, "QmSecondBootstrap", ["QmSecondBootstrap"], None, True),  # a bootstrap we named serves it
        (by_a, "QmStranger", ["QmSomeoneElse"], None, False),  # nobody we named
        (by_b, by_b.signer, [by_b.signer], by_a, True),  # same content as we ran with: nothing changes
        (by_b_other, by_b.signer, [by_b.signer], by_a, False),  # new settings from another signer
        (issue(run_of("trainer.inner_steps=9"), a), "QmX", ["QmX"], by_a, True),  # our signer changed it
        (other_run, other_run.signer, [other_run.signer], by_a, True),  # another run: the pin is not its
    ]
    for manifest, served_by, given, pinned, trusted in cases:
        problem = trust_problem(manifest, served_by, given, pinned)
        assert (problem is None) is trusted, (manifest.signer, served_by, given, problem)
    assert "but this run's manifest was signed by" in str(trust_problem(by_b_other, by_b.signer, [], by_a))


# ---------------------------------------------------------------- meeting this machine's settings


def test_a_contradiction_is_named_per_key(keys: tuple[Identity, Identity], tmp_path: Path) -> None:
    manifest = issue(run_of("averaging.compression=int8"), keys[0])
    raw = read_raw(None, ["averaging.compression=none", "trainer.inner_steps=20", "trainer.threads=2"])
    assert conflicts(manifest, raw) == [
        "averaging.compression: the run uses int8, you set none",
        "trainer.inner_steps: the run uses 5, you set 20",
    ]
    with pytest.raises(ConfigError) as caught:
        adopt(manifest, raw)
    assert str(caught.value).splitlines()[1:] == conflicts(manifest, raw)


def test_equal_values_and_local_keys_pass(keys: tuple[Identity, Identity]) -> None:
    manifest = issue(run_of(), keys[0])
    raw = read_raw(
        None, ["trainer.inner_steps=5", "averaging.compression=int4", "trainer.threads=2", "net.port=7"]
    )
    config = adopt(manifest, raw)
    assert config.trainer.threads == 2 and config.net.port == 7
    assert settings_of(config) == manifest.settings


def test_a_run_that_needs_a_key_refuses_a_peer_without(keys: tuple[Identity, Identity]) -> None:
    manifest = issue(run_of('run.key="a-long-enough-secret"'), keys[0])
    with pytest.raises(ConfigError, match="requires a run key: set run.key"):
        adopt(manifest, {})
    assert adopt(manifest, read_raw(None, ['run.key="a-long-enough-secret"'])).run.key is not None


def test_a_manifest_that_is_no_valid_config_is_refused(keys: tuple[Identity, Identity]) -> None:
    good = issue(run_of(), keys[0])
    cases = [
        ({**good.settings, "trainer": {**good.settings["trainer"], "inner_steps": -1}}, "inner_steps"),
        ({**good.settings, "trainer": {**good.settings["trainer"], "inner_steps": "five"}}, "inner_steps"),
        ({**good.settings, "net": {"port": 1}}, "unknown section 'net'"),
        ({**good.settings, "trainer": {**good.settings["trainer"], "threads": 1}}, "no run-wide key"),
    ]
    for settings, problem in cases:
        with pytest.raises(ManifestError, match=problem):
            run_config(dataclasses.replace(good, settings=settings), {})


# ---------------------------------------------------------------- the run dir, the run view


def test_stored_manifest_round_trips_and_a_damaged_one_is_set_aside(
    keys: tuple[Identity, Identity], tmp_path: Path
) -> None:
    manifest = issue(run_of(), keys[0])
    store(tmp_path, manifest)
    assert load_stored(tmp_path) == manifest
    (tmp_path / MANIFEST_FILE).write_bytes(b"garbage")
    assert load_stored(tmp_path) is None
    assert (tmp_path / "manifest.bad").read_bytes() == b"garbage"
    assert load_stored(tmp_path / "nowhere") is None


def test_records_of_another_manifest_are_flagged() -> None:
    records = [
        {"peer_id": "a", "manifest_hash": "1" * 64},
        {"peer_id": "b", "manifest_hash": "2" * 64},
        {"peer_id": "c"},
    ]
    flagged = flag_manifests(records, "1" * 64)
    assert [r["other_manifest"] for r in flagged] == [False, True, True]
    assert not any(r["other_manifest"] for r in flag_manifests(records, None))


# ---------------------------------------------------------------- every key has a class


def test_every_config_key_is_run_wide_or_local() -> None:
    """Adding a config key without deciding whether the run shares it fails here."""
    config = Config()
    for section in dataclasses.fields(config):
        keys = {f.name for f in dataclasses.fields(getattr(config, section.name))}
        run_wide, local = set(RUN_WIDE.get(section.name, ())), set(LOCAL.get(section.name, ()))
        assert not run_wide & local, f"[{section.name}] keys in both classes: {sorted(run_wide & local)}"
        assert keys == run_wide | local, (
            f"[{section.name}] unclassified: {sorted(keys - run_wide - local)}; "
            f"classified but gone: {sorted((run_wide | local) - keys)} (see dilocod/manifest/keys.py)"
        )
    assert set(RUN_WIDE) | set(LOCAL) == {f.name for f in dataclasses.fields(config)}


def test_the_schema_bounds_the_largest_manifest(keys: tuple[Identity, Identity]) -> None:
    blob = issue(run_of(), keys[0]).encode()
    assert len(blob) < MANIFEST.max_bytes // 4
