"""The run manifest as a value: issued from a config, signed, encoded (`proto.MANIFEST`), decoded and checked.

Its hash names the settings a node trains under: it travels in status records and round tickets, and
keys matchmaking, so nodes of different manifests never average together. It covers the content (run id,
serial, settings, whether a run key is required), not who signed it or when: a bootstrap that lost its
identity and issues the same settings again leaves the run's hash unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

from hivemind.p2p import PeerID

from dilocod.config import Config
from dilocod.manifest.keys import RUN_WIDE
from peers.auth import Identity, signed_by
from proto import ProtoError, decode_manifest, encode_manifest

SIGNING_CONTEXT = b"dilocod.manifest.1\n"


class ManifestError(ValueError):
    """A manifest that cannot be used (malformed, forged, contradicted); the message is one line."""


def canonical(value: Any) -> str:
    """The one JSON text of `value` everybody computes alike: sorted keys, no spaces, ASCII."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def settings_of(config: Config) -> dict[str, dict[str, Any]]:
    """The run-wide settings of `config` as plain JSON values (tuples become lists)."""
    settings: dict[str, dict[str, Any]] = {}
    for section, keys in RUN_WIDE.items():
        values = dataclasses.asdict(getattr(config, section))
        settings[section] = {key: _plain(values[key]) for key in keys}
    return settings


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True)
class Manifest:
    run_id: str
    serial: int
    settings: dict[str, dict[str, Any]]
    key_required: bool
    issued: float
    signer: str
    public_key: bytes
    signature: bytes

    @property
    def hash(self) -> str:
        """manifest_hash: sha256 (hex) of the canonical content."""
        return content_hash(self.run_id, self.serial, self.settings, self.key_required)

    def encode(self) -> bytes:
        return encode_manifest(self._fields(with_signature=True))

    def _fields(self, *, with_signature: bool) -> dict[str, Any]:
        fields = {
            "run_id": self.run_id, "serial": self.serial, "settings": canonical(self.settings),
            "key_required": self.key_required, "issued": self.issued, "signer": self.signer,
            "public_key": self.public_key,
        }  # fmt: skip
        if with_signature:
            fields["signature"] = self.signature
        return fields

    def signed_message(self) -> bytes:
        fields = self._fields(with_signature=False)
        fields["public_key"] = self.public_key.hex()
        return SIGNING_CONTEXT + canonical(fields).encode()

    def to_json(self) -> dict[str, Any]:
        """What `GET /api/run/manifest` serves: the record, its hash, and the signature to check it by."""
        return {
            "manifest_hash": self.hash, "run_id": self.run_id, "serial": self.serial,
            "settings": self.settings, "key_required": self.key_required, "issued": self.issued,
            "signer": self.signer, "public_key": self.public_key.hex(), "signature": self.signature.hex(),
            "summary": summary(self),
        }  # fmt: skip

    def value(self, key: str) -> Any:
        section, _, name = key.partition(".")
        return self.settings.get(section, {}).get(name)


def content_hash(run_id: str, serial: int, settings: dict[str, Any], key_required: bool) -> str:
    content = {"run_id": run_id, "serial": serial, "settings": settings, "key_required": key_required}
    return hashlib.sha256(canonical(content).encode()).hexdigest()


def issue(config: Config, identity: Identity, *, serial: int = 1, now: float | None = None) -> Manifest:
    """A new manifest of `config`'s run-wide settings, signed by `identity`."""
    unsigned = Manifest(
        run_id=config.run.id, serial=serial, settings=settings_of(config), key_required=config.run.key is not None,
        issued=round(time.time() if now is None else now, 3), signer=PeerID(identity.peer_id).to_base58(),
        public_key=identity.public_der, signature=b"",
    )  # fmt: skip
    return dataclasses.replace(unsigned, signature=identity.sign(unsigned.signed_message()))


def decode(blob: bytes) -> Manifest:
    """A manifest from stranger bytes, its signature checked; ManifestError (one line) otherwise."""
    try:
        record = decode_manifest(blob)
    except ProtoError as e:
        raise ManifestError(f"malformed manifest: {e}") from None
    try:
        settings = json.loads(record["settings"])
    except ValueError:
        raise ManifestError("malformed manifest: its settings are not JSON") from None
    if not isinstance(settings, dict) or not all(isinstance(v, dict) for v in settings.values()):
        raise ManifestError("malformed manifest: its settings must be a table of sections")
    manifest = Manifest(
        record["run_id"], record["serial"], settings, record["key_required"], record["issued"],
        record["signer"], record["public_key"], record["signature"],
    )  # fmt: skip
    if signed_by(manifest.public_key, manifest.signed_message(), manifest.signature) != manifest.signer:
        raise ManifestError(f"forged manifest: its signature is not {manifest.signer}'s")
    return manifest


def summary(manifest: Manifest) -> str:
    """The run in one line: preset, H, codec, reducer, overlap, round tokens (and its starting weights)."""
    v = manifest.value
    tokens = v("round.tokens")
    hf = v("model.hf_config_json")
    parts = [
        hf_summary(str(hf)) if hf else str(v("model.preset")), f"H={v('trainer.inner_steps')}", str(v("averaging.compression")),
        str(v("averaging.reducer")), f"overlap {v('outer.overlap')}",
        f"round {tokens} tokens" if tokens else "round auto", f"group {v('averaging.group_size')}",
    ]  # fmt: skip
    if v("model.init"):
        parts.append(f"from weights {str(v('model.init'))[:12]}")
    if manifest.key_required:
        parts.append("run key required")
    return ", ".join(parts)


def hf_summary(config_json: str) -> str:
    """A pinned transformers config in a few words: its model_type and the sha256 of its canonical JSON."""
    try:
        family = json.loads(config_json).get("model_type", "?")
    except (ValueError, AttributeError):
        family = "?"
    return f"hf {family} {hashlib.sha256(config_json.encode()).hexdigest()[:12]}"


def differing_keys(a: Manifest, b: Manifest) -> list[str]:
    """`section.key` of every setting on which two manifests differ (run id and serial included)."""
    keys = [name for name in ("run_id", "serial", "key_required") if getattr(a, name) != getattr(b, name)]
    sections = sorted(set(a.settings) | set(b.settings))
    for section in sections:
        mine, theirs = a.settings.get(section, {}), b.settings.get(section, {})
        keys += [
            f"{section}.{key}" for key in sorted(set(mine) | set(theirs)) if mine.get(key) != theirs.get(key)
        ]
    return keys
