"""Who may take part in a run, and the signatures that prove it on every DHT record.

p2pd has no private-network key, so anybody who can reach a peer can talk to it. What keeps strangers
out is enforced here, in the application:

- Every record a peer stores in the DHT is signed with its libp2p identity key (RSA, the key in its
  `identity.key`) and must be stored under its own peer id as subkey; the record carries the public key,
  and a validator checks that the key hashes to the subkey's peer id and that the signature covers
  (key, subkey, value, expiration). Nobody can write, replace or extend another peer's records.
- A run key (`run.key`) is either a shared secret or a file of allowed peer ids. With a secret, each
  record also carries an HMAC over the same fields; with a list, only listed peer ids may sign. Every
  honest node refuses to store or return records that fail, so a peer without the key never enters the
  run's DHT keys (status records, hivemind's matchmaking keys and state-sharing key alike).
- Averaging groups: each member's gathered data carries a proof (an HMAC of its peer id; with a list,
  the authenticated peer id itself is the proof). A leader refuses join requests without one and every
  member refuses a group that contains a member without one.

Everything that parses stranger data returns False on failure; nothing here raises on bad input.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer

from peers.errors import PeersError

log = logging.getLogger("peers.auth")

MIN_SECRET_CHARS = 16
FILE_PREFIX = "file:"
_ENVELOPE_TAG = b"dlc1"
_RECORD_CONTEXT = b"dilocod.record.v1"
_MAC_CONTEXT = b"dilocod.record-mac.v1"
_MEMBER_CONTEXT = b"dilocod.member.v1"
_MAX_ENVELOPE = 1 << 20  # no record of the run comes near this; it bounds what a stranger makes us parse
_SHA256_MULTIHASH = b"\x12\x20"
_LOG_EVERY = 60.0


@dataclass(frozen=True)
class RunAuth:
    """The run's admission rule: a shared secret, or a set of allowed peer ids (raw multihash bytes).

    The secret never appears in a repr; `describe()` is what may be shown to a user.
    """

    secret: bytes | None = field(default=None, repr=False)
    allowed: frozenset[bytes] | None = None

    def describe(self) -> str:
        if self.allowed is not None:
            return f"allowed peers ({len(self.allowed)} listed)"
        return "shared secret" if self.secret is not None else "open"

    # ---- DHT records --------------------------------------------------------------------------------
    def record_mac(self, message: bytes) -> bytes:
        if self.secret is None:
            return b""
        return hmac.new(self.secret, _MAC_CONTEXT + message, hashlib.sha256).digest()

    def admits_record(self, signer: bytes, message: bytes, mac: bytes) -> bool:
        if self.allowed is not None and signer not in self.allowed:
            return False
        if self.secret is not None:
            return hmac.compare_digest(self.record_mac(message), mac)
        return True

    # ---- averaging groups ---------------------------------------------------------------------------
    def member_proof(self, peer_id: bytes) -> bytes:
        """What a member puts in its gathered data; bound to its (libp2p-authenticated) peer id."""
        if self.secret is None:
            return b""
        return hmac.new(self.secret, _MEMBER_CONTEXT + peer_id, hashlib.sha256).digest()

    def admits_member(self, peer_id: bytes, proof: Any) -> bool:
        if self.allowed is not None and peer_id not in self.allowed:
            return False
        if self.secret is not None:
            return isinstance(proof, bytes) and hmac.compare_digest(self.member_proof(peer_id), proof)
        return True


def parse_run_key(text: str | None) -> RunAuth | None:
    """`run.key` → RunAuth (None: an open run). Raises PeersError with a one-line reason."""
    if text is None:
        return None
    value = text.strip()
    if not value:
        raise PeersError("run.key is empty: leave it out for an open run, or set a secret or 'file:<path>'")
    if value.startswith(FILE_PREFIX):
        return RunAuth(allowed=_read_allowed(Path(value[len(FILE_PREFIX) :].strip())))
    if len(value) < MIN_SECRET_CHARS:
        raise PeersError(
            f"run.key is too short ({len(value)} characters): a shared secret needs at least "
            f"{MIN_SECRET_CHARS} (e.g. the output of `openssl rand -hex 16`)"
        )
    return RunAuth(secret=value.encode())


def _read_allowed(path: Path) -> frozenset[bytes]:
    if not str(path):
        raise PeersError("run.key 'file:' names no file")
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise PeersError(f"run.key: cannot read the allowed-peers file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise PeersError(f"run.key: the allowed-peers file {path} is not text") from None
    allowed: set[bytes] = set()
    for number, line in enumerate(lines, start=1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        peer = _peer_id_bytes(entry)
        if peer is None:
            raise PeersError(f"run.key: {path} line {number}: '{entry[:80]}' is not a peer id")
        allowed.add(peer)
    if not allowed:
        raise PeersError(f"run.key: the allowed-peers file {path} lists no peer id")
    return frozenset(allowed)


def _peer_id_bytes(text: str) -> bytes | None:
    """A base58 peer id → its bytes, or None when it is not one (sha2-256 or identity multihash)."""
    try:
        raw = PeerID.from_base58(text).to_bytes()
    except Exception:
        return None
    if len(raw) == 34 and raw[:2] == _SHA256_MULTIHASH:
        return raw
    if len(raw) >= 2 and raw[0] == 0 and raw[1] == len(raw) - 2:  # identity multihash (ed25519 ids)
        return raw
    return None


# ---------------------------------------------------------------- identity


class Identity:
    """This peer's libp2p identity key (the RSA key p2pd runs with), used to sign its DHT records."""

    def __init__(self, private_key: rsa.RSAPrivateKey) -> None:
        self._key = private_key
        self.public_der = private_key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        self.peer_id = peer_id_of(self.public_der)

    @classmethod
    def load(cls, path: str | Path) -> Identity:
        try:
            proto = crypto_pb2.PrivateKey.FromString(Path(path).read_bytes())
        except OSError as e:
            raise PeersError(f"cannot read the identity key {path}: {e.strerror or e}") from None
        except Exception:
            raise PeersError(f"the identity key {path} is not a libp2p private key") from None
        if proto.key_type != crypto_pb2.KeyType.RSA:
            raise PeersError(f"the identity key {path} is not an RSA key (the only kind hivemind generates)")
        try:
            key = serialization.load_der_private_key(proto.data, password=None)
        except Exception:
            raise PeersError(f"the identity key {path} is damaged") from None
        if not isinstance(key, rsa.RSAPrivateKey):
            raise PeersError(f"the identity key {path} is not an RSA key")
        return cls(key)

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message, padding.PKCS1v15(), hashes.SHA256())


