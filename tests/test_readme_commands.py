"""Every command of the README's `sh` blocks runs here as written, or is a documented exception.

The offline ones (preparing a dataset, getting the model out) run in-process in a scratch directory that
holds what they read: a corpus, a JSONL and a Parquet file, a peer's run dir with a checkpoint. The
exceptions need a network or are the suite itself; docs/testing.md lists them with the tests that
exercise them instead.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from hivemind.p2p import P2P

from peers.auth import Identity
from tests.markdown import code_blocks
from tests.test_export import make_run
from tests.tools import REPO

PROGRAM = ".venv/bin/dilocod"
RUNS_OFFLINE = ("data tokenizer", "data prepare", "export", "generate", "config")
EXCEPTIONS = {  # the command, why it does not run here as written, the tests that exercise it instead
    "make test": ("the suite itself", ()),
    "make demo": ("a swarm on loopback that runs until Ctrl-C", ("test_demo.py",)),
    "join": ("needs a run to join", ("test_manifest_swarm.py",)),
    "bootstrap": ("a daemon on a public port", ("test_manifest_swarm.py", "test_swarm.py")),
    "status": ("needs a node to ask", ("test_status_cmd.py",)),
}
TEXT = "The quick brown fox jumps over the lazy dog.\ndef main(argv):\n    return 0\n"


def readme_commands() -> list[list[str]]:
    """The commands of the README's `sh` blocks, one word list each (continued lines joined)."""
    commands = []
    for block in code_blocks((REPO / "README.md").read_text(encoding="utf-8")):
        if block.lang in ("sh", "bash", "console"):
            for line in block.text.replace("\\\n", " ").splitlines():
                if words := shlex.split(line, comments=True):
                    commands.append(words)
    return commands


def kind(words: list[str]) -> str:
    """`make demo`, `join`, `data prepare`, …: what the command is, for the tables above."""
    if words[0] == "make":
        return " ".join(words[:2])
    assert words[0] == PROGRAM, f"a README command that is neither make nor {PROGRAM}: {shlex.join(words)}"
    return " ".join(words[1:3]) if words[1] == "data" else words[1]


def test_every_readme_command_runs_here_or_is_an_exception() -> None:
    commands = readme_commands()
    assert commands, "no sh blocks found in README.md"
    unknown = [shlex.join(w) for w in commands if kind(w) not in RUNS_OFFLINE and kind(w) not in EXCEPTIONS]
    assert not unknown, f"README commands neither run in this test nor listed in EXCEPTIONS: {unknown}"
    for _, tests in EXCEPTIONS.values():
        for name in tests:
            assert (REPO / "tests" / name).exists(), f"EXCEPTIONS names a test that does not exist: {name}"


def _scratch(root: Path) -> None:
    """What the README's offline commands read, where they read it."""
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"doc{i}.txt").write_text(TEXT * (3 + i) + f"document {i}\n", encoding="utf-8")
    records = [{"text": TEXT + f"record {i}"} for i in range(4)]
    (root / "more.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [TEXT + f"row {i}" for i in range(4)]}), root / "web.parquet")
    P2P.generate_identity(str(root / "id.key"))
    make_run(root / "runs" / "dilocod", Identity.load(root / "id.key"))


def test_the_offline_readme_commands_run_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dilocod.cli import main

    _scratch(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ran = []
    for words in readme_commands():
        if kind(words) in RUNS_OFFLINE:
            code = main(words[1:])
            assert code == 0, f"`{shlex.join(words)}` exited {code}: {capsys.readouterr().err}"
            ran.append(kind(words))
    assert set(ran) >= {"data tokenizer", "data prepare", "export", "generate"}
    assert (tmp_path / "ds" / "index.json").exists() and (tmp_path / "exported" / "config.json").exists()
