"""External programs some tests drive (Debian's chromium, prometheus, promtool).

Under CI (`CI=true`, see .ci/run, which installs them) a missing program fails the test; elsewhere the
test is skipped with the reason, so a laptop without them still runs the rest of the suite.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "test-artifacts"  # gitignored; CI keeps it

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def need_program(name: str, package: str | None = None) -> str:
    """The path of `name`; fails under CI and skips elsewhere when it is not installed."""
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if path:
        return path
    reason = f"'{name}' is not installed (apt-get install {package or name}); CI=true makes this a failure"
    if in_ci():
        pytest.fail(reason)
    pytest.skip(reason)  # only outside CI: under CI=true it failed just above


def playwright() -> Any:
    """playwright's `sync_playwright`; fails under CI and skips elsewhere when the package is missing."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        reason = "the playwright package is missing (pip install -e '.[dev]'); CI=true makes this a failure"
        if in_ci():
            pytest.fail(reason)
        pytest.skip(reason)  # only outside CI: under CI=true it failed just above
    return sync_playwright


def artifact(name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS / name


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`dilocod.cli.main(args)` in-process: (exit code, stderr)."""
    from dilocod.cli import main

    try:
        code = main(list(args))
    except SystemExit as e:  # argparse errors
        code = e.code if isinstance(e.code, int) else 1
    return code, capsys.readouterr().err
