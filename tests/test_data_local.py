"""Which copy of the run's dataset a node uses (dilocod/data/localcopy.py `find_local_copy`), as a table."""

from __future__ import annotations

from pathlib import Path

import pytest

from dilocod.data.errors import DataError
from dilocod.data.localcopy import find_local_copy, source_dataset
from dilocod.data.prepare import prepare
from dilocod.data.settings import DataConfig
from dilocod.data.shards import load_index


@pytest.fixture(scope="module")
def run_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("local")
    (root / "a.txt").write_text("the run's own text, " * 500)
    prepare([root / "a.txt"], "byte", root / "ds", eval_fraction=0.5, shard_tokens=1000, progress=False)
    return root / "ds"


def test_a_copy_in_the_run_dir_or_data_path_is_used(run_dataset: Path, tmp_path: Path) -> None:
    cfg = DataConfig(dataset=load_index(run_dataset).hash)
    assert (
        find_local_copy(DataConfig(dataset=cfg.dataset, path=str(run_dataset)), None, may_prepare=False)
        == run_dataset
    )
    run_dir = tmp_path / "run"
    (run_dir).mkdir()
    run_dataset.rename(run_dir / "data")
    try:
        assert find_local_copy(cfg, run_dir, may_prepare=False) == run_dir / "data"
    finally:
        (run_dir / "data").rename(run_dataset)


def test_nothing_here_means_fetch_and_an_empty_data_path_is_where_it_goes(
    run_dataset: Path, tmp_path: Path
) -> None:
    cfg = DataConfig(dataset=load_index(run_dataset).hash, source=str(tmp_path / "nowhere"))
    assert find_local_copy(cfg, tmp_path, may_prepare=False) is None
    empty = tmp_path / "empty"
    empty.mkdir()
    assert find_local_copy(DataConfig(dataset=cfg.dataset, path=str(empty)), None, may_prepare=False) is None


def test_another_dataset_in_data_path_is_refused_naming_both_hashes(run_dataset: Path) -> None:
    other = source_dataset(DataConfig())  # the builtin corpus: another dataset
    run_hash = load_index(run_dataset).hash
    with pytest.raises(DataError, match=f"is not the run's {run_hash}"):
        find_local_copy(DataConfig(dataset=run_hash, path=str(other)), None, may_prepare=False)
