"""The trainer's data: the builtin corpus as a prepared, memory-mapped dataset, sharded sampling and the
eval windows, over tensors and over the memory-mapped stream alike."""

from __future__ import annotations

import math
import time

import pytest
import torch

from dilocod.data.localcopy import source_dataset
from dilocod.data.shards import TokenStream
from dilocod.trainer.batches import Corpus, DataConfig, ShardSampler, TensorTokens, eval_batches, load_corpus


@pytest.fixture(scope="module")
def builtin() -> Corpus:
    return load_corpus(DataConfig())


def _bytes(source: TokenStream | TensorTokens, start: int = 0, stop: int | None = None) -> bytes:
    stop = len(source) if stop is None else stop
    return bytes(source.read(start, stop).astype("uint8").tolist())


# ---------------------------------------------------------------- builtin source


def test_builtin_corpus_is_a_prepared_dataset_read_from_disk(builtin: Corpus) -> None:
    assert isinstance(builtin.train, TokenStream) and isinstance(builtin.eval, TokenStream)
    assert len(builtin.train) > 1_000_000
    assert len(builtin.eval) > 1_000
    assert b"def " in _bytes(builtin.train, 0, 200_000)
    # Byte tokens, one NUL (id 0) after every document: about one token per byte of text.
    assert 1.0 <= builtin.eval_tokens_per_byte < 1.01
    assert builtin.bits_per_byte(math.log(2)) == pytest.approx(builtin.eval_tokens_per_byte)


def test_builtin_is_prepared_once_and_deterministic(builtin: Corpus) -> None:
    started = time.perf_counter()
    again = load_corpus(DataConfig())
    assert time.perf_counter() - started < 5.0  # prepared once per machine; then only the index is read
    assert again.name == builtin.name  # the name carries the index hash


def test_max_bytes_caps_total(tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DILOCOD_CACHE", str(tmp_path))
    corpus = load_corpus(DataConfig(max_bytes=100_000))
    documents = 100  # an upper bound of the NULs after the documents that fit in 100 kB
    assert len(corpus.train) + len(corpus.eval) <= 100_000 + documents
    assert len(corpus.eval) > 0
    first = source_dataset(DataConfig(max_bytes=100_000))
    assert first.parent == tmp_path / "builtin"  # prepared into the machine cache it was given


def test_bad_config_values() -> None:
    with pytest.raises(ValueError, match="data.eval_fraction"):
        DataConfig(eval_fraction=1.5).validate()
    with pytest.raises(ValueError, match="data.num_shards"):
        DataConfig(num_shards=0).validate()
    with pytest.raises(ValueError, match="data.dataset"):
        DataConfig(dataset="not-a-hash").validate()


# ---------------------------------------------------------------- sampling


def _sampler(tokens: object, peer_key: str = "peer-a", **kw: int) -> ShardSampler:
    args = {"seed": 0, "num_shards": 16, "batch_size": 8, "seq_len": 32} | kw
    return ShardSampler(tokens, peer_key=peer_key, **args)  # type: ignore[arg-type]


def test_batch_shapes_and_shift(builtin: Corpus) -> None:
    x, y = _sampler(builtin.train).batch(0)
    assert x.shape == y.shape == (8, 32)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_batches_are_windows_of_the_shard(builtin: Corpus) -> None:
    sampler = _sampler(builtin.train)
    lo, hi = sampler.shard_range
    assert hi - lo == len(builtin.train) // 16
    shard = _bytes(builtin.train, lo, hi)  # type: ignore[arg-type]
    x, y = sampler.batch(5)
    for row_x, row_y in zip(x, y, strict=True):
        window = bytes(row_x.tolist()) + bytes(row_y[-1:].tolist())
        assert window in shard


def test_the_stream_and_the_same_tokens_in_memory_give_the_same_batches(builtin: Corpus) -> None:
    assert isinstance(builtin.train, TokenStream)
    memory = torch.from_numpy(builtin.train.read(0, len(builtin.train)))
    on_disk, in_memory = _sampler(builtin.train), _sampler(memory)
    for position in (0, 7):
        assert torch.equal(on_disk.batch(position)[0], in_memory.batch(position)[0])


def test_sampling_is_deterministic(builtin: Corpus) -> None:
    a, b = _sampler(builtin.train), _sampler(builtin.train)
    assert a.shard_index == b.shard_index
    for position in (0, 1, 123456):
        xa, ya = a.batch(position)
        xb, yb = b.batch(position)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a.batch(0)[0], a.batch(1)[0])


def test_peers_get_different_batches(builtin: Corpus) -> None:
    a = _sampler(builtin.train, "peer-a")
    b = _sampler(builtin.train, "peer-b")
    assert not torch.equal(a.batch(0)[0], b.batch(0)[0])
    # Over many peers the shard assignment actually spreads out.
    assert len({_sampler(builtin.train, f"peer-{i}").shard_index for i in range(40)}) > 8


def test_shard_index_is_stable_across_processes() -> None:
    # Pinned value: Python's salted hash() would make this differ from run to run.
    tokens = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    assert _sampler(tokens, "peer-a").shard_index == 12
    assert _sampler(tokens, "peer-a", seed=1).shard_index == 3
    assert _sampler(tokens, "peer-b").shard_index == 0


def test_tiny_corpus_falls_back_to_whole_tokens() -> None:
    tokens = torch.frombuffer(bytearray(b"abcdefghij"), dtype=torch.uint8)
    x, y = _sampler(tokens, batch_size=4, seq_len=20).batch(0)
    assert x.shape == (4, 20)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert set(x.flatten().tolist()) <= set(b"abcdefghij")


def test_eval_batches_fixed(builtin: Corpus) -> None:
    a = eval_batches(builtin.eval, seed=3, n_batches=3, batch_size=4, seq_len=16)
    b = eval_batches(builtin.eval, seed=3, n_batches=3, batch_size=4, seq_len=16)
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert xa.shape == (4, 16)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])
    assert not torch.equal(a[0][0], a[1][0])
