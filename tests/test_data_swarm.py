"""A run on a prepared BPE dataset, through the CLI: the manifest pins the dataset by its hash, a peer started
with nothing but `dilocod join <maddr>` and an empty run dir fetches it from the bootstrap and trains, and a
peer offered an altered shard fetches it again from another node and bans the sender."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest

from dilocod.data.localcopy import VERIFIED_FILE, missing_train_shards, open_dataset
from dilocod.data.prepare import prepare
from dilocod.data.shards import INDEX_FILE, load_index
from dilocod.data.tokenizer import train_bpe
from dilocod.node.demo import free_port
from tests.harness import FAST, REPO, Proc, Swarm, round_hashes, wait_for

pytestmark = pytest.mark.integration


def bpe_dataset(root: Path) -> Path:
    """A few hundred kB of the standard library's text, a 512-token BPE, prepared into small shards."""
    sources = root / "text"
    sources.mkdir(parents=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py"))[:60]:
        shutil.copyfile(path, sources / path.name)
    tokenizer = train_bpe([sources], 512, root / "tokenizer.json")
    out = root / "dataset"
    prepare([sources], tokenizer, out, eval_fraction=0.05, shard_tokens=20_000, progress=False)
    return out


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bpe_dataset(tmp_path_factory.mktemp("bpe"))


def test_a_bare_joiner_fetches_the_runs_bpe_dataset_and_trains(tmp_path: Path, dataset: Path) -> None:
    index = load_index(dataset)
    # Chunks of about a shard: a joiner needs a few training shards, not all of them.
    s = Swarm(tmp_path, overrides=(*FAST, f"data.source={dataset}", "data.chunk_tokens=20000"))
    try:
        s.start_bootstrap()
        assert s.bootstrap is not None
        boot = wait_for("the bootstrap's status", s.bootstrap.status, 60)
        assert boot["dataset"] == index.hash  # the manifest pins the dataset by its index hash, not a path
        first = s.add_peer()
        bare = s.add_peer(bare=True)  # `dilocod join <maddr>`, an empty run dir, nothing else
        try:
            statuses = s.wait_all_at(3, timeout=240, evaluated=True)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{s.log_tails()}") from None
        for proc, status in zip((first, bare), statuses, strict=True):
            assert proc.run_dir is not None
            fetched = status["data_fetch"]
            assert fetched is not None and fetched["done"], fetched
            # Up front: the index, the tokenizer and the eval split; then the training shards of its chunks.
            assert fetched["shards_total"] == len(index.eval.shards), fetched
            local, total = fetched["train_shards_local"], fetched["train_shards_total"]
            assert 1 <= local < total == len(index.train.shards), fetched
            copy = proc.run_dir / "data"
            assert open_dataset(copy, index.hash, partial=True).hash == index.hash  # what it holds, verified
            assert len(index.train.shards) - len(missing_train_shards(copy, index)) == local
            assert status["data_schedule"]["unscheduled_batches"] == 0, status["data_schedule"]
            assert status["eval_bits_per_byte"] is not None and status["eval_bits_per_byte"] > 0
        hashes = round_hashes(statuses)
        assert all(len(found) == 1 for found in hashes.values()), hashes
        up_front = sum(f.bytes for f in index.eval.shards)
        served = s.bootstrap.status()["data_served"]
        assert served["bytes_served"] >= 2 * up_front
        assert served["http_port"] and served["bytes_served_http"] >= up_front  # the HTTP path, on loopback
        assert "fetched the run's dataset" in bare.output()
    finally:
        s.close()


def altered_copy(dataset: Path, where: Path) -> str:
    """A copy of `dataset` with one byte of a shard changed, which its own node believes verified (its
    marker says so): a server that serves bytes that do not match the index. Returns the shard's name."""
    shutil.copytree(dataset, where)
    index = load_index(where)
    victim = index.eval.shards[-1].file  # a joiner fetches every eval shard: it meets this one
    path = where / victim
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    marks = {name: [(where / name).stat().st_size, (where / name).stat().st_mtime_ns]
             for name in ["tokenizer.json", *(f.file for f in index.files())]}  # fmt: skip
    (where / VERIFIED_FILE).write_text(json.dumps({"index": index.hash, "files": marks}))
    return victim


def test_a_server_of_an_altered_shard_is_banned_and_the_shard_comes_from_another(
    tmp_path: Path, dataset: Path
) -> None:
    index = load_index(dataset)
    victim = altered_copy(dataset, tmp_path / "altered")
    s = Swarm(tmp_path / "swarm", overrides=(*FAST, f"data.source={dataset}"))
    liar: Proc | None = None
    try:
        s.start_bootstrap()
        port = free_port()
        maddr_file = tmp_path / "liar.maddr"
        sets = [item for o in (*FAST, f"data.path={tmp_path / 'altered'}") for item in ("--set", o)]
        liar = Proc(
            "liar",
            ["bootstrap", s.maddr, "--host", "127.0.0.1", "--port", "0", "--http-host", "127.0.0.1",
             "--http-port", str(port), "--maddr-file", str(maddr_file), "--no-reduce",
             "--config", str(REPO / "configs" / "tiny.toml"), *sets],
            tmp_path / "liar.log",
            port,
        )  # fmt: skip
        liar.start()
        liar_maddr = wait_for("the liar's maddr", lambda: maddr_file.exists() and maddr_file.read_text(), 90)
        liar_maddr = liar_maddr.split()[0]
        liar_id = liar_maddr.rsplit("/", 1)[-1]
        # Given the liar first: it serves the index, the tokenizer and most shards honestly, one altered.
        peer = s.add_peer(bare=True, initial=[liar_maddr, s.maddr])
        assert peer.run_dir is not None
        try:
            status = wait_for(
                "the joiner training on the run's dataset",
                lambda: (st := peer.status()).get("outer_step", 0) >= 1 and st,
                180,
            )
        except AssertionError as e:
            raise AssertionError(f"{e}\n{s.log_tails()}\n--- liar ---\n{liar.output()[-3000:]}") from None
        assert liar_id in status["banned"], status["banned"]
        assert open_dataset(peer.run_dir / "data", index.hash, partial=True).hash == index.hash
        assert (peer.run_dir / "data" / victim).read_bytes() == (dataset / victim).read_bytes()
        assert f"banning {liar_id}" in peer.output()
        assert (peer.run_dir / "data" / INDEX_FILE).exists()
    finally:
        if liar is not None:
            liar.stop()
        s.close()


def test_a_local_copy_of_another_dataset_is_refused_in_one_line(tmp_path: Path, dataset: Path) -> None:
    """`data.path` pointing at another dataset than the run's: exit 2, the file and both hashes named."""
    other = tmp_path / "other"
    prepare([dataset / "tokenizer.json"], "byte", other, eval_fraction=0.5, shard_tokens=4096, progress=False)
    s = Swarm(tmp_path / "swarm", overrides=(*FAST, f"data.source={dataset}"))
    try:
        s.start_bootstrap()
        peer = s.add_peer(f"data.path={other}", bare=True)
        assert peer.popen is not None
        code = peer.popen.wait(timeout=120)
        run_hash, other_hash = load_index(dataset).hash, load_index(other).hash
        lines = [line for line in peer.output().splitlines() if line.startswith("dilocod: error:")]
        assert code == 2, peer.output()[-2000:]
        assert lines == [
            f"dilocod: error: {other / INDEX_FILE}: dataset {other_hash} is not the run's {run_hash}"
        ], peer.output()[-2000:]
    finally:
        s.close()
