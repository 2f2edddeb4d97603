"""The checkpoint cadence (`checkpoint.every`) and the writer that streams θ_global from the live tensors
(`dilocod.statesync.checkpoint.checkpoint_due`, `dilocod.node.publishing.CheckpointWriter`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dilocod.config import ConfigError, load_config
from dilocod.node.publishing import CheckpointWriter
from dilocod.observability.metrics import Metrics
from dilocod.statesync.checkpoint import checkpoint_due, load_checkpoint


@pytest.mark.parametrize(
    ("now", "last", "every", "due"),
    [
        (100.0, None, 300.0, True),  # the first round writes one
        (399.0, 100.0, 300.0, False),
        (400.0, 100.0, 300.0, True),
        (100.5, 100.0, 0.0, True),  # 0: every round, as before the cadence existed
    ],
)
def test_a_checkpoint_is_due_once_every_seconds(
    now: float, last: float | None, every: float, due: bool
) -> None:
    assert checkpoint_due(now, last, every) is due


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_bad_cadence_is_one_line(value: str) -> None:
    with pytest.raises(ConfigError, match="checkpoint.every must be >= 0 seconds"):
        load_config(None, [f"checkpoint.every={value}"])


def _writer(tmp_path: Path, every: float, payload: Callable[[], dict[str, Any]]) -> CheckpointWriter:
    async def in_trainer(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        return fn()

    return CheckpointWriter(tmp_path, payload, in_trainer, Metrics(), every=every)


def test_rounds_within_the_cadence_write_nothing_and_a_stop_always_writes(tmp_path: Path) -> None:
    taken: list[int] = []

    def payload() -> dict[str, Any]:
        taken.append(len(taken))
        return {"n": len(taken)}

    async def rounds() -> None:
        writer = _writer(tmp_path, 3600.0, payload)
        for _ in range(3):  # three round ends inside an hour: only the first writes
            await writer.checkpoint()
            await writer.flush()
        await writer.checkpoint(force=True)  # the stop's
        await writer.flush()

    asyncio.run(rounds())
    assert len(taken) == 2
    saved = load_checkpoint(tmp_path)
    assert saved is not None and saved["n"] == 2


def _resident_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_the_rounds_freed_heap_goes_back_before_the_payload_clones(tmp_path: Path) -> None:
    """A round frees Δ, its average and the old θ_global into malloc's free lists; the checkpoint's clones
    must not come on top of those pages (they were each round's peak at the 124m preset)."""
    torch.empty(16 << 20, dtype=torch.uint8).fill_(1)  # freed mmap: glibc now serves < 16 MiB from the heap
    freed = [torch.ones(1 << 20) for _ in range(100)]  # 4 MiB each: a round's buffers, 400 MiB
    pin = torch.ones(1 << 18)  # 1 MiB allocated above them: the heap cannot shrink from its top
    before = _resident_mb()
    del freed
    seen: list[float] = []

    def payload() -> dict[str, Any]:
        seen.append(_resident_mb())
        return {"n": 1}

    async def one() -> None:
        writer = _writer(tmp_path, 0.0, payload)
        await writer.checkpoint()
        await writer.flush()

    asyncio.run(one())
    assert pin.sum() == 1 << 18
    assert seen and seen[0] < before - 300, (before, seen)


def test_the_guard_holds_back_changes_to_live_tensors_until_the_file_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """θ_global goes to disk from the live tensor: an outer step (a trainer-thread job) waits for it."""
    theta = torch.zeros(1 << 20)
    writing, release = threading.Event(), threading.Event()
    original = torch.save

    def slow_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        writing.set()
        release.wait(10)
        original(obj, f, *args, **kwargs)

    async def scenario() -> None:
        writer = _writer(tmp_path, 0.0, lambda: {"theta": theta})
        await writer.checkpoint()
        await asyncio.to_thread(writing.wait, 10)
        step = asyncio.create_task(writer.guard())  # what TrainerThread.run awaits before an outer step
        await asyncio.sleep(0.2)
        assert not step.done()  # the write is still reading θ_global
        release.set()
        await step
        theta.add_(1.0)  # the outer step, once the file is whole

    monkeypatch.setattr(torch, "save", slow_save)
    asyncio.run(scenario())
    saved = load_checkpoint(tmp_path)
    assert saved is not None and float(saved["theta"].sum()) == 0.0 and float(theta.sum()) == theta.numel()
