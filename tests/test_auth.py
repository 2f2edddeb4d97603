"""Run authorization (`run.key`, peers/auth.py): signed DHT records, the run key, and group admission.

Unit tests of the validator and the key parsing; then real DHT nodes and averagers in this process (a peer
with a wrong or no key never enters the run's keys nor a group); then the daemons through the CLI.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import torch
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import P2P, PeerID
from hivemind.utils import MSGPackSerializer

from dilocod.config import ConfigError, describe, load_config
from peers.auth import Identity, RunAuth, RunRecordValidator, parse_run_key
from peers.errors import PeersError
from peers.group import AveragingSettings, GroupAverager
from peers.membership import gathered_proof
from peers.node import Node, NodeSettings
from tests.fakes import round_ticket
from tests.harness import Swarm, get_json

pytestmark = pytest.mark.integration  # real processes, servers or namespaces: not in `make test-fast`

SECRET = "correct horse battery staple"
OTHER = "incorrect horse battery staple"


@pytest.fixture(scope="module")
def identities(tmp_path_factory: pytest.TempPathFactory) -> list[Identity]:
    root = tmp_path_factory.mktemp("identities")
    found = []
    for index in range(2):
        path = root / f"id{index}.key"
        P2P.generate_identity(str(path))
        found.append(Identity.load(path))
    return found


def _record(identity: Identity, value: bytes = b"payload", *, subkey_bytes: bool = False) -> DHTRecord:
    peer = PeerID(identity.peer_id)
    subkey = peer.to_bytes() if subkey_bytes else peer.to_base58()
    return DHTRecord(
        b"k" * 20, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), time.time() + 60
    )


def _signed(validator: RunRecordValidator, record: DHTRecord) -> DHTRecord:
    return DHTRecord(record.key, record.subkey, validator.sign_value(record), record.expiration_time)


# ---------------------------------------------------------------- the validator


@pytest.mark.parametrize("auth", [None, RunAuth(secret=SECRET.encode())], ids=["open", "secret"])
@pytest.mark.parametrize("subkey_bytes", [False, True], ids=["base58-subkey", "bytes-subkey"])
def test_signed_record_validates_and_strips(
    identities: list[Identity], auth: RunAuth, subkey_bytes: bool
) -> None:
    validator = RunRecordValidator(identities[0], auth)
    record = _record(identities[0], subkey_bytes=subkey_bytes)
    signed = _signed(validator, record)
    assert signed.value != record.value
    assert validator.validate(signed)
    assert validator.strip_value(signed) == record.value
    # Another peer's validator with the same rule agrees.
    assert RunRecordValidator(identities[1], auth).validate(signed)


def test_tampered_records_are_refused(identities: list[Identity]) -> None:
    validator = RunRecordValidator(identities[0], None)
    record = _record(identities[0])
    signed = _signed(validator, record)
    tag, value, public_der, signature, mac = msgpack.unpackb(signed.value)

    def envelope(*parts: bytes) -> bytes:
        return bytes(msgpack.packb(list(parts), use_bin_type=True))

    tampered = [
        DHTRecord(signed.key, signed.subkey, envelope(tag, b"\xa5other", public_der, signature, mac), record.expiration_time),
        DHTRecord(signed.key, signed.subkey, signed.value, record.expiration_time + 3600),  # extended
        DHTRecord(b"x" * 20, signed.subkey, signed.value, record.expiration_time),  # moved to another key
        DHTRecord(signed.key, signed.subkey, envelope(tag, value, public_der, b"\0" * len(signature), mac), record.expiration_time),
    ]  # fmt: skip
    for bad in tampered:
        assert not RunRecordValidator(identities[1], None).validate(bad)


def test_only_the_subkey_owner_can_sign(identities: list[Identity]) -> None:
    mine, theirs = identities
    validator = RunRecordValidator(mine, None)
    # A record under another peer's subkey is not signed by us (and so refused, by us too).
    foreign = _record(theirs)
    assert validator.sign_value(foreign) == foreign.value
    assert not validator.validate(foreign)
    # Our valid signature moved under their subkey: the key in it does not hash to their peer id.
    ours = _signed(validator, _record(mine))
    moved = DHTRecord(ours.key, foreign.subkey, ours.value, ours.expiration_time)
    assert not validator.validate(moved)


def test_run_key_hmac_is_required(identities: list[Identity]) -> None:
    keyed = RunRecordValidator(identities[1], RunAuth(secret=SECRET.encode()))
    record = _record(identities[0])
    without = _signed(RunRecordValidator(identities[0], None), record)  # validly signed, no HMAC
    wrong = _signed(RunRecordValidator(identities[0], RunAuth(secret=OTHER.encode())), record)
    right = _signed(RunRecordValidator(identities[0], RunAuth(secret=SECRET.encode())), record)
    assert not keyed.validate(without)
    assert not keyed.validate(wrong)
    assert keyed.validate(right)


def test_allowed_peers_mode(identities: list[Identity]) -> None:
    listed, stranger = identities
    auth = RunAuth(allowed=frozenset({listed.peer_id}))
    assert RunRecordValidator(stranger, auth).validate(
        _signed(RunRecordValidator(listed, auth), _record(listed))
    )
    assert not RunRecordValidator(listed, auth).validate(
        _signed(RunRecordValidator(stranger, auth), _record(stranger))
    )
    assert auth.admits_member(listed.peer_id, None)
    assert not auth.admits_member(stranger.peer_id, b"")


def test_malformed_stranger_data_never_raises(identities: list[Identity]) -> None:
    validator = RunRecordValidator(identities[0], RunAuth(secret=SECRET.encode()))
    good = _signed(validator, _record(identities[0]))
    rng = random.Random(0)
    values: list[object] = [
        b"",
        b"\xc1",
        MSGPackSerializer.dumps(None),
        msgpack.packb([b"dlc1", 1, 2, 3, 4]),
        msgpack.packb([b"dlc1", b"v", b"not a key", b"sig", b"mac"]),
        msgpack.packb({"a": 1}),
        msgpack.packb([b"dlc1"] * 5000),
        good.value[: len(good.value) // 2],
        *[bytes(rng.randrange(256) for _ in range(rng.randrange(1, 600))) for _ in range(200)],
    ]
    subkeys: list[object] = [
        good.subkey,
        b"",
        MSGPackSerializer.dumps(None),
        b"\xc1",
        MSGPackSerializer.dumps(7),
    ]
    for value in values:
        for subkey in subkeys:
            record = DHTRecord(good.key, subkey, value, good.expiration_time)  # type: ignore[arg-type]
            assert validator.validate(record) is False
            validator.strip_value(record)  # returns something, never raises
    for blob in [None, b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb([1, 0, msgpack.packb([b"t", 5])])]:
        assert gathered_proof(MSGPackSerializer, blob) is None


def test_member_proof_binds_the_peer_id(identities: list[Identity]) -> None:
    auth = RunAuth(secret=SECRET.encode())
    mine, theirs = identities[0].peer_id, identities[1].peer_id
    proof = auth.member_proof(mine)
    assert auth.admits_member(mine, proof)
    assert not auth.admits_member(theirs, proof)  # a member's proof is useless to anybody else
    assert not auth.admits_member(mine, RunAuth(secret=OTHER.encode()).member_proof(mine))
    for bad in (None, b"", "text", 5):
        assert not auth.admits_member(mine, bad)


# ---------------------------------------------------------------- run.key in the config


def test_run_key_config_errors_and_redaction(tmp_path: Path, identities: list[Identity]) -> None:
    config = load_config(None, [f"run.key={SECRET}"])
    assert SECRET not in repr(config) and SECRET not in str(describe(config))
    auth = config.run.auth()
    assert auth is not None and auth.secret == SECRET.encode() and SECRET not in repr(auth)

    allowed = tmp_path / "allowed.txt"
    peer = PeerID(identities[0].peer_id).to_base58()
    allowed.write_text(f"# the run's peers\n{peer}  # alice\n\n")
    config = load_config(None, [f"run.key=file:{allowed}"])
    assert config.run.auth() == RunAuth(allowed=frozenset({identities[0].peer_id}))

    (tmp_path / "bad.txt").write_text(f"{peer}\nnot-a-peer-id\n")
    (tmp_path / "empty.txt").write_text("# nobody\n")
    cases = {
        'run.key=""': "run.key is empty",
        "run.key=short": "too short",
        f"run.key=file:{tmp_path / 'missing.txt'}": "cannot read the allowed-peers file",
        f"run.key=file:{tmp_path / 'bad.txt'}": "line 2: 'not-a-peer-id' is not a peer id",
        f"run.key=file:{tmp_path / 'empty.txt'}": "lists no peer id",
    }
    for override, expected in cases.items():
        with pytest.raises(ConfigError) as caught:
            load_config(None, [override])
        assert expected in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(PeersError):
        parse_run_key("   ")


# ---------------------------------------------------------------- real DHTs and averagers, in process

SHAPES = [(1000,), (7, 3)]
NUM = sum(torch.Size(s).numel() for s in SHAPES)


def _ticket(step: int) -> bytes:
    return round_ticket(step, NUM)


@pytest.fixture(scope="module")
def keyed_run() -> Iterator[tuple[list[Node], Node, Node]]:
    """Two peers with the run key, one with a wrong key, one with none; all on one DHT."""
    nodes: list[Node] = []
    try:
        for auth in [SECRET, SECRET, OTHER, None]:
            initial = tuple(nodes[0].visible_maddrs()[:1]) if nodes else ()
            node = Node(
                NodeSettings(
                    run_id="authtest", initial_peers=initial, host="127.0.0.1", auth=parse_run_key(auth)
                )
            )
            node.start()
            nodes.append(node)
        yield nodes[:2], nodes[2], nodes[3]
    finally:
        for node in nodes:
            node.stop()


def test_records_of_a_peer_without_the_key_are_refused(keyed_run: tuple[list[Node], Node, Node]) -> None:
    members, wrong, keyless = keyed_run

    async def scenario() -> None:
        for node in [*members, wrong, keyless]:
            await node.publish("status", node.peer_id.encode(), ttl=60)
        good = {node.peer_id for node in members}

        async def seen(reader: Node) -> set[str]:
            return set((await reader.read_all("status")).keys())

        for reader in members:
            deadline = time.monotonic() + 20
            while await seen(reader) != good and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            assert await seen(reader) == good  # members see each other, never the strangers
            values = await reader.read_all("status")
            assert all(values[peer] == peer.encode() for peer in good)
        # The wrong-key peer sees nobody else's records: it is cut off, not merely hidden.
        assert await seen(wrong) <= {wrong.peer_id}

    asyncio.run(scenario())


def test_a_peer_without_the_key_gets_into_no_group(
    keyed_run: tuple[list[Node], Node, Node], tmp_path: Path
) -> None:
    members, wrong, keyless = keyed_run
    # The averager processes fork from here and inherit this handler: their refusals land in the file.
    log_file = tmp_path / "peers.log"
    handler = logging.FileHandler(log_file)
    logging.getLogger("peers").addHandler(handler)
    options = AveragingSettings(target_group_size=4, min_matchmaking_time=2.0, matchmaking_timeout=10.0)
    groups = [
        GroupAverager(node, [torch.zeros(s) for s in SHAPES], options, state_provider=None)
        for node in [*members, wrong, keyless]
    ]
    try:
        for group in groups:
            group.start()

        async def scenario() -> list:
            inputs = [[torch.full(s, float(i)) for s in SHAPES] for i in range(len(groups))]
            return list(
                await asyncio.gather(
                    *(g.average(1, _ticket(1), x) for g, x in zip(groups, inputs, strict=True))
                )
            )

        outcomes = asyncio.run(scenario())
        members_out, strangers_out = outcomes[:2], outcomes[2:]
        expected = {node.peer_id for node in members}
        for outcome in members_out:
            assert outcome.error is None and outcome.averaged is not None, outcome
            assert set(outcome.members) == expected  # the strangers are in no honest group
            assert torch.allclose(outcome.averaged[0], torch.full((1000,), 0.5))
        for outcome in strangers_out:
            assert outcome.averaged is None or outcome.group_size <= 1, outcome
            assert not set(outcome.members) & expected
    finally:
        for group in groups:
            group.stop()
        logging.getLogger("peers").removeHandler(handler)
        handler.close()
    # The keyless peer sees the members' records (it checks no run key) and asks to join: a leader refuses it.
    assert f"refused peer {keyless.peer_id} into a group: it holds no valid run key" in log_file.read_text()


def test_state_is_served_only_to_key_holders(
    keyed_run: tuple[list[Node], Node, Node], tmp_path: Path
) -> None:
    members, _wrong, keyless = keyed_run
    log_file = tmp_path / "peers.log"
    handler = logging.FileHandler(log_file)
    logging.getLogger("peers").addHandler(handler)
    state = [torch.full(s, 3.0) for s in SHAPES]
    options = AveragingSettings()
    donor = GroupAverager(members[0], state, options, state_provider=lambda: (b"meta", state))
    others = [GroupAverager(node, state, options, state_provider=None) for node in (members[1], keyless)]
    try:
        for group in [donor, *others]:
            group.start()
        donor.set_state_step(5)

        async def fetch(group: GroupAverager) -> object:
            for _ in range(20):  # until the donor's declaration has reached the DHT
                found = await group.download_state(exclude=(), min_step=0, max_elements=10 * NUM, timeout=5)
                if found is not None:
                    return found
                await asyncio.sleep(1)
            return None

        got = asyncio.run(fetch(others[0]))
        assert got is not None and got.donor == members[0].peer_id  # type: ignore[attr-defined]
        # The keyless peer finds the donor (it checks no run key, so it reads the declaration) and is refused.
        assert asyncio.run(fetch(others[1])) is None
    finally:
        for group in [donor, *others]:
            group.stop()
        logging.getLogger("peers").removeHandler(handler)
        handler.close()
    assert f"refused a state download to peer {keyless.peer_id}" in log_file.read_text()


# ---------------------------------------------------------------- the daemons


@pytest.mark.integration
def test_a_peer_with_the_wrong_run_key_is_refused(swarm: Callable[..., Swarm]) -> None:
    s = swarm(2, f"run.key={SECRET}")
    honest = list(s.peers)
    s.wait_all_at(1, timeout=180, peers=honest)
    intruder = s.add_peer(f"run.key={OTHER}")
    intruder_id = s.wait_serving(intruder)["peer_id"]
    target = max(p.status()["outer_step"] for p in honest) + 3
    statuses = s.wait_all_at(target, timeout=240, peers=honest)

    # The run is unaffected: the honest peers keep averaging together (the bootstrap reduces as a third
    # member; the intruder would make a fourth) and agree on θ_global after every round.
    by_step: dict[int, set[str]] = {}
    for status in statuses:
        for entry in status["rounds"]:
            assert entry["group_size"] <= 3, entry
            if entry["result"] == "ok":
                by_step.setdefault(entry["outer_step"], set()).add(entry["global_sha256"])
    assert all(len(found) == 1 for found in by_step.values()), by_step
    assert max(by_step) >= target - 1, by_step
    # The intruder is refused everywhere: in no group, not in the run's status records, and told why.
    assert all(entry["group_size"] <= 1 for entry in intruder.status()["rounds"]), intruder.status()["rounds"]
    assert s.bootstrap is not None
    run = get_json(f"http://127.0.0.1:{s.bootstrap.http_port}/api/run")["peers"]
    assert {p["peer_id"] for p in run} == {st["peer_id"] for st in statuses}
    for proc in [*honest, intruder, s.bootstrap]:
        assert proc.alive, proc.output()[-2000:]
    assert intruder.run_dir is not None
    intruder_log = (intruder.run_dir / "dilocod.log").read_text()
    assert "refused DHT records of peer" in intruder_log and "run.key is wrong" in intruder_log
    assert f"refused DHT records of peer {intruder_id}: its run.key differs" in s.bootstrap.output()
