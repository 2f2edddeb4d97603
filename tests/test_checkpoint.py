"""Tests for dilocod.statesync.checkpoint: round-trips, atomic writes, and refusing unreadable or unsafe files."""

from __future__ import annotations

import os
import pickle
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch

from dilocod.statesync.checkpoint import (
    FILENAME,
    FORMAT,
    TEMP_PREFIX,
    VERSION,
    CheckpointError,
    check_checkpoint,
    checkpoint_path,
    load_checkpoint,
    save_checkpoint,
)

_EXECUTED: list[str] = []


def _record_execution(tag: str) -> None:
    _EXECUTED.append(tag)


class _RecordsWhenUnpickled:
    """An arbitrary class instance whose unpickling would call back into this module."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_record_execution, ("class instance",))


class _ShellWhenUnpickled:
    """The classic payload: unpickling runs `os.system(command)`."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (self.command,))


def realistic_payload() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)]
    return {
        "run_id": "dilocod",
        "preset": "tiny",
        "outer": {
            "step": 12,
            "params": params,
            "momentum": [torch.zeros_like(p) + 0.5 for p in params],
        },
        "trainer": {
            "model": {"embed.weight": torch.randn(8, 4, generator=gen), "norm.weight": torch.ones(4)},
            "optimizer": {
                "state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(8, 4, generator=gen)}},
                "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0, 1]}],
            },
            "step": 240,
            "rng": torch.randint(0, 255, (16,), dtype=torch.uint8, generator=gen),
            "bf16": torch.randn(3, generator=gen).to(torch.bfloat16),
        },
        "counters": {"round_steps": 0, "rounds_ok": 11, "rounds_failed": 1, "resyncs": 0},
        "loss": 2.345,
        "note": "résumé ✓",
        "tags": ["a", "b"],
        "missing": None,
        "flag": True,
    }


def assert_same(actual: Any, expected: Any) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor)
        assert actual.dtype == expected.dtype and actual.device.type == "cpu"
        assert torch.equal(actual, expected)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected)
        for key in expected:
            assert_same(actual[key], expected[key])
    elif isinstance(expected, list | tuple):
        assert type(actual) is type(expected) and len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_same(a, e)
    else:
        assert type(actual) is type(expected) and actual == expected


def leftover_temp_files(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if p.name.startswith(TEMP_PREFIX))


def assert_refused(run_dir: Path, match: str | None = None) -> str:
    """load_checkpoint raises a one-line CheckpointError naming the file, which is left byte for byte."""
    path = checkpoint_path(run_dir)
    before = path.read_bytes()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(run_dir)
    message = str(info.value)
    assert "\n" not in message, f"not one line: {message!r}"
    assert str(path) in message
    if match is not None:
        assert match in message
    assert path.read_bytes() == before
    assert leftover_temp_files(run_dir) == []
    return message


# ---------------------------------------------------------------- round-trip and atomicity


def test_round_trip_of_a_realistic_payload(tmp_path: Path) -> None:
    payload = realistic_payload()
    path = save_checkpoint(tmp_path, payload)
    assert path == checkpoint_path(tmp_path) == tmp_path / FILENAME
    loaded = load_checkpoint(tmp_path)
    assert loaded is not None
    assert loaded["format"] == FORMAT and loaded["version"] == VERSION
    assert_same({k: v for k, v in loaded.items() if k not in ("format", "version")}, payload)


def test_no_checkpoint_yet_is_none(tmp_path: Path) -> None:
    assert load_checkpoint(tmp_path) is None
    assert load_checkpoint(tmp_path / "never-created") is None


def test_save_creates_the_run_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "x"
    save_checkpoint(run_dir, {"step": 1})
    assert load_checkpoint(run_dir) == {"format": FORMAT, "version": VERSION, "step": 1}


def test_save_leaves_no_temp_files(tmp_path: Path) -> None:
    for step in range(3):
        save_checkpoint(tmp_path, {"step": step, "t": torch.full((4,), float(step))})
        assert leftover_temp_files(tmp_path) == []
    loaded = load_checkpoint(tmp_path)
    assert loaded is not None and loaded["step"] == 2


def test_crash_during_write_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_checkpoint(tmp_path, {"step": 1, "t": torch.arange(4.0)})
    before = checkpoint_path(tmp_path).read_bytes()
    real_save = torch.save

    def crashing_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"PK\x03\x04 half a zip")  # something reached the temp file before the crash
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", crashing_save)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(tmp_path, {"step": 2, "t": torch.zeros(4)})
    monkeypatch.setattr(torch, "save", real_save)

    assert checkpoint_path(tmp_path).read_bytes() == before
    assert leftover_temp_files(tmp_path) == []
    loaded = load_checkpoint(tmp_path)
    assert loaded is not None and loaded["step"] == 1
    assert torch.equal(loaded["t"], torch.arange(4.0))


def test_interrupt_during_write_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_checkpoint(tmp_path, {"step": 1})
    before = checkpoint_path(tmp_path).read_bytes()

    def interrupted_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, {"step": 2})
    assert checkpoint_path(tmp_path).read_bytes() == before
    assert leftover_temp_files(tmp_path) == []


