"""The host's side of a state download, keeping nothing once it has answered.

A peer downloading our state reaches hivemind's averager process, which asks the host (our daemon)
for it through a pipe; a thread in the host answers with `get_current_state()`. To send the tensors,
torch moves their storage into shared memory. hivemind's own thread keeps its last answer in its
local variables while it waits for the next request, so after the first download it holds one
snapshot (θ_global and the outer momentum: 2 × the model in fp32, 7.2 MB for tiny, 8 GB for 1b) in
shared memory until another peer downloads: a step in the daemon's memory at a random hour of the
run (docs/benchmarks.md, "An hour's soak"). This thread answers the same way and drops the answer
once it is sent; torch keeps the shared storage alive for the receiving process until it has mapped it.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import hivemind.averaging.averager as averager_module

log = logging.getLogger(__name__)

GetState = Callable[[], tuple[Any, ...]]


def serve_state_requests(serializer: Any, pipe: Connection, get_state_ref: weakref.WeakMethod) -> None:  # type: ignore[type-arg]
    """The host thread: answer each of the averager process's state requests until it shuts down."""
    while True:
        try:
            trigger, future = pipe.recv()
        except BaseException as e:  # the pipe closed: the averager is gone
            log.debug("state request thread finished: %r", e)
            return
        if trigger == "_SHUTDOWN":
            return
        if not answer_state_request(serializer, future, get_state_ref):
            return
        del future  # nothing of the answer outlives this request


def answer_state_request(serializer: Any, future: Any, get_state_ref: weakref.WeakMethod) -> bool:  # type: ignore[type-arg]
    """Send our state through `future`; False when the averager it belongs to is gone."""
    get_state: GetState | None = get_state_ref()
    if get_state is None:
        return False
    try:
        meta, tensors, infos = get_state()  # StateDonors.get_current_state: always all three
        # on the CPU here, so that the averager process never has to initialise CUDA
        sent = tuple(t.cpu().detach().requires_grad_(t.requires_grad) for t in tensors)
        future.set_result((serializer.dumps(meta), sent, infos))
    except BaseException as e:
        future.set_exception(e)
        log.warning("could not serve our state: %r", e)
    return True


@contextlib.contextmanager
def forgetful_state_thread() -> Iterator[None]:
    """While an averager is being built, its host thread is `serve_state_requests` (hivemind starts it
    from `DecentralizedAverager.__init__` by this module-level name)."""
    original = averager_module._background_thread_fetch_current_state
    averager_module._background_thread_fetch_current_state = serve_state_requests  # type: ignore[assignment]
    try:
        yield
    finally:
        averager_module._background_thread_fetch_current_state = original  # type: ignore[assignment]
