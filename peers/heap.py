"""Giving the C heap's free pages back to the system after a round.

A round allocates and frees buffers of the model's size (Δ, the averaged parts, the outer step's
temporaries, a checkpoint's clones). glibc serves allocations below its mmap threshold from the heap,
and the threshold rises to 32 MiB once a large block is freed, so every tensor of a ≤ 100M model comes
from the heap, and a freed one stays resident until glibc trims the heap, which it does only from the top.
Measured with bench/size.py on the small preset (20.7M parameters, docs/benchmarks.md, "Memory per
parameter"): trimmed once a round, after a checkpoint write and after an all-reduce, a peer's processes
hold ~22 bytes a parameter less (97–99 against 118–123). `malloc_trim(0)` returns every free page of every
arena (madvise), at a cost of milliseconds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache
from typing import Any


@cache
def libc_function(name: str) -> Any | None:
    """The C library's function `name` (ctypes), or None where there is none (musl has no malloc_trim)."""
    library = ctypes.util.find_library("c")
    if library is None:
        return None
    try:
        return getattr(ctypes.CDLL(library), name)
    except (OSError, AttributeError):
        return None


def trim() -> bool:
    """Return the free pages of this process's malloc heaps to the system; False where there is no
    glibc (nothing to do). Safe from any thread: glibc locks each arena while it trims."""
    fn = libc_function("malloc_trim")
    return fn is not None and bool(fn(0))
