"""`dilocod export` and `dilocod generate` through `python -m dilocod`, and their one-line errors (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hivemind.p2p import P2P

from dilocod.cli import EXIT_USAGE
from peers.auth import Identity
from tests.test_export import make_run
from tests.tools import run_main

pytestmark = pytest.mark.integration  # real processes, servers or namespaces: not in `make test-fast`

ROOT = Path(__file__).resolve().parent.parent


def run_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "dilocod", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    P2P.generate_identity(str(root / "id.key"))
    make_run(root / "run", Identity.load(root / "id.key"))
    return root / "run"


def test_export_then_generate_from_the_export_and_from_the_run(tmp_path: Path, run_dir: Path) -> None:
    done = run_cli(tmp_path, "export", "--run-dir", str(run_dir), "--out", "model")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("wrote model (") and done.stdout.count("\n") == 1
    assert json.loads((tmp_path / "model" / "dilocod.json").read_text())["outer_step"] == 7

    flags = ["--prompt", "Once upon", "--max-new-tokens", "12", "--seed", "5"]
    from_model = run_cli(tmp_path, "generate", "--model", "model", *flags)
    from_run = run_cli(tmp_path, "generate", "--run-dir", str(run_dir), *flags)
    assert from_model.returncode == 0 and from_run.returncode == 0, from_model.stderr + from_run.stderr
    assert from_model.stdout.startswith("Once upon") and from_model.stdout == from_run.stdout


def test_errors_are_one_line_and_exit_2(
    tmp_path: Path, run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    (tmp_path / "empty-run").mkdir()
    cases = [
        (["export", "--run-dir", str(run_dir), "--out", str(tmp_path / "full")], "is not empty"),
        (
            ["export", "--run-dir", str(tmp_path / "empty-run"), "--out", str(tmp_path / "o")],
            "no checkpoint.pt",
        ),
        (["generate", "--model", str(tmp_path / "full"), "--prompt", "x"], "no config.json"),
        (
            ["export", "--from", "/ip4/127.0.0.1/tcp/1", "--out", str(tmp_path / "o"), "--wait", "0"],
            "out of range",
        ),
        (
            ["export", "--from", "/ip4/127.0.0.1/tcp/1", "--out", str(tmp_path / "o"), "--wait", "soon"],
            "not a number",
        ),
        (["generate", "--run-dir", str(run_dir), "--prompt", "x", "--top-k", "-1"], "is negative"),
        (["generate", "--run-dir", str(run_dir), "--model", str(tmp_path), "--prompt", "x"], "not allowed"),
    ]
    for argv, words in cases:
        code, err = run_main(capsys, *argv)
        lines = [line for line in err.splitlines() if "error:" in line]
        assert code == EXIT_USAGE and len(lines) == 1 and words in lines[0], (argv, err)
    assert not (tmp_path / "o").exists()