def ensure_identity(path: str | Path) -> Identity:
    """The identity key at `path`, made there (as p2pd makes one) if there is none yet."""
    from hivemind.p2p import P2P

    if not Path(path).exists():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
    return Identity.load(path)


def peer_id_of(public_der: bytes) -> bytes:
    """The libp2p peer id (raw bytes) of an RSA public key, as p2pd derives it."""
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=public_der).SerializeToString()
    return _SHA256_MULTIHASH + hashlib.sha256(encoded).digest()


def signed_by(public_der: bytes, message: bytes, signature: bytes) -> str | None:
    """The base58 peer id of the RSA key that made `signature` over `message`; None when it did not
    (or the key is no RSA key of a sane size). Stranger data: never raises."""
    try:
        key = serialization.load_der_public_key(public_der)
        if not isinstance(key, rsa.RSAPublicKey) or key.key_size > 8192:
            return None
        key.verify(signature, message, padding.PKCS1v15(), hashes.SHA256())
    except (InvalidSignature, ValueError, TypeError):
        return None
    except Exception:
        return None
    return PeerID(peer_id_of(public_der)).to_base58()


# ---------------------------------------------------------------- DHT records


class RunRecordValidator(RecordValidatorBase):
    """Signs this peer's records and admits only records signed by their subkey's owner (and the run key).

    Record value on the wire: msgpack [b"dlc1", value, public key (DER), RSA signature, HMAC or b""].
    Applies to every record of the DHT: a run's DHT holds nothing else, and hivemind's own matchmaking and
    state-sharing records use the peer id as subkey too. Records without a subkey are refused.
    """

    def __init__(self, identity: Identity, auth: RunAuth | None) -> None:
        self.identity = identity
        self.auth = auth
        self._keys: dict[bytes, tuple[rsa.RSAPublicKey, bytes]] = {}
        self._verified: dict[bytes, bool] = {}
        self._last_logged: dict[bytes, float] = {}

    @property
    def priority(self) -> int:
        return 20  # validated first, signed last: other validators see the plain value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False

    def sign_value(self, record: DHTRecord) -> bytes:
        if _owner(record.subkey) != self.identity.peer_id:
            return record.value  # not ours to sign: every node (ours too) will refuse it
        message = _signed_message(record)
        mac = self.auth.record_mac(message) if self.auth is not None else b""
        envelope = [_ENVELOPE_TAG, record.value, self.identity.public_der, self.identity.sign(message), mac]
        return bytes(msgpack.packb(envelope, use_bin_type=True))

    def strip_value(self, record: DHTRecord) -> bytes:
        parts = _unpack_envelope(record.value)
        return parts[1] if parts is not None else record.value

    def validate(self, record: DHTRecord) -> bool:
        try:
            digest = hashlib.sha256(msgpack.packb(_as_tuple(record), use_bin_type=True)).digest()
            cached = self._verified.get(digest)
            if cached is None:
                cached = self._check(record)
                if len(self._verified) > 4096:
                    self._verified.clear()
                self._verified[digest] = cached
            return cached
        except Exception:  # stranger data: whatever it is, it is not a valid record
            return False

    def _check(self, record: DHTRecord) -> bool:
        owner = _owner(record.subkey)
        parts = _unpack_envelope(record.value)
        if owner is None or parts is None:
            return False
        _tag, value, public_der, signature, mac = parts
        key = self._public_key(public_der)
        if key is None or key[1] != owner:
            return False
        message = _signed_message(DHTRecord(record.key, record.subkey, value, record.expiration_time))
        try:
            key[0].verify(signature, message, padding.PKCS1v15(), hashes.SHA256())
        except InvalidSignature:
            return False
        if self.auth is not None and not self.auth.admits_record(owner, message, mac):
            self._log_refusal(owner)
            return False
        return True

    def _public_key(self, public_der: bytes) -> tuple[rsa.RSAPublicKey, bytes] | None:
        found = self._keys.get(public_der)
        if found is None:
            try:
                key = serialization.load_der_public_key(public_der)
            except Exception:
                return None
            if not isinstance(key, rsa.RSAPublicKey) or key.key_size > 8192:
                return None
            if len(self._keys) > 1024:
                self._keys.clear()
            found = self._keys[public_der] = (key, peer_id_of(public_der))
        return found

    def _log_refusal(self, owner: bytes) -> None:
        """A validly signed record without this run's key: say so, at most once a minute per peer."""
        now = time.monotonic()
        if now - self._last_logged.get(owner, -_LOG_EVERY) < _LOG_EVERY:
            return
        if len(self._last_logged) > 1024:
            self._last_logged.clear()
        self._last_logged[owner] = now
        assert self.auth is not None
        why = (
            "it is not in the run's allowed peers" if self.auth.allowed is not None else "its run.key differs"
        )
        log.warning(
            "refused DHT records of peer %s: %s (if every other peer is refused, this peer's run.key is wrong)",
            PeerID(owner).to_base58(),
            why,
        )


