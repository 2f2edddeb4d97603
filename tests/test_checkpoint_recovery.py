"""A peer always starts from the newest whole checkpoint: killed writes and damaged files cost a re-sync at
most, never the daemon's start, and nothing is deleted (`dilocod.statesync.checkpoint.open_checkpoint`)."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from dilocod.statesync.checkpoint import (
    FORMAT,
    PREVIOUS,
    TEMP_PREFIX,
    CheckpointError,
    checkpoint_path,
    open_checkpoint,
    save_checkpoint,
)


def _temporaries(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob(f"{TEMP_PREFIX}*"))


def _aside(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.glob("*.bad-*"))


def test_no_checkpoint_is_a_fresh_start_without_notes(tmp_path: Path) -> None:
    opened = open_checkpoint(tmp_path / "never-created")
    assert opened.state is None and opened.notes == []


def test_the_replaced_checkpoint_is_kept_as_the_previous_one(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, {"step": step})
    assert torch.load(tmp_path / PREVIOUS, weights_only=True)["step"] == 2
    opened = open_checkpoint(tmp_path)
    assert opened.state is not None and opened.state["step"] == 3 and opened.notes == []


def test_a_truncated_newest_checkpoint_is_moved_aside_and_the_previous_one_used(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, {"step": 1, "t": torch.arange(1000.0)})
    path = save_checkpoint(tmp_path, {"step": 2, "t": torch.arange(1000.0)})
    damaged = path.read_bytes()[:300]
    path.write_bytes(damaged)

    opened = open_checkpoint(tmp_path)
    assert opened.state is not None and opened.state["step"] == 1 and opened.path == tmp_path / PREVIOUS
    assert len(opened.notes) == 1 and "\n" not in opened.notes[0]
    assert str(path) in opened.notes[0] and "unreadable" in opened.notes[0]
    # Nothing is lost: the damaged bytes are kept under the name the note gives.
    [aside] = _aside(tmp_path)
    assert aside in opened.notes[0] and (tmp_path / aside).read_bytes() == damaged


def test_both_damaged_means_a_start_from_the_run_said_in_one_line_each(tmp_path: Path) -> None:
    checkpoint_path(tmp_path).write_bytes(b"PK\x03\x04 half a zip")
    (tmp_path / PREVIOUS).write_bytes(b"")
    opened = open_checkpoint(tmp_path)
    assert opened.state is None
    assert [n.split(" is unreadable")[0] for n in opened.notes[:2]] == [
        f"checkpoint {checkpoint_path(tmp_path)}",
        f"checkpoint {tmp_path / PREVIOUS}",
    ]
    assert "starting from the run's state" in opened.notes[2]
    assert len(_aside(tmp_path)) == 2 and not checkpoint_path(tmp_path).exists()
    # The next start finds nothing to complain about.
    assert open_checkpoint(tmp_path).notes == []


def test_killed_between_the_two_renames_resumes_from_the_previous_name(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, {"step": 4})
    os.replace(checkpoint_path(tmp_path), tmp_path / PREVIOUS)  # the state such a kill leaves
    opened = open_checkpoint(tmp_path)
    assert opened.state is not None and opened.state["step"] == 4 and opened.notes == []


def test_a_killed_write_leaves_a_temporary_that_the_next_start_removes(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, {"step": 1})
    (tmp_path / f"{TEMP_PREFIX}abc.tmp").write_bytes(b"PK\x03\x04 cut")
    opened = open_checkpoint(tmp_path)
    assert opened.state is not None and opened.state["step"] == 1
    assert _temporaries(tmp_path) == [] and "cut short" in opened.notes[0]


@pytest.mark.parametrize("content", ["foreign", "version"])
def test_a_whole_file_of_another_kind_is_still_refused_and_left_in_place(
    tmp_path: Path, content: str
) -> None:
    path = checkpoint_path(tmp_path)
    torch.save({"model": {}} if content == "foreign" else {"format": FORMAT, "version": 99}, path)
    before = path.read_bytes()
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(tmp_path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    assert path.read_bytes() == before and _aside(tmp_path) == []


# ---------------------------------------------------------------- SIGKILL while writing, 50 times

KILLS = 50
PAYLOAD = torch.randn(2_000_000)  # 8 MB: a write takes tens of ms, so random kills land inside one


def _writer(run_dir: Path, first_step: int, report: int) -> None:
    """Checkpoints steps first_step, first_step + 1, … forever, writing each step to `report` once saved.
    (Forked: the payload is the parent's; torch.save needs no thread pool.)"""
    step = first_step
    while True:
        save_checkpoint(run_dir, {"step": step, "t": PAYLOAD})
        os.write(report, step.to_bytes(4, "little"))
        step += 1


def _reported(fd: int) -> list[int]:
    data = b""
    while chunk := os.read(fd, 4096):
        data += chunk
    return [int.from_bytes(data[i : i + 4], "little") for i in range(0, len(data) - 3, 4)]


@pytest.mark.integration
def test_sigkill_at_random_moments_of_checkpoint_writes_always_leaves_the_last_good_one(
    tmp_path: Path,
) -> None:
    forked = multiprocessing.get_context("fork")
    rng = random.Random(15)
    saved = 0  # the newest step a writer said it finished
    mid_write = 0  # kills that left a temporary file: they hit inside a write
    for _ in range(KILLS):
        opened = open_checkpoint(tmp_path)
        assert _temporaries(tmp_path) == [] and _aside(tmp_path) == [], opened.notes
        step = 0 if opened.state is None else int(opened.state["step"])
        # The last step reported saved is there; at most the one being written when killed is newer.
        assert saved <= step <= saved + 1, (saved, step, opened.notes)
        mid_write += any("cut short" in note for note in opened.notes)

        read_end, write_end = os.pipe()
        writer = forked.Process(target=_writer, args=(tmp_path, step + 1, write_end), daemon=True)
        writer.start()
        os.close(write_end)
        time.sleep(rng.uniform(0.0, 0.25))
        assert writer.pid is not None
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(timeout=10)
        reports = _reported(read_end)
        os.close(read_end)
        saved = reports[-1] if reports else step
    final = open_checkpoint(tmp_path).state
    assert final is not None and saved <= final["step"] <= saved + 1
    # A test of kills mid-write must have killed mid-write (measured: 39 of 50 on 2 busy cores).
    print(f"{mid_write} of {KILLS} kills hit inside a write")
    assert mid_write >= KILLS // 10, mid_write
