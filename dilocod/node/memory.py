"""How the daemon's processes use the C heap: a bounded number of glibc malloc arenas.

glibc gives each thread that allocates its own arena, up to 8 per core. A daemon runs dozens of threads
(torch's, asyncio's executors, hivemind's) that allocate and free buffers of every size every round, and
each arena keeps its own free pages: in a 40-minute soak a peer daemon's arenas held 82-107 MB resident,
swinging by up to 20 MB from one sample to the next; with two arenas the same daemon held 0.6 MB there
and its whole RSS stayed within 6 MB from its second sample on (docs/benchmarks.md, "Soak").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_ARENA_MAX = -8  # glibc's mallopt parameter number (malloc.h)
ARENAS = 2


def cap_malloc_arenas(arenas: int = ARENAS) -> bool:
    """Cap this process's glibc malloc arenas (and its children's) unless MALLOC_ARENA_MAX already says.

    mallopt changes the running process, and forked children (hivemind's DHT and averager) inherit it;
    the environment variable carries it to processes started afresh. Returns whether the cap is in force
    (False on a libc without mallopt, where there is nothing to cap)."""
    if "MALLOC_ARENA_MAX" in os.environ:  # the user's choice; glibc read it when this process started
        return True
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    if mallopt(M_ARENA_MAX, arenas) != 1:
        return False
    os.environ["MALLOC_ARENA_MAX"] = str(arenas)
    return True
