"""Tests for dilocod.cli's error paths: each user error is one line on stderr and exit code 2.

Only paths that fail before any network or daemon starts. The costly ones run the real
`python -m dilocod`; the rest call `dilocod.cli.main` in-process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dilocod import __version__
from dilocod.cli import EXIT_USAGE
from dilocod.statesync.checkpoint import FILENAME
from tests.tools import run_main

# A whole checkpoint file of another kind (a damaged one is moved aside and the peer goes on:
# tests/test_checkpoint_recovery.py, and tests/test_swarm.py through the CLI).
FOREIGN = {"model": {"w": [1.0, 2.0]}, "epoch": 3}


def run_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dilocod", *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("dilocod: error:")]


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # whatever a failing command might write lands here, not in the repo


# ---------------------------------------------------------------- through `python -m dilocod`


def test_unknown_config_key_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = run_cli(tmp_path, "join", "--set", "trainer.foo=1")
    assert result.returncode == EXIT_USAGE == 2
    assert result.stderr.splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("dilocod: error:")
    assert "'trainer.foo'" in result.stderr
    assert result.stdout == ""


def test_not_a_multiaddr_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = run_cli(tmp_path, "join", "not-a-multiaddr")
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dilocod: error:")
    assert "multiaddr" in lines[0] and "not-a-multiaddr" in lines[0]


def test_version_prints_the_version(tmp_path: Path) -> None:
    result = run_cli(tmp_path, "--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"dilocod {__version__}"


@pytest.fixture(scope="module")
def garbage_checkpoint_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """`join --run-dir DIR` where DIR/checkpoint.pt is a whole file of another program's; run once,
    checked by several tests."""
    base = tmp_path_factory.mktemp("garbage-checkpoint")
    run_dir = base / "run"
    run_dir.mkdir()
    torch.save(FOREIGN, run_dir / FILENAME)
    return run_dir, run_cli(base, "join", "--run-dir", str(run_dir), "--set", "trainer.device=cpu")


def test_garbage_checkpoint_is_exit_2_with_one_error_line_naming_it(
    garbage_checkpoint_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    run_dir, result = garbage_checkpoint_run
    assert result.returncode == 2
    errors = error_lines(result.stderr)
    assert len(errors) == 1
    assert result.stderr.splitlines()[-1] == errors[0]
    assert str(run_dir / FILENAME) in errors[0]


def test_garbage_checkpoint_is_left_untouched_and_nothing_started(
    garbage_checkpoint_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    run_dir, _ = garbage_checkpoint_run
    assert torch.load(run_dir / FILENAME, weights_only=True) == FOREIGN
    # A peer given no peers starts a run: its manifest is signed with its identity before the trainer is
    # built (where the checkpoint is read); nothing else was written, and the DHT never started.
    assert {p.name for p in run_dir.iterdir()} <= {FILENAME, "dilocod.log", "identity.key", "manifest.bin"}


def test_garbage_checkpoint_error_is_the_only_stderr_line(
    garbage_checkpoint_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    _, result = garbage_checkpoint_run
    assert len(result.stderr.splitlines()) == 1


# ---------------------------------------------------------------- in-process through dilocod.cli.main


def test_non_integer_for_int_key_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main(capsys, "join", "--set", "trainer.inner_steps=abc")
    assert code == 2
    assert err.splitlines() == [err.strip()] and err.startswith("dilocod: error:")
    assert "trainer.inner_steps" in err


def test_multiaddr_without_peer_id_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main(capsys, "join", "/ip4/127.0.0.1/tcp/1")
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("dilocod: error:")
    assert "/p2p/" in err


def test_missing_config_file_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main(capsys, "join", "--config", "missing.toml")
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("dilocod: error:")
    assert "missing.toml" in err


def test_bad_value_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main(capsys, "join", "--set", "outer.momentum=1.0")
    assert code == 2
    assert len(err.splitlines()) == 1 and "outer.momentum" in err


def test_malformed_set_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main(capsys, "join", "--set", "inner_steps=3")
    assert code == 2
    assert len(err.splitlines()) == 1 and "inner_steps=3" in err


def test_bootstrap_port_out_of_range_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main(capsys, "bootstrap", "--port", "70000")
    assert code == 2
    assert err.splitlines()[-1].endswith("port 70000 is out of range 0..65535")


def test_join_port_out_of_range_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main(capsys, "join", "--port", "-1")
    assert code == 2
    assert "out of range" in err.splitlines()[-1]


def test_bootstrap_bad_peer_multiaddr_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main(capsys, "bootstrap", "nonsense")
    assert code == 2
    assert len(err.splitlines()) == 1 and "multiaddr" in err


def test_demo_with_zero_peers_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main(capsys, "demo", "--peers", "0")
    assert code == 2
    assert err.splitlines() == ["dilocod: error: --peers must be at least 1, got 0"]


def test_demo_with_bad_override_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main(capsys, "demo", "--set", "trainer.foo=1")
    assert code == 2
    assert len(err.splitlines()) == 1 and "'trainer.foo'" in err


def test_no_command_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = run_main(capsys)
    assert code == 2


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_bad_devices_is_exit_2(capsys: pytest.CaptureFixture[str], value: str) -> None:
    code, err = run_main(capsys, "join", f"--devices={value}")
    assert code == 2
    assert err.splitlines() == [err.strip()] and err.startswith("dilocod: error: trainer.devices must be")
