"""The layers of docs/architecture.md are a contract `make lint` enforces (`lint-imports`, pyproject.toml's
[tool.importlinter]): each bad import below, put into a copy of the tree, breaks it; the tree as it is
keeps it. Lazy (in-function) and TYPE_CHECKING imports count like any other."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).parent / "lint-imports"

BAD_IMPORTS = [
    # (file, code appended to it, the contract it breaks)
    (
        "dilocod/trainer/model.py",
        "\n\ndef _up():\n    from dilocod.rounds import driver\n",
        "dilocod's layers",
    ),
    (
        "dilocod/trust/bans.py",
        "\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from dilocod.config import Config\n",
        "dilocod's layers",
    ),
    ("dilocod/statesync/ledger.py", "\nimport dilocod.cli\n", "dilocod's layers"),
    ("peers/vote.py", "\nimport dilocod.files\n", "dilocod, then the networking layer"),
    ("proto/schema.py", "\nimport peers.vote\n", "dilocod, then the networking layer"),
    ("dilocod/codecs/__init__.py", "\nimport hivemind\n", "know nothing of the network"),
    (
        "dilocod/trainer/localgroup.py",
        "\ndef _net():\n    import peers.node\n",
        "know nothing of the network",
    ),
]


def lint(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}  # the copy, not the installed checkout
    return subprocess.run(
        [str(LINT), "--no-cache"], cwd=tree, env=env, capture_output=True, text=True, timeout=120
    )


def copy_tree(into: Path) -> Path:
    for package in ("dilocod", "peers", "proto"):
        shutil.copytree(REPO / package, into / package, ignore=shutil.ignore_patterns("__pycache__", "web"))
    shutil.copyfile(REPO / "pyproject.toml", into / "pyproject.toml")
    return into


def test_the_tree_keeps_its_layers(tmp_path: Path) -> None:
    result = lint(copy_tree(tmp_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(("target", "code", "contract"), BAD_IMPORTS, ids=[b[0] for b in BAD_IMPORTS])
def test_an_import_that_breaks_the_layers_fails_the_lint(
    tmp_path: Path, target: str, code: str, contract: str
) -> None:
    tree = copy_tree(tmp_path)
    with (tree / target).open("a") as f:
        f.write(code)
    result = lint(tree)
    assert result.returncode != 0, result.stdout[-3000:]
    broken = [line for line in result.stdout.splitlines() if line.endswith("BROKEN")]
    assert any(contract in line for line in broken), result.stdout[-3000:]
