"""The averager's shared buffers go back to the system between rounds (peers/shmem.py)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from peers.shmem import release, whole_pages


def rss_shmem_mb() -> float:
    """This process's resident shared-memory pages (what the averager's buffers cost it)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssShmem in /proc/self/status")


@pytest.mark.parametrize(
    ("address", "nbytes", "expected"),
    [
        (0, 4096 * 3, (0, 4096 * 3)),  # whole pages
        (100, 4096 * 3, (4096, 4096 * 2)),  # a partial page at each end stays
        (4096, 4095, (4096, 0)),  # less than a page: nothing
        (10, 100, (4096, 0)),  # inside one page: nothing
        (8192, 0, (8192, 0)),
    ],
)
def test_whole_pages_keeps_partial_pages(address: int, nbytes: int, expected: tuple[int, int]) -> None:
    assert whole_pages(address, nbytes, page=4096) == expected


def _release_in_child(tensor: torch.Tensor) -> None:
    release([tensor])


def test_release_frees_the_pages_for_every_process_that_maps_them() -> None:
    shared = torch.ones(25_000_000)  # 100 MB
    shared.share_memory_()
    before = rss_shmem_mb()
    assert before >= 95
    # Another process (as the averager is) releases them: the pages go for this process too.
    child = mp.get_context("fork").Process(target=_release_in_child, args=(shared,))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    assert rss_shmem_mb() < before - 95
    start, length = whole_pages(shared.untyped_storage().data_ptr(), shared.untyped_storage().nbytes())
    offset = (start - shared.data_ptr()) // 4
    assert not bool(shared[offset : offset + length // 4].any())  # reads zeros until written again
    shared.fill_(2.0)  # the mapping is still valid: the next round writes it
    assert float(shared.sum()) == 50_000_000.0
    assert rss_shmem_mb() >= 95


def test_release_leaves_private_memory_alone() -> None:
    private = torch.ones(2_000_000)
    assert release([private]) == 0
    assert bool(private.all())
