"""Files written whole or not at all (`dilocod/files.py`): what every file kept across restarts goes through."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from dilocod.files import atomic_file, atomic_write, file_sha256, temp_prefix


def test_a_write_replaces_the_file_whole_and_returns_its_hash(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "state.json"
    path.parent.mkdir()
    path.write_bytes(b"old")
    digest = atomic_write(path, [b"new ", memoryview(b"bytes")])
    assert path.read_bytes() == b"new bytes"
    assert digest == hashlib.sha256(b"new bytes").hexdigest() == file_sha256(path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.json"]  # no temporary file left


def test_a_write_cut_short_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"whole")
    with pytest.raises(RuntimeError), atomic_file(path) as f:
        f.write(b"half")
        assert [p.name for p in tmp_path.glob(f"{temp_prefix(path)}*.tmp")]  # a sweep would find it by name
        raise RuntimeError("killed midway")
    assert path.read_bytes() == b"whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_the_replaced_file_can_be_kept_as_the_previous_one(tmp_path: Path) -> None:
    path, previous = tmp_path / "checkpoint.pt", tmp_path / "checkpoint.prev.pt"
    with atomic_file(path, previous=previous) as f:
        f.write(b"first")
    assert not previous.exists()  # nothing to keep yet
    with atomic_file(path, previous=previous) as f:
        f.write(b"second")
    assert (path.read_bytes(), previous.read_bytes()) == (b"second", b"first")


def test_large_files_hash_in_blocks(tmp_path: Path) -> None:
    data = bytes(range(256)) * (1 << 15)  # 8 MB: two blocks
    (tmp_path / "big").write_bytes(data)
    assert file_sha256(tmp_path / "big") == hashlib.sha256(data).hexdigest()
