"""The host's answer to a state download keeps nothing once sent (peers/state/fetch.py): hivemind's own
thread held the last served snapshot, in shared memory, until the next download."""

from __future__ import annotations

import gc
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import hivemind.averaging.averager as averager_module
import pytest
import torch
from hivemind.utils import MSGPackSerializer

from peers.state.fetch import forgetful_state_thread, serve_state_requests


class FakePipe:
    """The host end of hivemind's control pipe: requests come in through a queue."""

    def __init__(self) -> None:
        self.requests: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.waiting = threading.Event()  # set while the thread waits for the next request

    def recv(self) -> tuple[str, Any]:
        self.waiting.set()
        item = self.requests.get()
        self.waiting.clear()
        return item


class FakeFuture:
    """Records what was sent, as a weak reference only (the real one pickles it into the pipe)."""

    def __init__(self) -> None:
        self.sent: list[weakref.ref[torch.Tensor]] = []
        self.meta: bytes | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def set_result(self, result: tuple[bytes, tuple[torch.Tensor, ...], Any]) -> None:
        self.meta = result[0]
        self.sent = [weakref.ref(t) for t in result[1]]
        self.done.set()

    def set_exception(self, error: BaseException) -> None:
        self.error = error
        self.done.set()


class Donor:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def get_current_state(self) -> tuple[Any, list[torch.Tensor], None]:
        if self.fail:
            raise RuntimeError("no state to share yet")
        return {"outer_step": 3}, [torch.randn(1000), torch.zeros(10)], None


Fetcher = Callable[[Any, Any, Any], None]


def start_thread(fetcher: Fetcher, donor: Donor) -> tuple[FakePipe, threading.Thread]:
    """The host thread as hivemind starts it: the serializer, the pipe, a weak reference to the getter."""
    pipe = FakePipe()
    getter = weakref.WeakMethod(donor.get_current_state)
    thread = threading.Thread(target=fetcher, args=(MSGPackSerializer, pipe, getter), daemon=True)
    thread.start()
    return pipe, thread


def serve_one(fetcher: Fetcher, donor: Donor) -> tuple[FakeFuture, FakePipe, threading.Thread]:
    pipe, thread = start_thread(fetcher, donor)
    future = FakeFuture()
    pipe.requests.put(("_TRIGGER_GET_CURRENT_STATE", future))
    assert future.done.wait(10)
    deadline = time.monotonic() + 10
    while not pipe.waiting.is_set() and time.monotonic() < deadline:  # back in recv(), the answer sent
        time.sleep(0.01)
    time.sleep(0.05)
    gc.collect()
    return future, pipe, thread


def stop(pipe: FakePipe, thread: threading.Thread) -> None:
    pipe.requests.put(("_SHUTDOWN", None))
    thread.join(10)
    assert not thread.is_alive()


def test_a_served_snapshot_is_not_kept_while_the_thread_waits_for_the_next_request() -> None:
    future, pipe, thread = serve_one(serve_state_requests, Donor())
    assert MSGPackSerializer.loads(future.meta) == {"outer_step": 3} and len(future.sent) == 2
    assert all(ref() is None for ref in future.sent)
    stop(pipe, thread)


def test_hiveminds_own_thread_kept_it_which_is_why_ours_exists() -> None:
    future, pipe, thread = serve_one(averager_module._background_thread_fetch_current_state, Donor())
    assert any(ref() is not None for ref in future.sent)
    stop(pipe, thread)


def test_a_failing_state_provider_answers_with_its_error_and_the_thread_goes_on() -> None:
    donor = Donor(fail=True)
    future, pipe, thread = serve_one(serve_state_requests, donor)
    assert isinstance(future.error, RuntimeError)
    donor.fail = False
    again = FakeFuture()
    pipe.requests.put(("_TRIGGER_GET_CURRENT_STATE", again))
    assert again.done.wait(10) and again.error is None
    stop(pipe, thread)


def test_the_thread_ends_when_its_averager_is_gone() -> None:
    donor = Donor()
    pipe, thread = start_thread(serve_state_requests, donor)
    del donor
    gc.collect()
    pipe.requests.put(("_TRIGGER_GET_CURRENT_STATE", FakeFuture()))
    thread.join(10)
    assert not thread.is_alive()


def test_the_patch_holds_only_while_an_averager_is_built() -> None:
    original = averager_module._background_thread_fetch_current_state
    with forgetful_state_thread():
        assert averager_module._background_thread_fetch_current_state is serve_state_requests
    assert averager_module._background_thread_fetch_current_state is original
    with pytest.raises(KeyError), forgetful_state_thread():
        raise KeyError("a failing constructor")
    assert averager_module._background_thread_fetch_current_state is original
