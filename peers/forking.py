"""Starting hivemind's processes so that they keep sharing the daemon's memory.

hivemind forks its DHT and averager processes from the daemon. A forked child shares the parent's pages
until either writes them, and CPython's cyclic garbage collector writes into every object it visits (the
collector's links live in each object's header): the first full collection in a child, minutes into a
run, copied the pages of every object the daemon had made before the fork (torch, hivemind and ours), and
a peer's memory (PSS) stepped up 80-100 MB once (docs/benchmarks.md, "Soak"). Frozen objects are never visited.
"""

from __future__ import annotations

import gc


def freeze_before_fork() -> None:
    """Collect what is garbage now, then move every object left into the collector's permanent
    generation: a child forked next shares those pages with us for good (they are long-lived anyway:
    modules, classes, the model's Python objects)."""
    gc.collect()
    gc.freeze()
