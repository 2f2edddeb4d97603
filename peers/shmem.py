"""Giving the averager's shared buffers back to the system between rounds.

The averager process and the daemon share one buffer per parameter tensor (hivemind's
`averaged_tensors`, shared memory made before the fork): our Δ goes in at a round's start, the group's
average comes out at its end, and the daemon clones it out. Between rounds the buffers hold nothing
anyone reads, yet their pages stay resident: 4 bytes a parameter, ~0.5 GB for a 124M model, in every
trainer and in the bootstrap. `madvise(MADV_REMOVE)` frees the pages behind a shared mapping for every
process that maps it; the mapping stays valid and reads zeros until the next round writes it, which
faults fresh pages in (measured with bench/size.py, docs/benchmarks.md "Memory per parameter").

Only call `release` once the averager process is done with the buffers (its step finished): a part still
being sent from a released buffer would carry zeros.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable, Sequence
from functools import cache

import torch

from peers.heap import libc_function

MADV_REMOVE = 9  # linux/mman.h: free the range's backing store (shmem/tmpfs mappings)


@cache
def _madvise() -> Callable[[int, int, int], int] | None:
    fn = libc_function("madvise")
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def whole_pages(address: int, nbytes: int, page: int = mmap.PAGESIZE) -> tuple[int, int]:
    """The page-aligned range inside [address, address + nbytes): (start, length), length 0 if none.
    A partial page at either end stays: it may hold another tensor's bytes or the allocator's header."""
    start = -(-address // page) * page
    end = (address + nbytes) // page * page
    return start, max(0, end - start)


def release(tensors: Sequence[torch.Tensor]) -> int:
    """Free the pages behind these shared-memory CPU tensors; their contents read as zeros afterwards.
    Returns the bytes released (0 where the system cannot: not Linux, not shared memory)."""
    fn = _madvise()
    if fn is None:
        return 0
    released = 0
    for tensor in tensors:
        if tensor.device.type != "cpu" or not tensor.is_shared():
            continue
        storage = tensor.untyped_storage()
        start, length = whole_pages(storage.data_ptr(), storage.nbytes())
        if length and fn(start, length, MADV_REMOVE) == 0:
            released += length
    return released
