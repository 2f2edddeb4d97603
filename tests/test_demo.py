"""`dilocod demo` (what `make demo` runs): a whole swarm that trains, and Ctrl-C that stops all of it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import REPO, get_json, wait_for

pytestmark = pytest.mark.integration


def _process_groups_with(text: str) -> set[int]:
    """Process groups of the processes whose command line mentions `text`."""
    groups = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if text in cmdline:
                groups.add(os.getpgid(int(entry.name)))
        except (OSError, ProcessLookupError):
            continue
    return groups


def _alive_in_groups(groups: set[int]) -> list[int]:
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) in groups:
                    alive.append(int(entry.name))
            except ProcessLookupError:
                continue
    return alive


def test_demo_trains_then_ctrl_c_stops_everything(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo"
    out = tmp_path / "demo.out"
    with out.open("wb") as sink:
        demo = subprocess.Popen(
            [sys.executable, "-m", "dilocod", "demo", "--peers", "2", "--http-port", "0", "--run-dir", str(run_dir),
             "--set", "trainer.inner_steps=5", "--set", "trainer.batch_size=8", "--set", "trainer.seq_len=64"],
            stdout=sink, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )  # fmt: skip
    groups: set[int] = set()
    try:
        wait_for("the first outer round", lambda: "first outer round completed" in out.read_text(), 180)
        groups = _process_groups_with(str(run_dir)) - {os.getpgid(os.getpid())}
        # the demo itself, the bootstrap and two peers, each in its own group
        assert len(groups) == 4, groups
        text = out.read_text()
        assert "dashboard: http://127.0.0.1:" in text
        assert re.search(r"^outer step [1-9]\d* \| inner", text, re.MULTILINE), text
        # Each peer trains on its share of the machine's cores, which the demo never sets for it.
        share = max(1, len(os.sched_getaffinity(0)) // 2)
        urls = re.findall(r"^peer \d: (http://\S+/api/status)", text, re.MULTILINE)
        assert len(urls) == 2, text
        # A peer that started training before the other claimed its share runs on all the cores until its
        # next look at the registry (every 5 s, node/coreshare.py): both are on their share within that.
        wait_for(
            "both peers on their share of the cores",
            lambda: [get_json(url)["threads"] for url in urls] == [share, share],
            15,
        )

        started = time.monotonic()
        demo.send_signal(signal.SIGINT)
        assert demo.wait(timeout=60) == 0
        assert time.monotonic() - started < 40
        assert _alive_in_groups(groups) == [], "processes (p2pd, DHT, peers) outlived the demo"
        for peer in ("peer-0", "peer-1"):
            assert (run_dir / peer / "checkpoint.pt").exists()
        # A clean stop reads as one: no traceback from the demo or any of its processes.
        for log in (
            out,
            run_dir / "bootstrap.log",
            *(run_dir / p / "console.log" for p in ("peer-0", "peer-1")),
        ):
            assert "Traceback" not in log.read_text(errors="replace"), f"{log}:\n{log.read_text()[-3000:]}"
    finally:
        if demo.poll() is None:
            demo.kill()
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