def test_failed_rename_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_checkpoint(tmp_path, {"step": 1})
    before = checkpoint_path(tmp_path).read_bytes()

    def failing_replace(src: Any, dst: Any) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, {"step": 2})
    monkeypatch.undo()
    assert checkpoint_path(tmp_path).read_bytes() == before
    assert leftover_temp_files(tmp_path) == []


def test_crash_before_any_checkpoint_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crashing_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(torch, "save", crashing_save)
    with pytest.raises(RuntimeError):
        save_checkpoint(tmp_path, {"step": 1})
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- unreadable and foreign files


def test_garbage_file_is_refused(tmp_path: Path) -> None:
    checkpoint_path(tmp_path).write_bytes(b"this is not a checkpoint\x00\xff\x01")
    assert_refused(tmp_path, match="unreadable")


def test_empty_file_is_refused(tmp_path: Path) -> None:
    checkpoint_path(tmp_path).write_bytes(b"")
    assert_refused(tmp_path)


def test_the_check_before_the_network_refuses_what_open_refuses_and_leaves_damage_to_it(
    tmp_path: Path,
) -> None:
    # A peer checks its checkpoint before it starts its network (one error line, nothing started), and
    # reads it only after hivemind has forked: the check must refuse a whole foreign file without reading
    # tensors, and leave a damaged one where it is for `open_checkpoint` to move aside.
    check_checkpoint(tmp_path)  # none: fine
    save_checkpoint(tmp_path, realistic_payload())
    check_checkpoint(tmp_path)  # ours: fine
    path = checkpoint_path(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    check_checkpoint(tmp_path)
    assert path.read_bytes() == data[: len(data) // 2]
    torch.save({"format": "another program's", "weights": torch.zeros(3)}, path)
    with pytest.raises(CheckpointError, match="not a dilocod checkpoint"):
        check_checkpoint(tmp_path)


def test_truncated_checkpoint_is_refused(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, realistic_payload())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert_refused(tmp_path, match="unreadable")


def test_pickle_of_a_non_dict_is_refused(tmp_path: Path) -> None:
    torch.save([torch.ones(2), 3], checkpoint_path(tmp_path))
    assert_refused(tmp_path, match="not a dilocod checkpoint")


def test_plain_python_pickle_of_a_non_dict_is_refused(tmp_path: Path) -> None:
    checkpoint_path(tmp_path).write_bytes(pickle.dumps([1, 2, 3], protocol=2))
    assert_refused(tmp_path)


def test_foreign_dict_without_the_format_tag_is_refused(tmp_path: Path) -> None:
    torch.save({"model": {"w": torch.ones(2)}, "epoch": 3}, checkpoint_path(tmp_path))
    assert_refused(tmp_path, match="not a dilocod checkpoint")


def test_dict_with_another_format_tag_is_refused(tmp_path: Path) -> None:
    torch.save({"format": "something-else", "version": VERSION}, checkpoint_path(tmp_path))
    assert_refused(tmp_path, match="not a dilocod checkpoint")


def test_newer_version_is_refused(tmp_path: Path) -> None:
    torch.save({"format": FORMAT, "version": VERSION + 1, "step": 1}, checkpoint_path(tmp_path))
    message = assert_refused(tmp_path, match=f"version {VERSION + 1}")
    assert str(VERSION) in message


def test_missing_version_is_refused(tmp_path: Path) -> None:
    torch.save({"format": FORMAT, "step": 1}, checkpoint_path(tmp_path))
    assert_refused(tmp_path, match="version")


# ---------------------------------------------------------------- no code execution (weights_only)


def test_pickled_class_instance_is_refused_and_not_executed(tmp_path: Path) -> None:
    _EXECUTED.clear()
    torch.save(
        {"format": FORMAT, "version": VERSION, "x": _RecordsWhenUnpickled()}, checkpoint_path(tmp_path)
    )
    assert _EXECUTED == []
    assert_refused(tmp_path, match="unreadable")
    assert _EXECUTED == []


def test_os_system_payload_is_refused_and_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = _ShellWhenUnpickled(f"touch {shlex.quote(str(marker))}")
    torch.save({"format": FORMAT, "version": VERSION, "x": payload}, checkpoint_path(tmp_path))
    assert_refused(tmp_path, match="unreadable")
    assert not marker.exists()


def test_os_system_payload_in_a_plain_pickle_is_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    data = pickle.dumps(_ShellWhenUnpickled(f"touch {shlex.quote(str(marker))}"), protocol=2)
    checkpoint_path(tmp_path).write_bytes(data)
    assert_refused(tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["garbage", "unsafe"])
def test_refusal_reason_neither_advises_disabling_weights_only_nor_holds_escapes(
    tmp_path: Path, kind: str
) -> None:
    path = checkpoint_path(tmp_path)
    if kind == "garbage":
        path.write_bytes(b"garbage\x00\x01")
    else:
        torch.save({"format": FORMAT, "version": VERSION, "x": _RecordsWhenUnpickled()}, path)
    message = assert_refused(tmp_path)
    assert "weights_only" not in message and "\x1b" not in message
