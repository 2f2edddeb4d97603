"""dilocod.data.shards: the shard file, index.json parsing, verification and the memory-mapped token stream."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from dilocod.data.errors import DataError
from dilocod.data.prepare import prepare
from dilocod.data.shards import (
    HEADER_SIZE,
    ShardInfo,
    TokenStream,
    index_bytes,
    load_index,
    open_shard,
    parse_index,
    shard_dtype,
    verify_dataset,
    verify_shard,
    write_shard,
)
from dilocod.files import file_sha256


def one_line(e: pytest.ExceptionInfo[DataError]) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_shard_round_trip(tmp_path: Path, dtype: str) -> None:
    tokens = (
        np.arange(1000, dtype=np.int64)
        * (7 if dtype == "uint16" else 70001)
        % (2**16 if dtype == "uint16" else 2**32)
    )
    path = tmp_path / "train-00000.bin"
    info = write_shard(path, tokens, dtype)
    itemsize = np.dtype(dtype).itemsize
    assert info == ShardInfo("train-00000.bin", 1000, file_sha256(path), HEADER_SIZE + 1000 * itemsize)
    raw = path.read_bytes()
    assert raw[:HEADER_SIZE] == struct.pack("<8sIIQQ", b"DLCDTOK\0", 1, itemsize, 1000, 0)
    assert raw[HEADER_SIZE:] == tokens.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    back = open_shard(path, dtype, expected_tokens=1000)
    assert isinstance(back, np.memmap) and not back.flags.writeable
    assert np.array_equal(back, tokens)
    verify_shard(path, info)
    assert not list(tmp_path.glob("*.tmp"))


def test_dtype_by_vocabulary_size() -> None:
    assert shard_dtype(256) == shard_dtype(65536) == "uint16"
    assert shard_dtype(65537) == shard_dtype(200_000) == "uint32"


def test_shard_with_a_bad_header(tmp_path: Path) -> None:
    path = tmp_path / "train-00000.bin"
    write_shard(path, np.arange(10), "uint16")
    raw = bytearray(path.read_bytes())
    raw[:8] = b"NOTATOKS"
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError) as e:
        open_shard(path, "uint16")
    assert one_line(e).startswith(f"{path}: not a dilocod token shard")


def test_shard_of_the_wrong_dtype(tmp_path: Path) -> None:
    path = tmp_path / "eval-00000.bin"
    write_shard(path, np.arange(10), "uint32")
    with pytest.raises(DataError) as e:
        open_shard(path, "uint16")
    assert "4 bytes per token" in one_line(e) and str(path) in str(e.value)


def test_truncated_shard(tmp_path: Path) -> None:
    path = tmp_path / "train-00003.bin"
    write_shard(path, np.arange(100), "uint16")
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(DataError) as e:
        open_shard(path, "uint16")
    assert one_line(e).startswith(f"{path}: header says 100 tokens") and "truncated" in str(e.value)
    path.write_bytes(b"DLCD")
    with pytest.raises(DataError, match="too short for a shard header"):
        open_shard(path, "uint16")


def test_shard_with_other_token_count_than_the_index(tmp_path: Path) -> None:
    path = tmp_path / "train-00000.bin"
    write_shard(path, np.arange(10), "uint16")
    with pytest.raises(DataError, match="10 tokens, the index says 11"):
        open_shard(path, "uint16", expected_tokens=11)


def test_altered_shard_fails_verification(tmp_path: Path) -> None:
    path = tmp_path / "train-00003.bin"
    info = write_shard(path, np.arange(100), "uint16")
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    actual = file_sha256(path)
    with pytest.raises(DataError) as e:
        verify_shard(path, info)
    assert one_line(e) == f"{path}: sha256 {actual} does not match the index's {info.sha256}"
    path.write_bytes(bytes(raw[:-2]))
    with pytest.raises(DataError, match="bytes, the index says"):
        verify_shard(path, info)


def small_dataset(tmp_path: Path, shard_tokens: int = 50) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        (src / f"{i:02d}.txt").write_text(f"document {i} " + "abc" * i, encoding="utf-8")
    out = tmp_path / "ds"
    prepare([src], "byte", out, eval_fraction=0.2, shard_tokens=shard_tokens, progress=False)
    return out


def test_index_of_another_version(tmp_path: Path) -> None:
    out = small_dataset(tmp_path)
    obj = json.loads((out / "index.json").read_bytes())
    obj["version"] = 2
    with pytest.raises(DataError) as e:
        parse_index(index_bytes(obj), "x/index.json")
    assert one_line(e) == "x/index.json: index of another version (2; this dilocod reads version 1)"


def test_index_validation(tmp_path: Path) -> None:
    out = small_dataset(tmp_path)
    raw = (out / "index.json").read_bytes()
    index = parse_index(raw)
    assert load_index(out) == index and index.hash == __import__("hashlib").sha256(raw).hexdigest()
    obj = json.loads(raw)
    with pytest.raises(DataError, match="not in canonical form"):
        parse_index(json.dumps(obj, indent=1).encode())
    with pytest.raises(DataError, match="not a dilocod dataset index"):
        parse_index(index_bytes({**obj, "format": "other"}))
    with pytest.raises(DataError, match="dtype 'uint32' is not 'uint16'"):
        parse_index(index_bytes({**obj, "dtype": "uint32"}))
    obj["splits"]["train"]["tokens"] += 1
    with pytest.raises(DataError, match="its shards hold"):
        parse_index(index_bytes(obj))
    with pytest.raises(DataError, match="not valid JSON"):
        parse_index(b"{")
    with pytest.raises(DataError, match="no such file"):
        load_index(tmp_path)


def test_verify_dataset(tmp_path: Path) -> None:
    out = small_dataset(tmp_path)
    index = verify_dataset(out)
    (out / "tokenizer.json").write_bytes(b"{}")
    with pytest.raises(DataError, match="tokenizer.json: sha256 .* does not match the index's"):
        verify_dataset(out, index)


def test_token_stream_reads_across_shards(tmp_path: Path) -> None:
    out = small_dataset(tmp_path, shard_tokens=37)
    index = load_index(out)
    for split in ("train", "eval"):
        stream = TokenStream(out, index, split)
        whole = np.concatenate(
            [np.asarray(open_shard(out / s.file, index.dtype)) for s in index.split(split).shards]
        )
        assert len(stream) == whole.size == index.split(split).tokens
        for start, stop in [
            (0, len(stream)),
            (0, 0),
            (30, 80),
            (36, 37),
            (37, 38),
            (len(stream) - 5, len(stream)),
        ]:
            got = stream.read(start, stop)
            assert got.dtype == np.int64 and np.array_equal(got, whole[start:stop])
    with pytest.raises(IndexError):
        stream.read(0, len(stream) + 1)
    with pytest.raises(IndexError):
        stream.read(-1, 3)


def test_token_stream_holds_few_shards_open(tmp_path: Path) -> None:
    out = small_dataset(tmp_path, shard_tokens=40)
    index = load_index(out)
    stream = TokenStream(out, index, "train")
    assert len(index.train.shards) > 40
    for start in range(0, len(stream) - 40, 40):
        stream.read(start, start + 41)
    assert len(stream._open) <= 32