def _owner(subkey: bytes) -> bytes | None:
    """The peer id a record's subkey names: our records use its base58 text, hivemind's its bytes."""
    try:
        value = MSGPackSerializer.loads(subkey)
    except Exception:
        return None
    if isinstance(value, str):
        return _peer_id_bytes(value)
    if isinstance(value, bytes) and len(value) == 34 and value[:2] == _SHA256_MULTIHASH:
        return value
    return None


def _unpack_envelope(blob: bytes) -> tuple[bytes, bytes, bytes, bytes, bytes] | None:
    if not isinstance(blob, bytes) or len(blob) > _MAX_ENVELOPE:
        return None
    try:
        parts = msgpack.unpackb(blob, raw=False, use_list=True, max_array_len=5, max_map_len=0)
    except Exception:
        return None
    if not isinstance(parts, list) or len(parts) != 5 or not all(isinstance(p, bytes) for p in parts):
        return None
    if parts[0] != _ENVELOPE_TAG:
        return None
    return parts[0], parts[1], parts[2], parts[3], parts[4]


def _as_tuple(record: DHTRecord) -> list[Any]:
    return [record.key, record.subkey, record.value, float(record.expiration_time)]


def _signed_message(record: DHTRecord) -> bytes:
    return _RECORD_CONTEXT + bytes(msgpack.packb(_as_tuple(record), use_bin_type=True))
